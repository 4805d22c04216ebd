"""Models built from the recipe's [model] section, keyed by ``model.name``: speedrun's speed net
and ResNets, timm's networks (timm_models.py) and your own factory (custom.py). Whatever the
kind, the rest of speedrun asks a model only what any ``nn.Module`` answers (see
:func:`classifier_names` and ``speedrun.optim.params``)."""
from __future__ import annotations

import torch.nn as nn

from .norm import BatchNorm
from .resnet import ResNet
from .speednet import SpeedNet
from .whitening import PatchWhitening


def _timm(cfg, in_channels: int, num_classes: int) -> nn.Module:
    from .timm_models import build_timm
    return build_timm(cfg, in_channels, num_classes)


def _custom(cfg, in_channels: int, num_classes: int) -> nn.Module:
    from .custom import build_custom
    return build_custom(cfg, in_channels, num_classes)


BUILDERS = {"speednet": SpeedNet, "resnet": ResNet, "timm": _timm, "custom": _custom}


def build_model(cfg, in_channels: int, num_classes: int) -> nn.Module:
    return BUILDERS[cfg.name](cfg, in_channels, num_classes)


def classifier_layers(model: nn.Module) -> list[nn.Module]:
    """The model's classifier: timm's own (``get_classifier``) for a timm network, else its
    last linear layer."""
    from .timm_models import classifier_modules
    own = classifier_modules(model)
    if own is not None:
        return own
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1:]


def classifier_names(model: nn.Module) -> tuple[str, ...]:
    """The state-dict names of the classifier's tensors."""
    layers = classifier_layers(model)
    return tuple(f"{n}.{k}" if n else k for n, m in model.named_modules() if any(m is c for c in layers)
                 for k in m.state_dict())


__all__ = ["BatchNorm", "PatchWhitening", "ResNet", "SpeedNet", "build_model", "classifier_layers",
           "classifier_names"]
