"""A finished run, loaded to be used: its recipe, its weights in the model the recipe builds,
and how its evaluation turned an image file into the model's input (``preprocessing.json``).

``predict``, ``evaluate`` and ``export`` all start here, so an image is prepared in one
place. For a folder run the data layer's own evaluation decoding is used (``ImageItems``
with ``Decoding.for_evaluation``: the same DCT down-scaling, shorter-side resize and centre
crop); for a run on arrays (CIFAR, Fashion-MNIST, ``.npz``) a file is decoded to the stored
channels and brought to the stored size as ``speedrun data prepare`` does (centre square,
resized; a file already that size is left alone). Normalising repeats the arithmetic of the
pipeline the run evaluated with, on the same device, so the batch is bit for bit the one the
run's evaluation saw for that image.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

from ..data.sources.folder import ImageList, decode, read_bytes
from ..data.sources.skipped import reason_of
from ..data.pipeline.stream import Decoding, ImageItems, Unreadable
from ..engine.checkpoint import read_weights
from ..engine.runtime import Runtime, pick_device, resolve_runtime
from ..errors import CheckpointError, DataError, RecordError, RunFolderError
from ..files import read_text
from ..models import build_model
from ..recipe import Recipe, load_recipe

RUN_INPUTS = ("config.toml", "model.pt", "preprocessing.json")
"""What a run folder must hold to be used: the recipe, the weights, the preprocessing."""

PREPROCESSING_KEYS = {"dataset": str, "channels": int, "image_size": list, "mean": list, "std": list,
                      "classes": list, "tta": str}


@dataclass
class LoadedRun:
    """A finished run ready to predict: ``model`` is in eval mode, fp32, on ``runtime.device``
    (in the run's memory layout); ``runtime`` is the run's device choices resolved for that
    device (the precision its evaluation ran in, e.g. bf16 autocast on CUDA, fp32 on a CPU)."""
    folder: Path
    recipe: Recipe
    model: nn.Module
    preprocessing: dict
    classes: list[str]
    runtime: Runtime

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def channels(self) -> int:
        return int(self.preprocessing["channels"])

    @property
    def image_size(self) -> tuple[int, int]:
        h, w = self.preprocessing["image_size"]
        return int(h), int(w)

    @property
    def streamed(self) -> bool:
        """Whether the run evaluated through the streamed (folder) pipeline; else the resident one."""
        return self.preprocessing["dataset"] == "folder"

    def summary(self) -> dict | None:
        """summary.json, or None where it is missing or unreadable."""
        try:
            return json.loads((self.folder / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def data_path(self) -> str | None:
        """Where the run read its data (summary.json's ``data_path``: the folder holding a
        built-in set's files, the image folder or the .npz file), or None where not recorded."""
        summary = self.summary()
        where = summary.get("data_path") if isinstance(summary, dict) else None
        return where if isinstance(where, str) and where else None


def _check_folder(folder: Path) -> None:
    if not folder.exists():
        raise RunFolderError(f"{folder}: no such run folder; give the folder a `speedrun train` run wrote "
                             "(runs/RECIPE-TIME/ or its --out)")
    if not folder.is_dir():
        raise RunFolderError(f"{folder}: is a file, not a run folder; give the folder that holds model.pt")
    missing = [n for n in RUN_INPUTS if not (folder / n).is_file()]
    if not missing:
        return
    interrupted = (folder / "checkpoint.pt").is_file()
    if missing == ["preprocessing.json"] and not interrupted:
        raise RunFolderError(f"{folder}: has no preprocessing.json (how the run prepared its images); it was "
                             "written by an older speedrun. Train the run again to use it")
    resume = f" (it holds checkpoint.pt: continue it with `speedrun train --resume {folder}`)" if interrupted else ""
    raise RunFolderError(f"{folder}: not a finished run: missing {', '.join(missing)}; a run writes them when "
                         f"it finishes, so the run must have finished{resume}")


def read_preprocessing(path: Path) -> dict:
    """preprocessing.json, checked to hold what preparing an image needs."""
    text = read_text(path, "preprocessing.json", RecordError)
    try:
        pre = json.loads(text)
    except json.JSONDecodeError as err:
        raise RecordError(f"{path}: not valid JSON ({err}); the file is damaged") from None
    wrong = [k for k, kind in PREPROCESSING_KEYS.items() if not isinstance(pre, dict) or not isinstance(pre.get(k), kind)]
    if wrong:
        raise RecordError(f"{path}: missing or damaged entries ({', '.join(wrong)}); the file is damaged or not "
                          "speedrun's")
    c = pre["channels"]
    if c not in (1, 3) or len(pre["mean"]) != c or len(pre["std"]) != c or len(pre["image_size"]) != 2:
        raise RecordError(f"{path}: channels, mean, std and image_size do not agree; the file is damaged")
    return pre


def load_run(run_dir: str | Path, device: str | torch.device | None = None) -> LoadedRun:
    """The run in ``run_dir`` with its model on ``device`` ('cpu', 'cuda'; default: CUDA when
    available). Raises RunFolderError, RecipeError, RecordError or CheckpointError naming what
    is wrong; reads only, writes nothing."""
    folder = Path(run_dir)
    _check_folder(folder)
    recipe = load_recipe(str(folder / "config.toml"))
    pre = read_preprocessing(folder / "preprocessing.json")
    if pre["dataset"] != recipe.data.dataset:
        raise RecordError(f"{folder}: preprocessing.json is for dataset {pre['dataset']!r} but config.toml trains "
                          f"{recipe.data.dataset!r}; the folder mixes files of two runs")
    dev = device if isinstance(device, torch.device) else pick_device(device)
    runtime = resolve_runtime(recipe.runtime, dev)
    runtime = runtime.activate()
    state = read_weights(folder / "model.pt")
    model = build_model(recipe.model, pre["channels"], len(pre["classes"]))     # (your factory says what is wrong)
    try:
        model.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).splitlines()[0][:200]
        raise CheckpointError(f"{folder / 'model.pt'}: the weights do not fit the model config.toml builds "
                              f"({first}); the folder mixes files of two runs") from None
    model = runtime.place(model).eval()
    return LoadedRun(folder, recipe, model, pre, [str(c) for c in pre["classes"]], runtime)


# ------------------------------------------------------------------------------------------
# Image files -> the model's input
# ------------------------------------------------------------------------------------------

def _reason(message: str, path: Path) -> str:
    """The why of the data layer's 'cannot decode' message, without its advice on training."""
    return reason_of(message, path)


def _items(loaded: LoadedRun, paths: list[Path]) -> ImageItems:
    """The data layer's evaluation decoding for these files: a folder run's own (its
    eval_crop of the shorter side, resized to image_size); for array runs the whole centre
    square resized to the stored size, as ``data prepare`` makes arrays."""
    listed = ImageList(Path("."), loaded.classes, [str(p) for p in paths], np.zeros(len(paths), dtype=np.int64))
    data = loaded.recipe.data
    if loaded.streamed:
        decoding = Decoding.for_evaluation(loaded.channels, data, skip_corrupt=False)
    else:
        decoding = Decoding(loaded.channels, False, eval_crop=1.0, decoder=data.decoder)
    return ImageItems(listed, decoding)


def _decode_to(path: Path, channels: int, hw: tuple[int, int], decoder: str) -> torch.Tensor:
    """An array run with non-square images: decode, and resize the whole image to ``hw``."""
    img = decode(read_bytes(path), path, channels, decoder=decoder)
    if img.shape[:2] != hw:
        pil = Image.fromarray(img[:, :, 0] if channels == 1 else img)
        img = np.asarray(pil.resize((hw[1], hw[0]), Image.BILINEAR))
        img = img if img.ndim == 3 else img[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(img))


def decode_images(loaded: LoadedRun, paths: list[str | Path]
                  ) -> tuple[torch.Tensor, list[Path], list[tuple[Path, str]]]:
    """(uint8 N, C, H, W batch on the CPU, the paths decoded, [(path, why)] of those that
    could not be), in the order given."""
    paths = [Path(p) for p in paths]
    h, w = loaded.image_size
    items = _items(loaded, paths) if h == w else None
    kept, skipped, images = [], [], []
    for i, path in enumerate(paths):
        if items is not None:
            out = items[(i, h, 0)]
            if isinstance(out, Unreadable):
                skipped.append((path, _reason(str(out), path)))
                continue
            hwc = out[0]
        else:
            try:
                hwc = _decode_to(path, loaded.channels, (h, w), loaded.recipe.data.decoder)
            except DataError as err:
                skipped.append((path, _reason(str(err), path)))
                continue
        images.append(hwc)
        kept.append(path)
    if not images:
        return torch.zeros((0, loaded.channels, h, w), dtype=torch.uint8), kept, skipped
    return torch.stack(images).permute(0, 3, 1, 2), kept, skipped


def normalise(loaded: LoadedRun, x_u8: torch.Tensor) -> torch.Tensor:
    """A uint8 batch normalised as the run's pipeline did, in fp32 on the run's device:
    (x - mean) / std for the streamed pipeline, x * (1 / std) + (-mean / std) for the
    resident one (the same rounding, so the same bits)."""
    dev = loaded.device
    mean = torch.tensor(loaded.preprocessing["mean"], dtype=torch.float32).to(dev)
    std = torch.tensor(loaded.preprocessing["std"], dtype=torch.float32).to(dev)
    x = x_u8.to(dev).float()
    if loaded.streamed:
        return (x - mean[:, None, None]) / std[:, None, None]
    return torch.addcmul((-mean / std)[:, None, None], x, (1 / std)[:, None, None])


def prepare_images(loaded: LoadedRun, paths: list[str | Path]
                   ) -> tuple[torch.Tensor, list[Path], list[tuple[Path, str]]]:
    """Image files -> (normalised float32 N, C, H, W batch on the run's device, the paths in
    it, [(path, why)] of the files that are not readable images, skipped). The batch is what
    the run's evaluation fed its model for the same file, before the cast to the run's
    precision (``loaded.runtime.dtype``) that its pipeline also made."""
    x_u8, kept, skipped = decode_images(loaded, paths)
    return normalise(loaded, x_u8), kept, skipped


def check_classes(loaded: LoadedRun, classes: list[str], where: str) -> None:
    """Refuse data whose classes are not the run's (another data set, or edited folders)."""
    if list(classes) != loaded.classes:
        raise DataError(f"{where}: its classes ({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}) are "
                        f"not the run's ({', '.join(loaded.classes[:5])}{', ...' if len(loaded.classes) > 5 else ''});"
                        " point --data-dir at the data the run was trained on")


__all__ = ["LoadedRun", "check_classes", "decode_images", "load_run", "normalise", "prepare_images",
           "read_preprocessing", "read_weights"]
