"""What the tests of networks speedrun does not build itself (timm's, a factory of yours) share:
a small recipe for them on the 32 px CIFAR-10 images (``npz32``: 512 training, 512 test images),
and a factory file."""
from __future__ import annotations

from pathlib import Path

import tomli_w

RECIPE = {
    "name": "nets",
    "description": "a network speedrun does not build, on small images",
    "target": 0.5,
    "data": {"dataset": "npz", "batch_size": 32},
    "augment": {"flip": "random", "crop": "translate", "translate": 2},
    "optim": {"lr": 4.0, "ref_batch": 256, "momentum": 0.9, "nesterov": True, "weight_decay": 2e-3,
              "no_decay_bias_norm": True},
    "schedule": {"kind": "piecewise", "knots": [0.0, 0.2, 1.0], "values": [0.2, 1.0, 0.0]},
    "train": {"epochs": 2, "label_smoothing": 0.1},
    "eval": {"every": 0, "batch_size": 256},
    "runtime": {"precision": "fp32", "compile": "off", "threads": 1},
}
"""SGD with a warm-up and a decay, 2 epochs of batch 32 (32 steps on npz32), eager fp32 on one thread
(a resumed run then sums in the order the uninterrupted one did, whatever else the machine runs)."""

FACTORY = '''\
import torch.nn as nn


def make(in_channels, num_classes, width=16):
    """Three conv-BN-ReLU layers, pooled, then a linear classifier."""
    layers, c = [], in_channels
    for out in (width, 2 * width, 4 * width):
        layers += [nn.Conv2d(c, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
        c = out
    return nn.Sequential(*layers, nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(c, num_classes))


def wrong_shape(in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes + 1))


def not_a_module(in_channels, num_classes):
    return 42


def raises(in_channels, num_classes, width=16):
    raise ValueError(f"width {width} must be even")
'''


def recipe_file(folder: Path, model: dict, **sections) -> Path:
    """The small recipe with this [model] (and other sections replaced), written into ``folder``."""
    raw = {**RECIPE, "model": model, **sections}
    path = folder / "nets.toml"
    path.write_text(tomli_w.dumps(raw), encoding="utf-8")
    return path


def factory_file(folder: Path, name: str = "tiny_net.py") -> Path:
    path = folder / name
    path.write_text(FACTORY, encoding="utf-8")
    return path
