"""Published weights by name: torchvision's ResNet files, fetched once into speedrun's cache and
checked against their hash, and timm's ResNets, made by timm (an optional extra).

torchvision names each file after the first 8 hex digits of its SHA-256
(``resnet50-11ad3fa6.pth``); a download whose hash does not start with them, or a cached copy
that no longer does, is not used. ``$SPEEDRUN_WEIGHTS_URL`` replaces the base URL
(https://download.pytorch.org/models/) with a mirror: a server or a ``file://`` folder
holding the same file names.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from urllib.error import URLError
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..files import disk_error, make_folder, remove_folders

BASE_URL = "https://download.pytorch.org/models/"
URL_VARIABLE = "SPEEDRUN_WEIGHTS_URL"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
"""ImageNet's channel statistics in 0..1 units, with which torchvision's and timm's ResNets
were trained (speedrun's pixels are 0..255: multiplied by 255)."""


@dataclass(frozen=True)
class TorchvisionWeights:
    """One of torchvision's published ResNet files: its name, the side its training crops had
    and the side it was evaluated at (centre crop), and its ImageNet top-1 accuracy."""
    file: str
    image_size: int
    eval_size: int
    top1: float

    @property
    def hash_prefix(self) -> str:
        return self.file.rsplit("-", 1)[1].split(".", 1)[0]


# Facts from torchvision's models/resnet.py (0.29): the file names, the evaluation crop (224 px,
# after resizing the shorter side to 256, or 232 for V2) and the accuracies. V1 was trained on
# 224 px crops; V2 with torchvision's later recipe, on 176 px crops (--train-crop-size 176,
# github.com/pytorch/vision/issues/3995, which the weights' metadata cites).
TORCHVISION = {
    "resnet18.IMAGENET1K_V1": TorchvisionWeights("resnet18-f37072fd.pth", 224, 224, 69.758),
    "resnet34.IMAGENET1K_V1": TorchvisionWeights("resnet34-b627a593.pth", 224, 224, 73.314),
    "resnet50.IMAGENET1K_V1": TorchvisionWeights("resnet50-0676ba61.pth", 224, 224, 76.130),
    "resnet50.IMAGENET1K_V2": TorchvisionWeights("resnet50-11ad3fa6.pth", 176, 224, 80.858),
    "resnet101.IMAGENET1K_V1": TorchvisionWeights("resnet101-63fe2227.pth", 224, 224, 77.374),
    "resnet101.IMAGENET1K_V2": TorchvisionWeights("resnet101-cd907fc2.pth", 176, 224, 81.886),
}
DEFAULTS = {"resnet18": "IMAGENET1K_V1", "resnet34": "IMAGENET1K_V1", "resnet50": "IMAGENET1K_V2",
            "resnet101": "IMAGENET1K_V2"}
"""torchvision's DEFAULT weights of each: ``torchvision:resnet50`` is ``resnet50.IMAGENET1K_V2``."""


def torchvision_entry(name: str) -> tuple[str, TorchvisionWeights]:
    """(full name, entry) of ``resnet50.IMAGENET1K_V2``, ``resnet50.DEFAULT`` or ``resnet50``."""
    arch, _, tag = name.partition(".")
    if tag in ("", "DEFAULT") and arch in DEFAULTS:
        name = f"{arch}.{DEFAULTS[arch]}"
    if name not in TORCHVISION:
        known = ", ".join(TORCHVISION)
        raise CheckpointError(f"torchvision has no ResNet weights named {name!r} that speedrun loads; the names are "
                              f"{known} (or ARCH for its default)")
    return name, TORCHVISION[name]


def first_sentence(err: BaseException) -> str:
    """The first sentence of an error from a library, with its kind where it says little alone."""
    text = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:160]
    return text if len(text) > 12 else f"{type(err).__name__} {text}".strip()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_url(file: str) -> str:
    base = os.environ.get(URL_VARIABLE) or BASE_URL
    return base.rstrip("/") + "/" + file


def fetch(file: str, hash_prefix: str, folder: Path) -> Path:
    """``folder/file``, downloaded from the base URL (or ``$SPEEDRUN_WEIGHTS_URL``) unless a
    copy whose SHA-256 starts with ``hash_prefix`` is there already. The download goes to a
    temporary file, is checked, then renamed into place: a failed or mismatched one leaves
    nothing behind (not even the folders made for it)."""
    path = folder / file
    if path.is_file():
        if sha256_of(path).startswith(hash_prefix):
            return path
        try:
            path.unlink()                                 # a damaged copy in speedrun's own cache: fetched again
        except OSError as err:
            raise CheckpointError(f"{path}: the cached copy is damaged (its SHA-256 does not start with "
                                  f"{hash_prefix}) and cannot be removed ({err.strerror}); delete it") from None
    url = weights_url(file)
    made = make_folder(folder)
    tmp = folder / f".{file}.{uuid.uuid4().hex}.tmp"
    try:
        torch.hub.download_url_to_file(url, str(tmp), hash_prefix=hash_prefix, progress=False)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        remove_folders(made)
        if isinstance(err, OSError) and not isinstance(err, (URLError, ConnectionError, TimeoutError)):
            raise CheckpointError(f"cannot write {path}: {disk_error(path, err).reason}; set $SPEEDRUN_CACHE or "
                                  "data.cache_dir to a folder with room for it") from None     # (a full disk, mostly)
        if isinstance(err, OSError):                     # no network, a refused connection, HTTP 404, no such file://
            why = getattr(err, "reason", None) or err.strerror or err
            raise CheckpointError(f"could not fetch {url} ({why}); download it where there is a network and give "
                                  f"the file: --set model.init=/path/{file} (or set ${URL_VARIABLE} to a mirror)"
                                  ) from None
        if isinstance(err, RuntimeError) and "hash" in str(err):
            raise CheckpointError(f"{url}: the download's SHA-256 does not start with {hash_prefix}, as its name "
                                  "says it must: it is not the published file (a mirror serving something else, "
                                  "or a damaged transfer); nothing was kept") from None
        raise
    return path


# ------------------------------------------------------------------------------------------
# timm
# ------------------------------------------------------------------------------------------

def import_timm(spec: str):
    try:
        import timm
    except ImportError:
        raise CheckpointError(f"model.init={spec}: needs timm: pip install 'speedrun[timm]'") from None
    return timm


def timm_model(timm, name: str):
    """timm's model ``name`` without weights (its pretrained_cfg says how they were trained),
    refusing a name timm does not know before anything is fetched."""
    arch = name.split(".", 1)[0]
    if not timm.is_model(arch):
        from .timm_models import check_arch
        try:
            check_arch(timm, arch)
        except Exception as err:                      # the close names, as model.arch's refusal gives them
            hint = str(err).split("models", 1)[-1]
            raise CheckpointError(f"timm has no model {arch!r}{hint}") from None
    try:
        return timm.create_model(name, pretrained=False).eval()
    except Exception as err:                          # an unknown weights tag, mostly
        raise CheckpointError(f"timm cannot make {name} ({first_sentence(err)})") from None


def timm_pretrained(timm, name: str):
    """timm's model ``name`` with its published weights, fetched by timm (from the Hugging Face
    Hub, into its own cache); no network is one line saying how to give a local copy."""
    try:
        return timm.create_model(name, pretrained=True).eval()
    except Exception as err:                         # no network, a hub error: all one line
        hub = _hub_id(timm, name)
        where = f"https://huggingface.co/{hub}/resolve/main/model.safetensors" if hub else "the weights file"
        raise CheckpointError(f"timm could not get the weights of {name} ({first_sentence(err)}); download {where} "
                              f"where there is a network and give it: --set "
                              f"model.init='timm:{name}=/path/model.safetensors'") from None


def _hub_id(timm, name: str) -> str | None:
    try:
        return timm.models.get_pretrained_cfg(name).hf_hub_id
    except Exception:                                 # an unknown tag: no address to name
        return None


def timm_preprocessing(model) -> dict:
    """mean/std (0..255 units) and train/eval sides from a timm model's pretrained_cfg."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    mean, std = cfg.get("mean", IMAGENET_MEAN), cfg.get("std", IMAGENET_STD)
    size = cfg.get("input_size", (3, 224, 224))[-1]
    test = cfg.get("test_input_size") or cfg.get("input_size") or (3, size, size)
    crop = cfg.get("test_crop_pct") or cfg.get("crop_pct")
    return {"mean": [255 * m for m in mean], "std": [255 * s for s in std], "image_size": int(size),
            "eval_size": int(test[-1]), "tag": cfg.get("tag"), "crop": float(crop) if crop else None}
