"""ResNets for small images (3x3 stem, no initial down-sampling), as in the DAWNBench
CIFAR-10 baseline that Page's series starts from: an 18-layer pre-activation ResNet
(He et al., 2016, "Identity mappings in deep residual networks").
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..recipe import ResNetConfig
from .norm import BatchNorm

STAGES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions; pre-activation (BN-ReLU-conv) or post-activation (conv-BN-ReLU)."""

    def __init__(self, c_in: int, c_out: int, stride: int, cfg: ResNetConfig):
        super().__init__()
        self.preact = cfg.preact
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn1 = BatchNorm(c_in if cfg.preact else c_out, cfg.norm)
        self.bn2 = BatchNorm(c_out, cfg.norm)
        self.shortcut = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=False)
            self.shortcut_bn = None if cfg.preact else BatchNorm(c_out, cfg.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.preact:
            out = F.relu(self.bn1(x))
            skip = self.shortcut(out) if self.shortcut is not None else x
            out = self.conv1(out)
            out = self.conv2(F.relu(self.bn2(out)))
            return out + skip
        skip = x if self.shortcut is None else self.shortcut_bn(self.shortcut(x))
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + skip)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig, in_channels: int, num_classes: int):
        super().__init__()
        w = cfg.width
        self.preact = cfg.preact
        self.stem = nn.Conv2d(in_channels, w, 3, 1, 1, bias=False)
        self.stem_bn = None if cfg.preact else BatchNorm(w, cfg.norm)
        blocks, c = [], w
        for i, n in enumerate(STAGES[cfg.depth]):
            width = w * 2 ** i
            for j in range(n):
                blocks.append(BasicBlock(c, width, 2 if (j == 0 and i > 0) else 1, cfg))
                c = width
        self.blocks = nn.Sequential(*blocks)
        self.final_bn = BatchNorm(c, cfg.norm) if cfg.preact else None
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.stem_bn is not None:
            x = F.relu(self.stem_bn(x))
        x = self.blocks(x)
        if self.final_bn is not None:
            x = F.relu(self.final_bn(x))
        return self.head(x.mean(dim=(2, 3)))
