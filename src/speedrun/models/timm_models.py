"""timm's networks (``model.name = "timm"``): any architecture ``timm.create_model`` knows, built
for the run's channels and classes, and what the rest of speedrun asks of one: its blocks from
input to classifier (timm's ``group_matcher``), its classifier (``get_classifier``), and weights
of its own architecture loaded through timm's loader (``load_pretrained``: the checkpoint
filter of the architecture, which resamples a ViT's position embedding to another image size,
the first convolution adapted to the data's channels, the classifier left out for other classes).

timm is an optional extra (``pip install 'speedrun[timm]'``); nothing here imports it until a
timm network is asked for, so the engine can ask any model these questions.
"""
from __future__ import annotations

import difflib
import json
import re

import torch
import torch.nn as nn

from ..errors import CheckpointError, RecipeError

INSTALL = "pip install 'speedrun[timm]'"


def import_timm(field: str = "model.name = 'timm'"):
    """The timm module, or one line saying what to install."""
    try:
        import timm
    except ImportError as err:
        missing = getattr(err, "name", None) or "timm"
        why = "timm is not installed" if missing == "timm" else f"timm cannot be imported (it needs {missing})"
        raise RecipeError(f"{field} needs timm, and {why}: {INSTALL}") from None
    return timm


def version() -> str:
    return import_timm().__version__


def check_arch(timm, arch: str) -> None:
    """Refuse a name timm does not know, naming the close ones."""
    if timm.is_model(arch):
        return
    base = arch.split(".", 1)[0]
    names = timm.list_models()
    close = difflib.get_close_matches(base, names, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    family = re.match(r"[a-z]+", base)
    listing = f" (timm.list_models('{family.group()}*') lists a family)" if family and not close else ""
    raise RecipeError(f"model.arch = {arch!r} is not one of timm's {len(names):,} models{hint}{listing}")


def create_kwargs(cfg) -> dict:
    """The keyword arguments the recipe gives ``timm.create_model`` (the fields left at 0 are
    not passed: not every architecture takes them)."""
    out = {k: getattr(cfg, k) for k in ("drop_path_rate", "drop_rate", "img_size") if getattr(cfg, k)}
    return {**out, **cfg.args}


def _argument_error(cfg, err: Exception) -> RecipeError:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    m = re.search(r"unexpected keyword argument '(\w+)'", text)
    if m:
        key = m.group(1)
        field = f"model.{key}" if key in ("drop_path_rate", "drop_rate", "img_size") else f"model.args.{key}"
        return RecipeError(f"{field}: timm's {cfg.arch} takes no {key} ({text[:160]}); remove it")
    return RecipeError(f"model.arch = {cfg.arch!r}: timm cannot build it with {json.dumps(create_kwargs(cfg))} "
                       f"({type(err).__name__}: {text[:200]})")


def build_timm(cfg, in_channels: int, num_classes: int) -> nn.Module:
    """timm's ``cfg.arch`` with random weights (timm's own initialisation), for ``in_channels``
    and ``num_classes``, built on the current default device (the meta device for shapes)."""
    timm = import_timm()
    check_arch(timm, cfg.arch)
    try:
        return timm.create_model(cfg.arch, pretrained=False, num_classes=num_classes, in_chans=in_channels,
                                 **create_kwargs(cfg))
    except (TypeError, ValueError, AssertionError, RuntimeError, KeyError) as err:
        raise _argument_error(cfg, err) from None


def is_timm(model: nn.Module) -> bool:
    """Whether ``model`` is one of timm's networks (it has timm's model interface)."""
    return callable(getattr(model, "group_matcher", None)) and callable(getattr(model, "get_classifier", None)) \
        and hasattr(model, "pretrained_cfg")


# ------------------------------------------------------------------------------------------
# What the optimizer asks: blocks and the classifier
# ------------------------------------------------------------------------------------------

def timm_blocks(model: nn.Module) -> dict[int, int] | None:
    """Each parameter's block by ``id``: 0, 1, ... from the input to the classifier, as timm's
    ``group_matcher`` (fine, not coarse) groups them, the layers it leaves unmatched (the
    classifier, a final norm) last; None for a model that is not timm's."""
    if not is_timm(model):
        return None
    from timm.models import group_parameters
    by_name = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    params = dict(model.named_parameters())
    return {id(params[name]): int(block) for name, block in by_name.items() if name in params}


def classifier_modules(model: nn.Module) -> list[nn.Module] | None:
    """The classifier layers of a timm model (``get_classifier``; distilled ViTs have two), or
    None for a model that is not timm's."""
    if not is_timm(model):
        return None
    found = model.get_classifier()
    return [m for m in (found if isinstance(found, (tuple, list)) else [found]) if isinstance(m, nn.Module)]


def timm_head(model: nn.Module) -> set[int] | None:
    """The classifier's parameters (by ``id``) of a timm model, None for another model."""
    layers = classifier_modules(model)
    return None if layers is None else {id(p) for m in layers for p in m.parameters()}


def block_names(model: nn.Module) -> str:
    """The blocks of a timm model said in a few words: how many, the first and the last."""
    groups = timm_blocks(model) or {}
    names = {id(p): n for n, p in model.named_parameters()}
    firsts: dict[int, str] = {}
    for pid, b in groups.items():
        firsts.setdefault(b, names[pid].rsplit(".", 1)[0])
    n = len(firsts)
    return f"{n} blocks by timm's group_matcher ({firsts.get(0, '?')} ... {firsts.get(n - 1, '?')})" if n else \
        "one block"


def network_line(cfg, model: nn.Module) -> str:
    """What the run says of its timm network."""
    args = create_kwargs(cfg)
    given = f" with {', '.join(f'{k}={v}' for k, v in args.items())}" if args else ""
    params = sum(p.numel() for p in model.parameters())
    heads = [n for n, m in model.named_modules() if any(m is c for c in (classifier_modules(model) or []))]
    return (f"network: timm {version()} {cfg.arch}{given}, {params:,} parameters; classifier {', '.join(heads)}; "
            f"{block_names(model)}")


# ------------------------------------------------------------------------------------------
# Weights of a timm architecture (model.init = timm:NAME[=FILE], or a run of a timm network)
# ------------------------------------------------------------------------------------------

_adapted: dict[tuple, dict[str, torch.Tensor]] = {}


def adapted_state(cfg, pretrained, in_channels: int, num_classes: int) -> dict[str, torch.Tensor]:
    """``pretrained``'s tensors made to fit the run's network (``cfg``: its [model] section)
    by timm's own loader: the architecture's checkpoint filter (a ViT's position embedding
    resampled to ``img_size``, a patch embedding to another patch size), the first
    convolution adapted to ``in_channels``, the classifier left out where the classes differ.
    Made once per process for a given network, and without drawing from torch's random
    numbers (the run's own draws are the same with weights and without)."""
    key = (id(pretrained), cfg.model_dump_json(), in_channels, num_classes)
    if key in _adapted:
        return _adapted[key]
    timm = import_timm()
    overlay = {"state_dict": dict(pretrained.state), "num_classes": pretrained.num_classes}
    try:
        with torch.random.fork_rng(devices=[]):
            net = timm.create_model(cfg.arch, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=num_classes,
                                    in_chans=in_channels, **create_kwargs(cfg))
    except Exception as err:                         # a size the weights cannot be resampled to, mostly
        text = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise CheckpointError(f"model.init={pretrained.source}: timm cannot load these weights into {cfg.arch} "
                              f"with {json.dumps(create_kwargs(cfg))} ({type(err).__name__}: {text})") from None
    _adapted.clear()                                 # (one network per process at a time)
    _adapted[key] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return _adapted[key]


def apply_timm_weights(model: nn.Module, cfg, pretrained, in_channels: int, num_classes: int,
                       keep_head: bool) -> list[str]:
    """Load ``pretrained`` (weights of timm's ``cfg.arch``) into ``model``, the run's network,
    freshly built for its data: every tensor timm's loader adapts, the model's own new
    classifier kept unless ``keep_head``. Returns a line for each thing adapted."""
    from .resnet_layouts import first_misfit
    state = dict(adapted_state(cfg, pretrained, in_channels, num_classes))
    notes, replaced = [], frozenset()
    if not keep_head:
        from . import classifier_names
        replaced = frozenset(classifier_names(model))
        for key in replaced:
            state.pop(key, None)
    misfit = first_misfit(model.state_dict(), state, replaced)
    if misfit:
        raise CheckpointError(f"model.init={pretrained.source}: the weights do not fit the network ({misfit})")
    first = pretrained.first_conv
    if in_channels != pretrained.in_channels and first:
        notes.append(f"first layer {first} adapted from {pretrained.in_channels} to {in_channels} input channels by "
                     "timm (summed over the colours for grey images)")
    resampled = [k for k, v in state.items() if k in pretrained.state and k != f"{first}.weight"
                 and tuple(v.shape) != tuple(pretrained.state[k].shape)]
    if resampled:
        notes.append(f"resampled by timm for this network's size: {', '.join(resampled[:3])}"
                     + (f" and {len(resampled) - 3} more" if len(resampled) > 3 else ""))
    model.load_state_dict(state, strict=False)       # (only a replaced classifier is left out)
    return notes
