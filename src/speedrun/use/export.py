"""``speedrun export``: a finished run's model as an ONNX, TorchScript or safetensors file that
carries how to prepare its input, checked against PyTorch before it is written.

- ONNX and TorchScript hold the whole way from pixels to logits. The input is float32
  N x C x H x W pixels in 0..255, decoded, resized and cropped as the run's
  ``preprocessing.json`` says; the graph normalises them itself with the run's mean and std
  (and the run's arithmetic, so the model sees the bits the run's evaluation fed it). The
  batch dimension is free. The output is the logits of one plain view (no test-time
  augmentation).
- safetensors holds the weights alone, the tensors of ``model.pt`` unchanged, with the recipe
  that builds the model; whoever builds it normalises before it.

Each file also describes itself (input size and layout, mean and std, class names, the recipe,
where normalisation happens): ONNX in ``metadata_props``, TorchScript in an extra file
``preprocessing.json``, safetensors in its header's ``__metadata__``.

Before anything is written, the export is run on the run's own test images (from --data-dir,
else from where the run read them, which its summary.json records; random images where the
data is no longer there, and the output says so) and its logits are compared with the
PyTorch model's; beyond the tolerance nothing is written. The file is written atomically.
"""
from __future__ import annotations

import copy
import importlib.util
import io
import json
import logging
import re
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .. import __version__
from ..data.sources.arrays import load_npz
from ..data.sources.builtin import load_dataset
from ..data.sources.folder import folder_splits
from ..errors import DataError, ExportError, RunFolderError, UsageError
from ..files import atomic_write_bytes, check_output_file, human_bytes
from .loaded import LoadedRun, check_classes, decode_images, load_run, normalise, read_weights

FILE_NAMES = {"onnx": "model.onnx", "torchscript": "model.torchscript.pt", "safetensors": "model.safetensors"}
PACKAGES = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "torchscript": (), "safetensors": ("safetensors",)}
TOLERANCE = 1e-4
"""Largest absolute difference of a logit allowed between the export and PyTorch (fp32)."""
CHECK_IMAGES = 256
CHECK_BATCHES = (1, 100)
"""The check runs one image alone, then batches of 100 and a smaller last one: the free batch
dimension is exercised, not just the example batch the export was traced with."""


# ------------------------------------------------------------------------------------------
# What goes in: the model with the run's normalisation in front, and a description
# ------------------------------------------------------------------------------------------

class PixelsToLogits(nn.Module):
    """The run's normalisation, then its model: float32 pixels in 0..255 -> logits. The
    normalising arithmetic is that of the run's pipeline (:func:`normalise`)."""

    def __init__(self, loaded: LoadedRun):
        super().__init__()
        mean = torch.tensor(loaded.preprocessing["mean"], dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(loaded.preprocessing["std"], dtype=torch.float32).view(1, -1, 1, 1)
        self.streamed = loaded.streamed
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.register_buffer("scale", 1 / std)
        self.register_buffer("shift", -mean / std)
        # fp32 on the CPU whatever the run stored (runtime.cast = "model" keeps bf16/fp16 weights)
        self.model = copy.deepcopy(loaded.model).cpu().float().to(memory_format=torch.contiguous_format)
        self.eval()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.streamed:
            return self.model((pixels - self.mean) / self.std)
        return self.model(torch.addcmul(self.shift, pixels, self.scale))


def describe(loaded: LoadedRun, fmt: str) -> dict:
    """What a user of the exported file needs to know, as JSON-able values."""
    pre = loaded.preprocessing
    h, w = loaded.image_size
    colours = "RGB" if loaded.channels == 3 else "grey"
    if fmt == "safetensors":
        model_input = (f"float32 N x {loaded.channels} x {h} x {w}: (pixels - mean) / std per channel, pixels 0..255 "
                       f"({colours}) prepared as 'preprocessing' says; the model is the one 'recipe_toml' builds")
    else:
        model_input = (f"'pixels': float32 N x {loaded.channels} x {h} x {w}, values 0..255 ({colours}), prepared as "
                       "'preprocessing' says; any N. Normalisation by mean and std is inside the graph")
    return {
        "producer": f"speedrun {__version__}",
        "recipe": loaded.recipe.name,
        "run": loaded.folder.resolve().name,
        "input": model_input,
        "layout": "NCHW",
        "dtype": "float32",
        "normalisation": "before_model" if fmt == "safetensors" else "in_graph",
        "image_size": [h, w],
        "channels": loaded.channels,
        "mean": pre["mean"],
        "std": pre["std"],
        "classes": loaded.classes,
        "output": f"'logits': float32 N x {len(loaded.classes)}, in the order of 'classes'; one plain view "
                  f"(the run evaluated with TTA '{pre['tta']}', which is not in the file)",
        "preprocessing": pre,
        "recipe_toml": loaded.recipe.to_toml(),
    }


def as_strings(description: dict) -> dict[str, str]:
    """The description as string -> string (ONNX and safetensors metadata): JSON for all but strings."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in description.items()}


# ------------------------------------------------------------------------------------------
# The images the export is checked on
# ------------------------------------------------------------------------------------------

@dataclass
class CheckImages:
    pixels: torch.Tensor          # uint8 N, C, H, W on the CPU
    source: str                   # what they are, for the output


def _count_images(n: int, kind: str = "") -> str:
    return f"{n} {kind}image{'s' if n != 1 else ''}"


def _spread(n_available: int, n: int) -> np.ndarray:
    """``n`` indices spread evenly over ``n_available`` (all of them if there are fewer)."""
    return np.unique(np.linspace(0, n_available - 1, min(n, n_available)).round().astype(np.int64))


def _test_images(loaded: LoadedRun, data_dir, n: int) -> CheckImages:
    """Up to ``n`` of the run's test images, as its evaluation prepared them (before normalising),
    from ``data_dir``, else from where the run read its data (as its summary.json records)."""
    data = loaded.recipe.data
    h, w = loaded.image_size
    data_dir = data_dir or loaded.data_path()
    if data.dataset == "folder":
        path = data_dir or data.path
        train, val = folder_splits(path, data.val_fraction, data.split_seed)
        check_classes(loaded, train.classes, str(path))
        x, kept, _ = decode_images(loaded, [val.path(int(i)) for i in _spread(len(val), n)])
        if not kept:
            raise DataError(f"{path}: none of its validation images could be read")
        return CheckImages(x, f"{_count_images(len(kept))} of {path} (validation)")
    ds = load_npz(data_dir or data.path) if data.dataset == "npz" else load_dataset(data.dataset, data_dir, fetch=False)
    check_classes(loaded, ds.classes, ds.source)
    if tuple(ds.test_x.shape[1:]) != (loaded.channels, h, w):
        raise DataError(f"{ds.source}: its images are {tuple(ds.test_x.shape[1:])}, not the run's "
                        f"{(loaded.channels, h, w)}")
    idx = torch.from_numpy(_spread(len(ds.test_x), n))
    return CheckImages(ds.test_x[idx].contiguous(), f"{_count_images(len(idx), 'test ')} of {ds.source}")


def check_images(loaded: LoadedRun, data_dir=None, n: int = CHECK_IMAGES) -> CheckImages:
    """The run's own test images, or ``n`` random images where they are not at hand."""
    try:
        return _test_images(loaded, data_dir, n)
    except DataError as err:
        why = re.split(r"\.\s|:\n", str(err).strip(), maxsplit=1)[0][:200]
        h, w = loaded.image_size
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (n, loaded.channels, h, w), generator=g, dtype=torch.uint8)
        return CheckImages(x, f"{_count_images(n, 'random ')} (the run's test images are not at hand: {why}; "
                              "--data-dir DIR names where they are)")


def _batches(x: torch.Tensor) -> list[torch.Tensor]:
    first, size = CHECK_BATCHES
    rest = len(x) - first
    return list(x.split([first] + [size] * (rest // size) + ([rest % size] if rest % size else []))) \
        if len(x) > first else [x]


@torch.no_grad()
def reference_logits(loaded: LoadedRun, x_u8: torch.Tensor) -> torch.Tensor:
    """The run's model on the images, as its evaluation computes the plain view: fp32."""
    fmt = loaded.runtime.memory_format
    return torch.cat([loaded.model(normalise(loaded, b).contiguous(memory_format=fmt)).float().cpu()
                      for b in _batches(x_u8)])


# ------------------------------------------------------------------------------------------
# The formats: to bytes, and run back from those bytes
# ------------------------------------------------------------------------------------------

@contextmanager
def _quiet():
    """torch's exporters warn about their own internals (deprecations inside torch, optional
    torchvision operators); nothing a user of speedrun can act on."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def to_onnx(net: PixelsToLogits, example: torch.Tensor, description: dict) -> bytes:
    """torch.export-based ONNX (torch's default exporter since 2.9), one file, batch dimension free."""
    with _quiet(), tempfile.TemporaryDirectory() as scratch:
        program = torch.onnx.export(net, (example,), dynamo=True, input_names=["pixels"], output_names=["logits"],
                                    dynamic_shapes={"pixels": {0: torch.export.Dim("batch")}},
                                    external_data=False, verbose=False, artifacts_dir=scratch)
    proto = program.model_proto
    for key, value in as_strings(description).items():
        proto.metadata_props.add(key=key, value=value)
    proto.doc_string = f"{description['recipe']} exported by {description['producer']}: {description['input']}"
    return proto.SerializeToString()


def run_onnx(data: bytes, batches: list[torch.Tensor]) -> torch.Tensor:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return torch.cat([torch.from_numpy(session.run(["logits"], {"pixels": b.numpy()})[0]) for b in batches])


TORCHSCRIPT_EXTRA = "preprocessing.json"


def to_torchscript(net: PixelsToLogits, example: torch.Tensor, description: dict) -> bytes:
    """torch.jit.trace (deprecated in torch 2.13 but working; torch.jit.script cannot compile
    the BatchNorm subclass). The trace's own re-run check is skipped: the export is compared
    with PyTorch on real images afterwards."""
    with _quiet(), torch.no_grad():
        traced = torch.jit.trace(net, example, check_trace=False)
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer, _extra_files={TORCHSCRIPT_EXTRA: json.dumps(description, indent=2)})
    return buffer.getvalue()


@torch.no_grad()
def run_torchscript(data: bytes, batches: list[torch.Tensor]) -> torch.Tensor:
    with _quiet():
        module = torch.jit.load(io.BytesIO(data), map_location="cpu")
    return torch.cat([module(b) for b in batches])


def to_safetensors(state: dict[str, torch.Tensor], description: dict) -> bytes:
    from safetensors.torch import save
    return save({k: v.contiguous() for k, v in state.items()}, metadata=as_strings(description))


def differing_tensors(data: bytes, state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that the safetensors bytes do not hold exactly as ``state`` does."""
    from safetensors.torch import load
    back = load(data)
    return sorted(k for k in set(state) | set(back)
                  if k not in back or k not in state or back[k].dtype != state[k].dtype
                  or back[k].shape != state[k].shape or not torch.equal(back[k], state[k]))


# ------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------

def missing_packages(fmt: str) -> list[str]:
    return [name for name in PACKAGES[fmt] if importlib.util.find_spec(name) is None]


def output_path(loaded: LoadedRun, fmt: str, out: Path | None, need_bytes: int) -> Path:
    """--out, or the format's file in the run folder; refused if it exists or cannot be written."""
    if out is None:
        path = loaded.folder / FILE_NAMES[fmt]
        if path.exists():
            raise RunFolderError(f"{path} already exists (an earlier export?); it is not overwritten: pass "
                                 "--out FILE to write the export elsewhere, or remove it first")
        check_output_file(path, "the export", need_bytes)
        return path
    check_output_file(out, "--out", need_bytes)
    return Path(out)


@dataclass
class Exported:
    path: Path
    size: int
    checked_on: str
    max_difference: float | None      # logits, vs PyTorch (ONNX, TorchScript)
    tensors: int


def export_run(run_dir, fmt: str, out: Path | None = None, data_dir=None, tolerance: float = TOLERANCE) -> Exported:
    """Export the run in ``run_dir`` to ``fmt``, check it, and write it (see the module's docstring)."""
    if fmt not in FILE_NAMES:
        raise UsageError(f"--format {fmt}: unknown format; choose one of {', '.join(FILE_NAMES)}")
    if not tolerance >= 0:
        raise UsageError(f"--tolerance {tolerance}: must be a difference of 0 or more (default {TOLERANCE:g})")
    missing = missing_packages(fmt)
    if missing:
        raise UsageError(f"--format {fmt} needs the Python packages {', '.join(missing)}, which are not installed: "
                         f"pip install {' '.join(missing)}   (or: pip install 'speedrun[export]')")
    loaded = load_run(run_dir, "cpu")
    state = read_weights(loaded.folder / "model.pt")
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    path = output_path(loaded, fmt, out, need_bytes=weight_bytes + (1 << 20))
    description = describe(loaded, fmt)
    if fmt == "safetensors":
        data = to_safetensors(state, description)
        wrong = differing_tensors(data, state)
        if wrong:
            raise ExportError(f"the safetensors bytes do not hold model.pt's tensors exactly ({', '.join(wrong[:5])}); "
                              f"nothing was written to {path}")
        atomic_write_bytes(path, data)
        return Exported(path, len(data), "the tensors of model.pt, read back", None, len(state))

    images = check_images(loaded, data_dir)
    batches = [b.float() for b in _batches(images.pixels)]
    net = PixelsToLogits(loaded)
    exporter, runner = (to_onnx, run_onnx) if fmt == "onnx" else (to_torchscript, run_torchscript)
    try:
        example = images.pixels[:2].float().expand(2, -1, -1, -1).contiguous()   # a batch of 1 would fix N at 1
        data = exporter(net, example, description)
        logits = runner(data, batches)
    except Exception as err:                 # an operator the format lacks, an exporter's failure
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ExportError(f"cannot export {loaded.folder} to {fmt}: {type(err).__name__}: {first}; nothing was "
                          "written") from None
    reference = reference_logits(loaded, images.pixels)
    diff = (logits.float() - reference).abs().max().item() if logits.shape == reference.shape else float("nan")
    if not diff <= tolerance:
        raise ExportError(f"the {fmt} export's logits differ from PyTorch's by up to {diff:.3g} on {images.source}, "
                          f"more than the tolerance {tolerance:g}; nothing was written to {path} "
                          "(--tolerance accepts a larger difference)")
    atomic_write_bytes(path, data)
    return Exported(path, len(data), images.source, diff, len(state))


def export_command(args) -> int:
    from ..report.console import print_table
    done = export_run(args.run, args.format, args.out, args.data_dir, args.tolerance)
    rows = [("file", f"{done.path} ({human_bytes(done.size)})")]
    if args.format == "safetensors":
        rows += [("tensors", f"{done.tensors}, identical to model.pt's"),
                 ("metadata", "preprocessing, classes, mean/std and the recipe (recipe_toml) that builds the model; "
                              "normalise before the model")]
    else:
        rows += [("input", "float32 pixels 0..255, NCHW, any batch size; normalised inside"),
                 ("checked on", done.checked_on),
                 ("max |logit difference|", f"{done.max_difference:.2g} vs PyTorch (tolerance {args.tolerance:g})")]
    print_table(f"exported to {args.format}", rows)
    return 0
