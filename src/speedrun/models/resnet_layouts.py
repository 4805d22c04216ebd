"""ResNet weights in torchvision's and timm's layouts, renamed to speedrun's own ResNet.

The three libraries build the same network under different names: torchvision and timm call
the stem ``conv1``/``bn1``, the stages ``layer1``-``layer4``, a block's projection
``downsample`` and the classifier ``fc``; speedrun calls them ``stem``, ``stages``,
``shortcut`` and ``head``. timm's ``resnet*d`` (and ``*c``) models have the deep stem of
tweak C (three 3x3 convs, ``conv1.0/.3/.6``, the last BN still ``bn1``), and ``*d`` the
average-pooled projection of tweak D (``downsample.1/.2`` after the pool, which is an
identity at stride 1). The depth, variant and width are read from the tensors themselves,
and the renamed weights are checked against the speedrun ResNet they describe, tensor by
tensor, before anything uses them.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from ..errors import CheckpointError
from ..recipe import ResNetConfig
from .resnet import STAGES, ResNet

LOADABLE = ("speedrun loads its own runs and ResNet-18/34/50/101 in torchvision's or timm's layout "
            "(resnet18-101, resnet18d-101d)")
"""What can be fine-tuned from, for the messages that refuse something else."""

DEPTHS = {(blocks, bottleneck): depth for depth, blocks in STAGES.items()
          for bottleneck in (False, True) if (depth >= 50) == bottleneck}
"""(blocks per stage, bottleneck blocks?) -> depth."""

_LAYER = re.compile(r"layer([1-4])\.(\d+)\.(.+)")
_DEEP_STEM_CONV = re.compile(r"conv1\.([0-9])\.(.+)")
_DEEP_STEM_LAYERS = {0, 1, 3, 4, 6}              # conv, BN, (ReLU), conv, BN, (ReLU), conv: then bn1


def is_resnet_layout(state: dict) -> bool:
    """Whether ``state`` is named as torchvision's or timm's ResNets name their tensors."""
    return "layer1.0.conv1.weight" in state and ("conv1.weight" in state or "conv1.0.weight" in state)


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def first_misfit(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor],
                 absent_ok: frozenset[str] = frozenset(), shown: Callable[[str], str] = str) -> str | None:
    """The first tensor of ``given`` that does not fit ``expected`` (a model's state dict): one
    the model has and ``given`` lacks (other than those in ``absent_ok``), one of another
    shape, or one the model has no place for; None when all fit. ``shown`` gives the name a
    tensor is called by in the message (default: its key)."""
    for key, want in expected.items():
        if key in absent_ok:
            continue
        if key not in given:
            return f"missing tensor {shown(key)}, {_shape(want)} in the model"
        if given[key].shape != want.shape:
            return f"tensor {shown(key)} is {_shape(given[key])} in the weights but {_shape(want)} in the model"
    for key, have in given.items():
        if key not in expected:
            return f"unexpected tensor {shown(key)}, {_shape(have)} in the weights: the model has no such tensor"
    return None


def _blocks_per_stage(state: dict) -> tuple[int, ...]:
    seen: dict[int, set[int]] = {}
    for key in state:
        m = _LAYER.match(key)
        if m:
            seen.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return tuple(len(seen.get(stage, ())) for stage in (1, 2, 3, 4))


def describe(state: dict) -> ResNetConfig:
    """The speedrun [model] section of a ResNet named as torchvision or timm name it: depth from
    the blocks per stage, variant from the stem and projections (deep stem and average-pooled
    projections: d; deep stem alone: c; bottlenecks, which both libraries stride at the 3x3
    conv: b; basic blocks: a), width from the stem's output channels."""
    deep_stem = "conv1.0.weight" in state
    avg_down = any(k.endswith("downsample.2.weight") for k in state)
    bottleneck = "layer1.0.conv3.weight" in state
    blocks = _blocks_per_stage(state)
    depth = DEPTHS.get((blocks, bottleneck))
    if depth is None:
        kind = "bottleneck" if bottleneck else "basic"
        raise CheckpointError(f"a ResNet with {'/'.join(map(str, blocks))} {kind} blocks per stage is not one "
                              f"speedrun builds; {LOADABLE}")
    if avg_down and not deep_stem:
        raise CheckpointError(f"a ResNet with average-pooled projections but a 7x7 stem is not one speedrun builds "
                              f"(its variant d has both); {LOADABLE}")
    variant = "d" if avg_down else "c" if deep_stem else "b" if bottleneck else "a"
    stem_out = state.get("bn1.weight")
    if stem_out is None or stem_out.dim() != 1:
        raise CheckpointError(f"the ResNet has no stem batch norm bn1; {LOADABLE}")
    return ResNetConfig(name="resnet", depth=depth, variant=variant, stem="imagenet", width=int(stem_out.numel()))


def speedrun_key(key: str, deep_stem: bool, avg_down: bool) -> str | None:
    """The name speedrun's ResNet gives the tensor torchvision or timm call ``key``, or None
    for one it has no place for."""
    if key.startswith("fc."):
        return "head." + key[3:]
    if deep_stem:
        m = _DEEP_STEM_CONV.fullmatch(key)
        if m:
            return f"stem.{m.group(1)}.{m.group(2)}" if int(m.group(1)) in _DEEP_STEM_LAYERS else None
        if key.startswith("bn1."):
            return "stem.7." + key[4:]
    elif key.startswith("conv1.") or key.startswith("bn1."):
        return ("stem.0." if key.startswith("conv1.") else "stem.1.") + key.split(".", 1)[1]
    m = _LAYER.fullmatch(key)
    if m is None:
        return None
    stage, block, rest = int(m.group(1)), int(m.group(2)), m.group(3)
    if rest.startswith("downsample."):
        index, tail = rest[len("downsample."):].split(".", 1)
        # tweak D's projection: a pool (no tensors) then conv and BN; at stride 1 (the first
        # stage) speedrun has no pool, so its conv and BN come first
        shift = 1 if avg_down and stage == 1 else 0
        rest = f"shortcut.{int(index) - shift}.{tail}"
    return f"stages.{stage - 1}.{block}.{rest}"


def foreign_key(key: str, deep_stem: bool, avg_down: bool) -> str:
    """The name torchvision or timm give the tensor speedrun's ResNet calls ``key``: the inverse
    of :func:`speedrun_key`."""
    if key.startswith("head."):
        return "fc." + key[len("head."):]
    m = re.fullmatch(r"stem\.(\d+)\.(.+)", key)
    if m:
        index, rest = int(m.group(1)), m.group(2)
        if deep_stem:
            return f"bn1.{rest}" if index == 7 else f"conv1.{index}.{rest}"
        return f"{'conv1' if index == 0 else 'bn1'}.{rest}"
    m = re.fullmatch(r"stages\.(\d+)\.(\d+)\.(.+)", key)
    if m is None:
        return key
    stage, block, rest = int(m.group(1)) + 1, m.group(2), m.group(3)
    s = re.fullmatch(r"shortcut\.(\d+)\.(.+)", rest)
    if s:
        shift = 1 if avg_down and stage == 1 else 0
        rest = f"downsample.{int(s.group(1)) + shift}.{s.group(2)}"
    return f"layer{stage}.{block}.{rest}"


def to_speedrun(state: dict[str, torch.Tensor]) -> tuple[ResNetConfig, dict[str, torch.Tensor]]:
    """(the speedrun [model] section, the weights renamed for it) of a torchvision or timm
    ResNet state dict, checked against that model tensor by tensor. Batch norms saved before
    torch counted their batches (torchvision's 2017 files) get a count of 0, as torch gives
    them. Raises CheckpointError naming the first tensor that has no place."""
    cfg = describe(state)
    deep_stem, avg_down = cfg.variant in ("c", "d"), cfg.variant == "d"
    renamed: dict[str, torch.Tensor] = {}
    original: dict[str, str] = {}
    for key, tensor in state.items():
        new = speedrun_key(key, deep_stem, avg_down)
        if new is None:
            raise CheckpointError(f"its tensor {key} ({_shape(tensor)}) has no place in a ResNet-{cfg.depth}; "
                                  f"{LOADABLE}")
        renamed[new] = tensor
        original[new] = key
    for needed, what in (("stem.0.weight", "first convolution conv1"), ("head.weight", "classifier fc")):
        if needed not in renamed:
            raise CheckpointError(f"the ResNet has no {what}; {LOADABLE}")
    with torch.device("meta"):                            # shapes only: nothing allocated, nothing initialised
        expected = ResNet(cfg, in_channels_of(renamed), classes_of(renamed)).state_dict()
    for key, want in expected.items():
        if key.endswith("num_batches_tracked") and key not in renamed:
            renamed[key] = torch.zeros((), dtype=torch.long)
    def shown(key: str) -> str:                          # the file's name first, then speedrun's
        return f"{original.get(key) or foreign_key(key, deep_stem, avg_down)} (speedrun's {key})"
    misfit = first_misfit(expected, renamed, shown=shown)
    if misfit:
        raise CheckpointError(f"the weights are not a ResNet-{cfg.depth} speedrun builds ({misfit}); {LOADABLE}")
    return cfg, {key: renamed[key] for key in expected}


def in_channels_of(state: dict[str, torch.Tensor]) -> int:
    """The input channels of a speedrun-named ResNet's weights (its first convolution's)."""
    return int(state["stem.0.weight"].shape[1])


def classes_of(state: dict[str, torch.Tensor]) -> int:
    """The classes of a speedrun-named model's weights (its head's outputs)."""
    return int(state["head.weight"].shape[0])
