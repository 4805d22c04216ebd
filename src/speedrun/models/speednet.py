"""The speed-net family: small VGG/ResNet-like nets built for fast training on small images.

Layout: [patch whitening] -> [1x1 stem] -> blocks -> global max pool -> linear -> scale.
A block is conv -> max-pool -> BN -> act (pooling before the activation is cheaper and
as good, Page 2018), then more conv-BN-act layers, then optionally a residual branch of
two conv-BN-act layers added to its input (Page's ResNet-9). airbench94 is widths
(64, 256, 256) with two convs per block, no residual; ResNet-9 is (128, 256, 512) with one
conv per block and residual branches in blocks 1 and 3.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..recipe import SpeedNetConfig
from . import weight_grad
from .norm import BatchNorm
from .whitening import PatchWhitening


def activation(cfg: SpeedNetConfig) -> nn.Module:
    if cfg.activation == "celu":
        return nn.CELU(cfg.celu_alpha)
    return {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}[cfg.activation]()


class Conv(weight_grad.Conv2d):
    """Bias-free convolution ('same' padding) with optional identity (Dirac) initialisation."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, identity_init: bool = False):
        self.identity_init = identity_init
        super().__init__(c_in, c_out, kernel, padding=kernel // 2, bias=False)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.identity_init:
            # the first c_in filters pass their input through unchanged (airbench, 2024)
            with torch.no_grad():
                nn.init.dirac_(self.weight[: self.in_channels])


class ConvBNAct(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, cfg: SpeedNetConfig, pool: bool = False, kernel: int = 3):
        layers = [Conv(c_in, c_out, kernel, cfg.identity_init)]
        if pool:
            layers.append(nn.MaxPool2d(2))
        layers += [BatchNorm(c_out, cfg.norm), activation(cfg)]
        super().__init__(*layers)


class Residual(nn.Module):
    def __init__(self, width: int, cfg: SpeedNetConfig):
        super().__init__()
        self.branch = nn.Sequential(ConvBNAct(width, width, cfg), ConvBNAct(width, width, cfg))

    def forward(self, x):
        return x + self.branch(x)


class SpeedNet(nn.Module):
    def __init__(self, cfg: SpeedNetConfig, in_channels: int, num_classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        if cfg.whiten.kernel:
            w = cfg.whiten
            whiten = PatchWhitening(c, w.kernel, w.eps, w.negate, w.padding)
            layers.append(whiten)
            c = whiten.out_channels
            if w.activation:
                layers.append(activation(cfg))
        if cfg.stem_width:
            layers.append(ConvBNAct(c, cfg.stem_width, cfg, kernel=1))
            c = cfg.stem_width
        n = len(cfg.widths)
        convs = cfg.convs or [2] * n
        residual = cfg.residual or [False] * n
        for width, k, res in zip(cfg.widths, convs, residual):
            block = [ConvBNAct(c, width, cfg, pool=True)]
            block += [ConvBNAct(width, width, cfg) for _ in range(k - 1)]
            if res:
                block.append(Residual(width, cfg))
            layers.append(nn.Sequential(*block))
            c = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, num_classes, bias=False)
        self.out_scale = cfg.out_scale
        self.pool = select_max_pool if cfg.global_pool_grad == "select" else global_max_pool

    @property
    def whiten(self) -> PatchWhitening | None:
        """The whitening layer (the first of ``features``; registered once, so each tensor has
        one name in the state dict), or None."""
        first = self.features[0]
        return first if isinstance(first, PatchWhitening) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features(x))) * self.out_scale


def global_max_pool(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, C), by index: the backward routes each gradient to the stored
    argmax. torch.amax's backward instead compares the input with the stored maximum, and
    compiled in bf16 (inductor recomputes the activation in fp32) nothing matches, so its
    gradients are NaN from the first step."""
    return F.adaptive_max_pool2d(x, 1).flatten(1)


class _SelectMaxPool(torch.autograd.Function):
    """Global max-pool whose backward is an element-wise select: each position's gradient is
    the pooled gradient where the position is its channel's stored argmax, else 0. Nothing is
    scattered (adaptive_max_pool2d's backward adds into a zeroed tensor, with atomics on a
    GPU), and nothing compares values (torch.amax's NaN trap in compiled bf16, above): inductor
    fuses the select into the backward of the layers before it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        values, where = x.flatten(2).max(dim=2)              # (N, C) each; a view for NCHW and NHWC
        ctx.save_for_backward(where)
        ctx.shape = (n, c, h, w)
        ctx.nhwc = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        return values

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (where,) = ctx.saved_tensors
        n, c, h, w = ctx.shape
        positions = torch.arange(h * w, device=grad.device)
        if ctx.nhwc:                                          # build it in the input's layout: no copy after
            hit = positions[None, :, None] == where[:, None, :]                    # (N, HW, C)
            out = torch.where(hit, grad[:, None, :], grad.new_zeros(()))
            return out.view(n, h, w, c).permute(0, 3, 1, 2)
        hit = positions[None, None, :] == where[:, :, None]                        # (N, C, HW)
        return torch.where(hit, grad[:, :, None], grad.new_zeros(())).view(n, c, h, w)


def select_max_pool(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) -> (N, C): the global max-pool of :func:`global_max_pool` (the same values
    and, where each maximum is unique, the same gradients) with a backward that needs no
    atomics (``model.global_pool_grad = "select"``)."""
    return _SelectMaxPool.apply(x)
