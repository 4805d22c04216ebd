"""Batch norm with the options of the speed-run recipes."""
from __future__ import annotations

import warnings

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.nn.functional import all_reduce

from ..recipe import NormConfig

# torch 2.13 marks this differentiable all-reduce deprecated in favour of the functional
# collectives, but those abort a gloo process at exit now and then ("terminate called without
# an active exception", reproduced in 2 of 8 two-process runs); this one is reliable.
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_reduce is deprecated",
                        category=FutureWarning)


class _TracedAllReduceSum(torch.autograd.Function):
    """A differentiable sum over the group (backward: the same sum of the gradients) made of
    functional collectives, which dynamo traces into the compiled graph; torch's
    ``torch.distributed.nn.functional.all_reduce`` makes dynamo give up on the whole model
    (a graph break per layer, and the compiled model silently runs eager)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


def sum_over(stats: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-reduce (sum) of ``stats`` over ``group``: traced functional
    collectives inside a compiled model, torch's autograd all-reduce in eager code (the
    functional ones aborted gloo processes at exit now and then, see above)."""
    if torch.compiler.is_compiling():
        return _TracedAllReduceSum.apply(stats, group)
    return all_reduce(stats, group=group)


def norm_in_fp32(setting: bool | str, device_type: str) -> bool:
    """Whether batch norm converts its input to fp32 under bf16/fp16 (``model.norm.fp32``).
    "auto": on CUDA, yes (the recipes' tested GPU path); on a CPU, no: the native kernel reads
    bf16 and still sums its statistics in fp32, and the conversions there and back cost 8-9%
    of a cifar10-94-fast step (1.726 s against 1.895 at 32 px, Intel Xeon 6/167)."""
    return device_type == "cuda" if setting == "auto" else bool(setting)


class BatchNorm(nn.BatchNorm2d):
    """BatchNorm2d with ghost batches, a frozen scale, fp32 compute and statistics shared
    across processes.

    - ghost_batch: in training, normalise each sub-batch of this many images with its own
      statistics (Hoffer et al., 2017), a regulariser that Page's ResNet-9 uses at 32.
    - scale='frozen': the multiplicative weight stays at 1 and is not trained (Page, 2018).
    - fp32: normalise in fp32 even when the network runs in bf16/fp16 ("auto": on CUDA only,
      :func:`norm_in_fp32`).
    - ``group`` (set by the engine from ``norm.sync_ranks``): in training, the batch statistics
      are those of the union of the group's batches (synchronised batch norm; the large-batch
      ImageNet runs span BN over a fixed number of images this way). One differentiable
      all-reduce of (sum, sum of squares, count) per layer; works with gloo and NCCL. In one
      process the same formula runs without the all-reduce, so runs with 1 and N processes
      compute the same thing.
    """

    def __init__(self, channels: int, cfg: NormConfig):
        super().__init__(channels, eps=cfg.eps, momentum=cfg.momentum)
        self.ghost_batch = cfg.ghost_batch
        self.fp32 = cfg.fp32
        self.synchronised = cfg.sync_ranks != 1     # statistics over the group's batches (one rank: its own)
        self.group = None                           # the process group, set by the engine
        if cfg.scale == "frozen":
            self.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if norm_in_fp32(self.fp32, x.device.type):
            x = x.float()
        if self.training and self.synchronised:
            y = self._synchronised(x)
        elif self.training and self.ghost_batch and x.shape[0] > self.ghost_batch:
            y = self._ghost(x)
        else:
            y = super().forward(x)
        return y.to(dtype)

    def _synchronised(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        stats = torch.cat([x.sum(dim=(0, 2, 3)), x.square().sum(dim=(0, 2, 3)),
                           x.new_full((1,), x.numel() // c)])
        if self.group is not None:
            stats = sum_over(stats, self.group)                      # differentiable (backward: all-reduce)
        count = stats[-1]
        mean = stats[:c] / count
        var = (stats[c:2 * c] / count - mean.square()).clamp_min(0)
        y = (x - mean[:, None, None]) * torch.rsqrt(var + self.eps)[:, None, None]
        y = y * self.weight[:, None, None] + self.bias[:, None, None]
        with torch.no_grad():
            self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), self.momentum)
            unbiased = var.detach() * (count / (count - 1).clamp_min(1))
            self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)
            self.num_batches_tracked.add_(1)
        return y

    def _ghost(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        g = self.ghost_batch
        if n % g:
            raise ValueError(f"ghost batch norm: batch of {n} is not a multiple of ghost_batch={g}")
        xs = x.reshape(n // g, g, c, h, w)
        mean = xs.mean(dim=(1, 3, 4), keepdim=True)
        var = xs.var(dim=(1, 3, 4), unbiased=False, keepdim=True)
        y = (xs - mean) * torch.rsqrt(var + self.eps)
        y = y * self.weight.view(1, 1, c, 1, 1) + self.bias.view(1, 1, c, 1, 1)
        with torch.no_grad():
            count = g * h * w
            self.running_mean.lerp_(mean.mean(dim=0).flatten().to(self.running_mean.dtype), self.momentum)
            unbiased = var.mean(dim=0).flatten() * (count / max(count - 1, 1))
            self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)
            self.num_batches_tracked.add_(1)
        return y.reshape(n, c, h, w)
