"""The check a network speedrun does not build itself (timm's, a user's factory) gets before a
run: built on the meta device (shapes only, nothing allocated) and given two images of each side
the run feeds it, it must answer one logit per class. A network that cannot be built on the meta
device, or whose forward needs real tensors, is checked on the CPU instead. What goes wrong is
one :class:`~speedrun.errors.RecipeError` line naming the field that chose the network."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import RecipeError, SpeedrunError
from . import build_model

CHECKED = ("timm", "custom")
"""The kinds of network checked so (speedrun's own are known to fit any side)."""


def _named(cfg) -> str:
    return f"model.arch={cfg.arch}" if cfg.name == "timm" else f"model.factory={cfg.factory}"


def _text(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


def _size_hint(cfg) -> str:
    if cfg.name == "timm":
        return ("; a network that halves its images five times (a ResNet, a ConvNeXt) needs sides of 32 px or more: "
                "raise data.image_size or the first size of data.progressive; a network built for one input side "
                "(a ViT's position embedding) takes model.img_size, or every side with "
                "model.args = {dynamic_img_size = true}")
    return "; make the network take these sides (data.image_size, data.eval_size, data.progressive)"


def _forward(model: nn.Module, x: torch.Tensor):
    model.eval()
    with torch.no_grad():
        return model(x)


def check_network(cfg, in_channels: int, num_classes: int, sides: list[int]) -> nn.Module | None:
    """Build ``cfg``'s network and run two images of each side through it (meta device first,
    else the CPU); the network built, or None for speedrun's own (not checked)."""
    if cfg.name not in CHECKED:
        return None
    try:
        with torch.device("meta"):
            model = build_model(cfg, in_channels, num_classes)
        device = "meta"
    except SpeedrunError:
        raise                                          # (the factory's own refusal, the same on the CPU)
    except Exception:                                  # something that needs real tensors
        model, device = build_model(cfg, in_channels, num_classes), "cpu"
    for side in sorted(set(sides)):
        x = torch.zeros(2, in_channels, side, side, device=device)
        failure = None
        try:
            out = _forward(model, x)
        except Exception as err:
            failure = err
        if failure is not None and device == "meta":   # an operation without a meta kernel: on the CPU
            model, device, failure = build_model(cfg, in_channels, num_classes), "cpu", None
            try:
                out = _forward(model, torch.zeros(2, in_channels, side, side))
            except Exception as err:
                failure = err
        if failure is not None:
            raise RecipeError(f"{_named(cfg)}: the network fails on {side} px images of {in_channels} channel"
                              f"{'s' if in_channels > 1 else ''} ({_text(failure)}){_size_hint(cfg)}") from None
        if not isinstance(out, torch.Tensor):
            raise RecipeError(f"{_named(cfg)}: the network returns a {type(out).__name__}, not a tensor of logits; "
                              f"speedrun needs its forward to return one tensor of N x {num_classes}")
        if tuple(out.shape) != (2, num_classes):
            raise RecipeError(f"{_named(cfg)}: the network gives outputs of shape {'x'.join(map(str, out.shape))} for "
                              f"2 images of {in_channels}x{side}x{side}; speedrun needs 2x{num_classes} (one logit per "
                              f"class of the data's {num_classes})")
    return model


def network_line(cfg, model: nn.Module) -> str:
    """What a run says at its start of the network it trains."""
    if cfg.name == "timm":
        from .timm_models import network_line as timm_line
        return timm_line(cfg, model)
    from .custom import network_line as custom_line
    return custom_line(cfg, model)
