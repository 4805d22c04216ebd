"""Models built from the recipe's [model] section, keyed by ``model.name``."""
from __future__ import annotations

import torch.nn as nn

from .norm import BatchNorm
from .resnet import ResNet
from .speednet import SpeedNet
from .whitening import PatchWhitening

BUILDERS = {"speednet": SpeedNet, "resnet": ResNet}


def build_model(cfg, in_channels: int, num_classes: int) -> nn.Module:
    return BUILDERS[cfg.name](cfg, in_channels, num_classes)


__all__ = ["BatchNorm", "PatchWhitening", "ResNet", "SpeedNet", "build_model"]
