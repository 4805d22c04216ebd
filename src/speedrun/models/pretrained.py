"""Weights to start from (``model.init``): opened from a speedrun run, a file of ResNet weights
in torchvision's or timm's layout, ``torchvision:NAME`` or ``timm:NAME``, and loaded into a
speedrun model for new data.

:func:`open_weights` turns any of these into one :class:`Pretrained`: the weights in speedrun's
own names, the [model] section that builds the network they fit, and what is known of how they
were trained (normalisation, sides, classes). :func:`apply_weights` loads them into a model
built from that section for the data at hand: a new classifier where the classes differ, the
first layer folded where the channels do. Files are read as tensors only (``torch.load`` with
``weights_only``, or safetensors): a file that would run code when unpickled is refused. Every
refusal is one :class:`~speedrun.errors.CheckpointError` line starting ``model.init=SPEC:``,
and nothing is written on one.
"""
from __future__ import annotations

import functools
import json
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import CheckpointError, SpeedrunError
from ..files import cache_root, expect, read_json_record
from ..recipe import SCHEMES, ResNetConfig, SpeedNetConfig, load_recipe
from . import build_model, classifier_names
from . import published_weights as published
from .resnet_layouts import LOADABLE, first_misfit, is_resnet_layout, to_speedrun
from .whitening import PatchWhitening

RUN_FILES = ("config.toml", "model.pt", "preprocessing.json")
SOURCES = ("a speedrun run folder or its model.pt, a .pt/.pth/.safetensors file of ResNet weights (torchvision's "
           "or timm's layout), torchvision:NAME (e.g. torchvision:resnet50.IMAGENET1K_V2) or timm:NAME[=FILE] "
           "(any of timm's architectures, e.g. timm:convnext_atto.d2_in1k)")


@dataclass
class Pretrained:
    """Weights to start from, in speedrun's layout, with what is known of their training.

    ``model`` is the recipe's [model] section that builds the network they fit (without
    ``init``); ``state`` holds every tensor of that network, the classifier (``head``)
    included; ``mean``/``std`` are per channel in 0..255 pixel units, as speedrun normalises
    (None where the source does not say: the data's own then apply); ``image_size`` and
    ``eval_size`` are the sides they were trained and evaluated at, where known."""
    source: str
    description: str
    model: dict
    state: dict[str, torch.Tensor]
    head: tuple[str, ...]
    in_channels: int
    num_classes: int
    classes: list[str] | None
    mean: list[float] | None
    std: list[float] | None
    image_size: int | None
    eval_size: int | None
    eval_crop: float | None = None        # the centre crop they were evaluated with (timm's crop_pct), where known
    first_conv: str | None = None         # their first convolution's name, where known (timm's pretrained_cfg)


def open_weights(spec: str, cache_dir: str | Path | None = None) -> Pretrained:
    """The weights ``spec`` names (see :data:`SOURCES`), read and converted to speedrun's
    layout. ``torchvision:`` files are fetched into ``cache_dir``/weights (default
    ``$SPEEDRUN_CACHE``, else ``~/.cache/speedrun``) once, then reused. Raises one
    CheckpointError line, ``model.init=SPEC: ...``, for anything it cannot use."""
    try:
        if spec.startswith("timm:"):
            return _from_timm(spec, spec[len("timm:"):])
        if spec.startswith("torchvision:"):
            return _from_torchvision(spec, spec[len("torchvision:"):], cache_dir)
        return _from_path(spec, Path(spec).expanduser())
    except SpeedrunError as err:
        prefix = f"model.init={spec}: "
        message = str(err)
        if message.startswith(f"{spec}: "):             # a file named as given: once is enough
            message = message[len(spec) + 2:]
        raise CheckpointError(message if message.startswith(prefix) else prefix + message) from None


# ------------------------------------------------------------------------------------------
# The sources
# ------------------------------------------------------------------------------------------

def _from_path(spec: str, path: Path) -> Pretrained:
    if not path.exists():
        raise CheckpointError(f"no such file or folder {path}; model.init is a scheme ({', '.join(SCHEMES)}) or "
                              f"weights to start from: {SOURCES}")
    if path.is_dir():
        return _from_run(spec, path)
    if path.name == "model.pt" and (path.parent / "config.toml").is_file():
        return _from_run(spec, path.parent)
    state = read_weights_file(path)
    cfg, converted = _converted(state, path)
    return _resnet(spec, cfg, converted, f"{_resnet_name(cfg)} from {path.name} (sha256 "
                   f"{published.sha256_of(path)[:8]}...)")


def _from_run(spec: str, folder: Path) -> Pretrained:
    """A finished speedrun run: its config.toml builds the network, its model.pt holds the
    weights (read as tensors only), its preprocessing.json says how its images were prepared."""
    missing = [name for name in RUN_FILES if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not a finished speedrun run (it has no {', '.join(missing)}); give the "
                              f"folder a finished `speedrun train` wrote, or {SOURCES}")
    recipe = load_recipe(str(folder / "config.toml"))
    pre = _preprocessing(folder / "preprocessing.json")
    state = read_weights_file(folder / "model.pt")
    channels, classes = pre["channels"], pre["classes"]
    with torch.device("meta"):                            # shapes only
        built = build_model(recipe.model, channels, len(classes))
    expected = built.state_dict()
    misfit = first_misfit(expected, state)
    if misfit:
        raise CheckpointError(f"{folder / 'model.pt'}: the weights do not fit the model its config.toml builds "
                              f"({misfit}); the folder mixes files of two runs")
    model = {k: v for k, v in recipe.to_dict()["model"].items() if k != "init"}
    side = pre["image_size"][0]
    trained = recipe.data.image_size if recipe.data.dataset == "folder" and recipe.data.image_size else side
    return Pretrained(spec, _run_line(folder, recipe, classes), model, state, classifier_names(built), channels,
                      len(classes), classes, pre["mean"], pre["std"], int(trained), side)


def _preprocessing(path: Path) -> dict:
    """What a run's preprocessing.json says of its images: channels, classes, mean and std
    (0..255 units), and the evaluation size."""
    pre = read_json_record(path, "preprocessing.json", "classes", "a finished run writes it", CheckpointError)
    channels = expect(pre.get("channels"), int, path, "channels", CheckpointError)
    out = {"channels": channels, "classes": [str(c) for c in expect(pre["classes"], list, path, "classes",
                                                                     CheckpointError)]}
    for key, n, each in (("mean", channels, "one per channel"), ("std", channels, "one per channel"),
                         ("image_size", 2, "height and width")):
        values = expect(pre.get(key), list, path, key, CheckpointError)
        if len(values) != n or not all(isinstance(v, (int, float)) for v in values):
            raise CheckpointError(f"{path}: entry {key} holds {len(values)} values, not {n} numbers ({each}, "
                                  f"{channels} channel{'s' if channels > 1 else ''}); the file is damaged")
        out[key] = [float(v) for v in values] if key != "image_size" else [int(v) for v in values]
    return out


def _run_line(folder: Path, recipe, classes: list[str]) -> str:
    m = recipe.model
    net = {"resnet": lambda: _resnet_name(m), "speednet": lambda: f"speed net {'/'.join(map(str, m.widths))}",
           "timm": lambda: f"timm {m.arch}", "custom": lambda: f"model.factory={m.factory}"}[m.name]()
    accuracy = ""
    try:
        acc = json.loads((folder / "summary.json").read_text(encoding="utf-8")).get("test_acc")
        accuracy = f", {acc:.2%} test accuracy" if isinstance(acc, (int, float)) else ""
    except (OSError, ValueError, AttributeError):        # no summary: the line without the accuracy
        pass
    return f"speedrun run {folder.name} ({net}, {len(classes)} classes of {recipe.data.dataset}{accuracy})"


def _from_torchvision(spec: str, name: str, cache_dir: str | Path | None) -> Pretrained:
    full, entry = published.torchvision_entry(name)
    path = published.fetch(entry.file, entry.hash_prefix, cache_root(cache_dir and str(cache_dir)) / "weights")
    cfg, converted = _converted(read_weights_file(path), path)
    tag = full.split(".", 1)[1]
    line = (f"{_resnet_name(cfg)} (torchvision {tag} weights, {entry.top1:.1f}% ImageNet top-1, sha256 "
            f"{entry.hash_prefix}...)")
    return _resnet(spec, cfg, converted, line, mean=[255 * m for m in published.IMAGENET_MEAN],
                   std=[255 * s for s in published.IMAGENET_STD], image_size=entry.image_size,
                   eval_size=entry.eval_size)


def _from_timm(spec: str, rest: str) -> Pretrained:
    """timm:NAME (timm fetches the weights) or timm:NAME=FILE (speedrun reads FILE, weights
    only, and checks it is NAME's); timm says how they were trained (its pretrained_cfg). A
    ResNet speedrun builds itself is converted to speedrun's ResNet; any other architecture
    stays timm's network (``model.name = "timm"``)."""
    timm = published.import_timm(spec)
    name, _, file = rest.partition("=")
    path = Path(file).expanduser() if file else None
    if path is not None and not path.is_file():
        raise CheckpointError(f"no such file {path} (timm:NAME=FILE names a local copy of timm's weights)")
    net = published.timm_model(timm, name)
    native = _speedrun_builds(net.state_dict())           # (decided before fetching anything)
    if path is None:
        net = published.timm_pretrained(timm, name)
    else:
        state = read_weights_file(path)
        misfit = first_misfit(net.state_dict(), state)
        rows = _classifier_rows(net, state) if misfit else None
        if rows is not None:                              # (a fine-tuned file: its classifier for its classes)
            net.reset_classifier(rows)
            misfit = first_misfit(net.state_dict(), state)
        if misfit:
            raise CheckpointError(f"{path}: not the weights of timm's {name} ({misfit})")
        net.load_state_dict(state)
    seen = published.timm_preprocessing(net)
    if not native:
        return _timm_network(spec, name, net, path, seen)
    cfg, converted = _converted(net.state_dict(), Path(name))
    line = f"{_resnet_name(cfg)} (timm {name} weights{f' from {path.name}' if path else ''})"
    return _resnet(spec, cfg, converted, line, mean=seen["mean"], std=seen["std"], image_size=seen["image_size"],
                   eval_size=seen["eval_size"])


def _classifier_rows(net: nn.Module, state: dict[str, torch.Tensor]) -> int | None:
    """The number of classes of a file's classifier where it holds one for another number of
    classes than timm's network (weights trained or fine-tuned on other data, as timm's own
    training script saves them); None otherwise. The run replaces the classifier for its data's
    classes in any case."""
    head = classifier_names(net)
    if not head or any(k not in state for k in head):
        return None
    rows = {int(state[k].shape[0]) for k in head if state[k].ndim >= 1}
    mine = {int(t.shape[0]) for k, t in net.state_dict().items() if k in head and t.ndim >= 1}
    return rows.pop() if len(rows) == 1 and rows != mine and min(rows) > 0 else None


def _speedrun_builds(state: dict[str, torch.Tensor]) -> bool:
    """Whether timm weights are those of a ResNet speedrun's own ResNet takes (converted to it)."""
    if not is_resnet_layout(state):
        return False
    try:
        to_speedrun(state)
    except CheckpointError:                               # (resnet10t, resnet26, ...: timm's network instead)
        return False
    return True


def _timm_network(spec: str, name: str, net: nn.Module, path: Path | None, seen: dict) -> Pretrained:
    """Weights of one of timm's architectures, for timm's own network (``model.name = "timm"``)."""
    arch = name.split(".", 1)[0]
    cfg = net.pretrained_cfg or {}
    first = cfg.get("first_conv")
    first = first[0] if isinstance(first, (tuple, list)) else first
    state = net.state_dict()
    in_channels = int(state[f"{first}.weight"].shape[1]) if first and f"{first}.weight" in state else 3
    classes = int(getattr(net, "num_classes", 0) or cfg.get("num_classes") or 0)
    line = f"timm {name} (timm's own network; weights {'from ' + path.name if path else 'from timm'})"
    return Pretrained(spec, line, {"name": "timm", "arch": arch}, state, classifier_names(net), in_channels, classes, None,
                      seen["mean"], seen["std"], seen["image_size"], seen["eval_size"], seen.get("crop"), first)


# ------------------------------------------------------------------------------------------
# Reading and converting
# ------------------------------------------------------------------------------------------

def read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a .pt/.pth (a state dict, possibly under "state_dict" or "model") or
    .safetensors file, read without running any code; one CheckpointError line naming the
    file otherwise."""
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from safetensors.torch import load_file
        try:
            obj = load_file(str(path), device="cpu")
        except Exception as err:                          # truncated, damaged or not safetensors at all
            raise CheckpointError(f"{path}: cannot be read as safetensors ({published.first_sentence(err)}); the "
                                  "file is truncated or damaged: download or save it again") from None
    elif suffix in (".pt", ".pth", ".bin", ".ckpt"):
        try:
            with warnings.catch_warnings():               # (torch warns of pickle protocols it then refuses)
                warnings.simplefilter("ignore")
                obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            if "global" not in str(err).lower():          # no object refused: not a pickle torch can read at all
                raise CheckpointError(f"{path}: cannot be read as torch weights (not a file torch.save wrote); the "
                                      "file is damaged or another kind of file: download or save it again") from None
            raise CheckpointError(f"{path}: holds Python objects besides tensors, which unpickling could run as "
                                  "code, so it is not loaded; save the weights alone (torch.save(model.state_dict(), "
                                  "FILE)) or as .safetensors") from None
        except Exception as err:                          # truncated, damaged, not a torch file
            raise CheckpointError(f"{path}: cannot be read as torch weights ({published.first_sentence(err)}); the "
                                  "file is truncated, damaged or not a torch file: download or save it again") from None
    else:
        raise CheckpointError(f"{path}: not a file of weights (.pt, .pth or .safetensors); {SOURCES}")
    return _state_dict_in(obj, path)


def _state_dict_in(obj, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict):
        for wrapper in ("state_dict", "model"):
            if isinstance(obj.get(wrapper), dict):
                obj = obj[wrapper]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: holds no weights (a dict of tensors, or one under 'state_dict' or 'model', "
                              "is expected)")
    if all(k.startswith("module.") for k in obj):         # saved from a DistributedDataParallel wrapper
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def _converted(state: dict[str, torch.Tensor], path: Path) -> tuple[ResNetConfig, dict[str, torch.Tensor]]:
    if is_resnet_layout(state):
        return to_speedrun(state)
    if _layout(state) in _speedrun_layouts():
        raise CheckpointError(f"{path}: holds a speedrun model's weights without its run; give the run folder "
                              "(config.toml and preprocessing.json beside model.pt say what network and data they are)")
    if _layout(state)[0] == {"features", "classifier"}:
        raise CheckpointError(f"{path}: looks like {_torchvision_family(state)} (tensors features.*, classifier.*), "
                              f"not a ResNet; {LOADABLE}")
    raise CheckpointError(f"{path}: not a ResNet in torchvision's or timm's layout (its first tensor is "
                          f"{next(iter(state))}); {LOADABLE}")


def _layout(state: dict) -> tuple[frozenset[str], frozenset[str]]:
    """How a state dict is laid out: the first parts of its tensors' names, and its
    classifier's tensors (``head.*``)."""
    return frozenset(k.split(".", 1)[0] for k in state), frozenset(k for k in state if k.startswith("head."))


@functools.cache
def _speedrun_layouts() -> frozenset[tuple[frozenset[str], frozenset[str]]]:
    """The layouts of the networks speedrun builds (a speed net; a ResNet, post- and
    pre-activation), read from the networks themselves."""
    sections = (SpeedNetConfig(widths=[8]), ResNetConfig(depth=18), ResNetConfig(depth=18, preact=True))
    with torch.device("meta"):                            # names only
        return frozenset(_layout(build_model(cfg, 3, 2).state_dict()) for cfg in sections)


_TORCHVISION_FAMILIES = (                                 # a tensor name only that family's networks have
    (re.compile(r"features\.denseblock\d+\."), "DenseNet"),
    (re.compile(r"features\.\d+\.(squeeze|expand1x1)\."), "SqueezeNet"),
    (re.compile(r"features\.\d+\.conv\."), "MobileNetV2"),
    (re.compile(r"features\.\d+\.block\."), "MobileNetV3"),
    (re.compile(r"features\.\d+\.\d+\.layer_scale$"), "ConvNeXt"),
    (re.compile(r"features\.\d+\.\d+\.block\."), "EfficientNet"),
)
_PLAIN_LAYER = re.compile(r"features\.\d+\.\w+$")      # VGG's and AlexNet's: one flat Sequential


def _torchvision_family(state: dict) -> str:
    """Which of torchvision's networks that name their tensors features.* and classifier.* the
    weights look like, from the names alone."""
    for pattern, family in _TORCHVISION_FAMILIES:
        if any(pattern.match(k) for k in state):
            return f"torchvision's {family} weights"
    if all(_PLAIN_LAYER.match(k) for k in state if k.startswith("features.")):
        return f"torchvision's {'AlexNet' if 'classifier.1.weight' in state else 'VGG'} weights"
    return "the weights of one of torchvision's networks other than ResNets (VGG, MobileNet, DenseNet and others)"


def _resnet(spec: str, cfg: ResNetConfig, state: dict[str, torch.Tensor], line: str, mean=None, std=None,
            image_size=None, eval_size=None) -> Pretrained:
    model = {"name": "resnet", "depth": cfg.depth, "variant": cfg.variant, "stem": cfg.stem, "width": cfg.width}
    return Pretrained(spec, line, model, state, _head(state), int(state["stem.0.weight"].shape[1]),
                      int(state["head.weight"].shape[0]), None, mean, std, image_size, eval_size)


def _resnet_name(cfg) -> str:
    variant = "" if cfg.variant in ("a", "b") and cfg.stem == "imagenet" else f" variant {cfg.variant}"
    return f"ResNet-{cfg.depth}{variant}"


def _head(state: dict) -> tuple[str, ...]:
    return tuple(k for k in state if k.startswith("head."))


# ------------------------------------------------------------------------------------------
# Loading into a model
# ------------------------------------------------------------------------------------------

def keeps_head(pretrained: Pretrained, num_classes: int, classes: list[str] | None) -> bool:
    """Whether the weights' classifier serves the data: the same classes, by name and in the
    same order (a classifier for as many other classes would start every answer wrong; weights
    that do not name theirs are given a new one). ``classes`` None: the caller names none, and
    the class count decides (reloading weights into their own network)."""
    if num_classes != pretrained.num_classes:
        return False
    if classes is None:
        return True
    return pretrained.classes is not None and list(classes) == list(pretrained.classes)


def head_line(pretrained: Pretrained, num_classes: int) -> str:
    """What replacing the classifier says."""
    if num_classes != pretrained.num_classes:
        return f"head replaced for {num_classes} classes (the weights had {pretrained.num_classes})"
    known = "other classes" if pretrained.classes is not None else "classes they do not name"
    return f"head replaced for the data's {num_classes} classes (the weights' {pretrained.num_classes} are {known})"


def apply_weights(model: nn.Module, pretrained: Pretrained, in_channels: int, num_classes: int,
                  classes: list[str] | None = None, cfg=None) -> list[str]:
    """Load ``pretrained`` into ``model``, a speedrun model built from ``pretrained.model`` for
    data of ``in_channels`` channels and ``num_classes`` classes (named ``classes``). The
    classifier is kept where the classes are the weights' (:func:`keeps_head`), else the
    model's fresh one stays; the first layer is
    folded where the channels differ (3 to 1: summed over the colours, as timm does, so grey
    data gives what the grey image repeated in 3 channels gave; 1 to 3: repeated and divided
    by 3). Returns a line for each thing adapted; raises one CheckpointError line naming the
    first tensor that is missing, unexpected or misshapen. Weights of a timm network are loaded
    by timm's own loader into the network ``cfg`` (the run's [model] section; default: the
    weights' own) describes (:func:`~speedrun.models.timm_models.apply_timm_weights`)."""
    if pretrained.model.get("name") == "timm":
        from ..recipe import TimmConfig
        from .timm_models import apply_timm_weights
        keep = keeps_head(pretrained, num_classes, classes)
        cfg = cfg if cfg is not None else TimmConfig(**pretrained.model)
        return ([] if keep else [head_line(pretrained, num_classes)]) + \
            apply_timm_weights(model, cfg, pretrained, in_channels, num_classes, keep)
    state = dict(pretrained.state)
    notes: list[str] = []
    replaced: frozenset[str] = frozenset()
    if not keeps_head(pretrained, num_classes, classes):
        replaced = frozenset(pretrained.head)
        for key in replaced:
            state.pop(key, None)
        notes.append(head_line(pretrained, num_classes))
    if in_channels != pretrained.in_channels:
        notes += _fold_first_layer(model, state, pretrained, in_channels)
    misfit = first_misfit(model.state_dict(), state, replaced)
    if misfit:
        raise CheckpointError(f"model.init={pretrained.source}: the weights do not fit the model ({misfit}); build "
                              f"the model from the weights' own [model] section ({_section(pretrained.model)})")
    model.load_state_dict(state, strict=False)        # (strict=False: only a replaced head is left out)
    return notes


def _section(model: dict) -> str:
    shown = {k: v for k, v in model.items() if not isinstance(v, dict)}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def _fold_first_layer(model: nn.Module, state: dict, pretrained: Pretrained, in_channels: int) -> list[str]:
    """Fold the weights' first layer (the first 4-D tensor: a ResNet's stem conv, a speed net's
    whitening filters or first conv) to ``in_channels`` inputs, in ``state``."""
    have = pretrained.in_channels
    own = model.state_dict()
    first = next((k for k, v in own.items() if v.dim() == 4), None)
    weight = state.get(first)
    if weight is None or weight.dim() != 4 or weight.shape[1] != have:
        return []                                         # the check that follows names what does not fit
    if (have, in_channels) == (3, 1):
        folded, how = weight.sum(dim=1, keepdim=True), "summed over the weights' 3 colour channels"
    elif (have, in_channels) == (1, 3):
        folded, how = weight.repeat(1, 3, 1, 1) / 3, "the weights' grey filters repeated and divided by 3"
    else:
        raise CheckpointError(f"model.init={pretrained.source}: the weights take {have} input channels and the data "
                              f"has {in_channels}; speedrun adapts 3 channels to 1 and 1 to 3")
    state[first] = folded.to(weight.dtype)
    notes = [f"first layer {first} adapted from {have} to {in_channels} input channels ({how})"]
    layer = model.get_submodule(first.rsplit(".", 1)[0])
    if isinstance(layer, PatchWhitening) and layer.weight.shape[0] != folded.shape[0]:
        raise CheckpointError(f"model.init={pretrained.source}: a speed net's whitening layer is fitted to "
                              f"{have}-channel images, and its width follows their channels; this data has "
                              f"{in_channels}: fine-tune it on {have}-channel images (a ResNet's first layer is "
                              "folded instead)")
    return notes
