"""The ResNet family (He et al., 2016): depth 18/34 with basic blocks, 50/101 with bottlenecks.

Built from the recipe's [model] section, with the tweaks the speed-run recipes use: a 3x3 stem
for small images, the "Bag of Tricks" variants B-D (He et al., 2019), pre-activation blocks
(He et al., 2016, "Identity mappings in deep residual networks"), zero-gamma initialisation
(Goyal et al., 2017), anti-aliased down-sampling (Zhang, 2019: a binomial low-pass before each
subsampling) and channel counts rounded up to multiples of 8 for tensor cores.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..recipe import ResNetConfig
from . import weight_grad
from .norm import BatchNorm

STAGES = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}
# The variants are cumulative: each letter names the tweaks of He et al. (2019) it applies.
TWEAKS = {"a": set(), "b": {"B"}, "c": {"B", "C"}, "d": {"B", "C", "D"}}


def round_up_to_multiple(x: int, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple`` (tensor cores want channels in 8s)."""
    return -(-x // multiple) * multiple


def conv(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    """A convolution padded to keep the size at stride 1; no bias, since a BN follows it."""
    return weight_grad.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False)


class Blur(nn.Module):
    """A fixed 3x3 binomial low-pass ([1, 2, 1] / 4 in each direction), per channel, with
    reflected borders, then subsampled by ``stride``: the anti-aliasing filter of Zhang (2019),
    "Making convolutional networks shift-invariant again". It has no parameters (its kernel is
    a buffer left out of the state dict), so a model's weights are the same with or without it."""

    def __init__(self, stride: int = 1):
        super().__init__()
        taps = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer("kernel", (torch.outer(taps, taps) / 16)[None, None], persistent=False)
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        weight = self.kernel.to(x.dtype).expand(c, 1, 3, 3)
        return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), weight, stride=self.stride, groups=c)


def strided_conv(c_in: int, c_out: int, kernel: int, stride: int, cfg: ResNetConfig) -> nn.Module:
    """:func:`conv`; with ``model.antialias = "all"`` and stride > 1, the input blurred first (at
    its own resolution) so that the subsampling does not alias."""
    if stride > 1 and cfg.antialias == "all":
        return nn.Sequential(Blur(), conv(c_in, c_out, kernel, stride))
    return conv(c_in, c_out, kernel, stride)


def conv_bn_relu(c_in: int, c_out: int, kernel: int, stride: int, cfg: ResNetConfig) -> list[nn.Module]:
    return [strided_conv(c_in, c_out, kernel, stride, cfg), BatchNorm(c_out, cfg.norm), nn.ReLU()]


def stem_pool(cfg: ResNetConfig) -> nn.Module:
    """The stem's 3x3/2 max-pool, or with anti-aliasing a 3x3/1 max-pool then a blur with
    stride 2 (MaxBlurPool): the same output size, the maximum taken densely and low-passed
    before it is subsampled."""
    if cfg.antialias == "none":
        return nn.MaxPool2d(3, 2, padding=1)
    return nn.Sequential(nn.MaxPool2d(3, 1, padding=1), Blur(stride=2))


def make_stem(cfg: ResNetConfig, in_channels: int, width: int) -> nn.Sequential:
    """The layers before the first stage: a 3x3 conv for small images, or a stem that cuts
    the resolution by 4 (7x7/2 conv, or tweak C's three 3x3 convs, then a 3x3/2 max-pool)."""
    if cfg.stem == "cifar":
        if cfg.preact:                          # the first block's BN-ReLU follows directly
            return nn.Sequential(conv(in_channels, width, 3))
        return nn.Sequential(*conv_bn_relu(in_channels, width, 3, 1, cfg))
    if "C" in TWEAKS[cfg.variant]:              # same receptive field as 7x7, fewer FLOPs
        half = round_up_to_multiple(width // 2, 8)
        layers = [*conv_bn_relu(in_channels, half, 3, 2, cfg),
                  *conv_bn_relu(half, half, 3, 1, cfg),
                  *conv_bn_relu(half, width, 3, 1, cfg)]
    else:
        layers = conv_bn_relu(in_channels, width, 7, 2, cfg)
    return nn.Sequential(*layers, stem_pool(cfg))


def make_shortcut(c_in: int, c_out: int, stride: int, cfg: ResNetConfig) -> nn.Module:
    """The identity, or where the block changes shape a 1x1 conv + BN: strided, or with tweak
    D a stride-1 conv after a 2x2 average pool, so no input pixel is skipped."""
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    if "D" in TWEAKS[cfg.variant] and stride > 1:
        pool = nn.AvgPool2d(stride, stride, ceil_mode=True, count_include_pad=False)
        return nn.Sequential(pool, conv(c_in, c_out, 1), BatchNorm(c_out, cfg.norm))
    return nn.Sequential(strided_conv(c_in, c_out, 1, stride, cfg), BatchNorm(c_out, cfg.norm))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers added to the shortcut, then ReLU."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int, cfg: ResNetConfig):
        super().__init__()
        self.conv1 = strided_conv(c_in, width, 3, stride, cfg)
        self.bn1 = BatchNorm(width, cfg.norm)
        self.conv2 = conv(width, width, 3)
        self.bn2 = BatchNorm(width, cfg.norm)
        self.shortcut = make_shortcut(c_in, width, stride, cfg)

    @property
    def last_norm(self) -> BatchNorm:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 conv down to ``width``, 3x3 conv, 1x1 conv up to 4x ``width``, each with BN, added to
    the shortcut, then ReLU. Tweak B strides the 3x3 conv: a strided 1x1 conv would read only
    one input pixel in four."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int, cfg: ResNetConfig):
        super().__init__()
        c_out = width * self.expansion
        stride_3x3 = "B" in TWEAKS[cfg.variant]
        self.conv1 = conv(c_in, width, 1, 1 if stride_3x3 else stride)
        self.bn1 = BatchNorm(width, cfg.norm)
        self.conv2 = strided_conv(width, width, 3, stride if stride_3x3 else 1, cfg)
        self.bn2 = BatchNorm(width, cfg.norm)
        self.conv3 = conv(width, c_out, 1)
        self.bn3 = BatchNorm(c_out, cfg.norm)
        self.shortcut = make_shortcut(c_in, c_out, stride, cfg)

    @property
    def last_norm(self) -> BatchNorm:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class PreActBlock(nn.Module):
    """Two BN-ReLU-3x3 conv layers added to the input, nothing after the addition; a
    shape-changing shortcut is a 1x1 conv on the pre-activated input, without BN."""

    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int, cfg: ResNetConfig):
        super().__init__()
        self.bn1 = BatchNorm(c_in, cfg.norm)
        self.conv1 = strided_conv(c_in, width, 3, stride, cfg)
        self.bn2 = BatchNorm(width, cfg.norm)
        self.conv2 = conv(width, width, 3)
        self.projection = conv(c_in, width, 1, stride) if stride != 1 or c_in != width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        skip = x if self.projection is None else self.projection(out)
        out = self.conv2(F.relu(self.bn2(self.conv1(out))))
        return out + skip


class ResNet(nn.Module):
    """stem -> four stages (stages 2-4 start by halving the resolution and doubling the width)
    -> BN-ReLU (pre-activation only) -> global average pool -> linear."""

    def __init__(self, cfg: ResNetConfig, in_channels: int, num_classes: int):
        super().__init__()
        if cfg.zero_gamma and cfg.preact:
            raise ValueError("model.zero_gamma needs preact = false")
        if cfg.zero_gamma and cfg.norm.scale == "frozen":
            raise ValueError("model.zero_gamma needs model.norm.scale = 'learned' "
                             "(a scale frozen at 0 would switch every residual branch off)")
        block = PreActBlock if cfg.preact else BasicBlock if cfg.depth < 50 else Bottleneck
        widths = [round_up_to_multiple(cfg.width * 2 ** i, 8) for i in range(4)]
        self.stem = make_stem(cfg, in_channels, widths[0])
        stages, c = [], widths[0]
        for i, (width, n_blocks) in enumerate(zip(widths, STAGES[cfg.depth])):
            blocks = []
            for j in range(n_blocks):
                blocks.append(block(c, width, 2 if i > 0 and j == 0 else 1, cfg))
                c = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.final = nn.Sequential(BatchNorm(c, cfg.norm), nn.ReLU()) if cfg.preact else nn.Identity()
        self.head = nn.Linear(c, num_classes)
        init_weights(self, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.final(self.stages(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


def init_weights(model: ResNet, cfg: ResNetConfig) -> None:
    """Convs Kaiming-normal (fan_out, ReLU gain) or Xavier-uniform; BNs keep scale 1, shift 0,
    except that zero_gamma sets the scale of each branch's last BN to 0 so that every block
    starts as the identity followed by ReLU. The linear head keeps torch's default."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            if cfg.init == "xavier":
                nn.init.xavier_uniform_(m.weight)
            else:                               # (weights to start from are loaded over it)
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    if cfg.zero_gamma:
        for m in model.modules():
            if isinstance(m, (BasicBlock, Bottleneck)):
                nn.init.zeros_(m.last_norm.weight)
