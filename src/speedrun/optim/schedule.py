"""Learning-rate (and momentum) schedules as per-step multipliers, computed once up front.

Piecewise-linear and one-cycle schedules place their knots at fractions of training (the
speed-run convention); cosine, step and polynomial schedules count warm-up and milestones
in epochs (the ImageNet convention). Warm-up is linear from ``warmup_start`` to 1 (Goyal et
al. 2017).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..recipe import CosineSchedule, OneCycleSchedule, PiecewiseSchedule, PolySchedule, StepSchedule


def piecewise_linear(knots, values, total_steps: int) -> list[float]:
    """Multiplier at each step t (0..total-1), linear between (knot, value) points placed at
    fractions of training; used by Page's series for both warm-up and decay."""
    t = np.arange(total_steps) / total_steps
    return np.interp(t, knots, values).tolist()


def _with_warmup(cfg, total_steps: int, steps_per_epoch: int, after) -> list[float]:
    """Linear warm-up over ``cfg.warmup_epochs``, then ``after(progress)`` with progress in [0, 1)."""
    warm = min(total_steps, round(cfg.warmup_epochs * steps_per_epoch))
    out = []
    for t in range(total_steps):
        if t < warm:
            out.append(cfg.warmup_start + (1 - cfg.warmup_start) * t / warm)
        else:
            out.append(after(t, (t - warm) / max(1, total_steps - warm)))
    return out


def lr_multipliers(cfg, total_steps: int, steps_per_epoch: int = 1) -> list[float]:
    if isinstance(cfg, PiecewiseSchedule):
        return piecewise_linear(cfg.knots, cfg.values, total_steps)
    if isinstance(cfg, OneCycleSchedule):
        # one cycle (Smith & Topin, 2017): linear up to the peak, linear down to the end
        return piecewise_linear([0, cfg.peak_at, 1], [cfg.start, 1.0, cfg.end], total_steps)
    if isinstance(cfg, CosineSchedule):
        # cosine decay (Loshchilov & Hutter 2017, without restarts; He et al. 2019)
        return _with_warmup(cfg, total_steps, steps_per_epoch,
                            lambda t, p: cfg.end + (1 - cfg.end) * 0.5 * (1 + math.cos(math.pi * p)))
    if isinstance(cfg, StepSchedule):
        return _with_warmup(cfg, total_steps, steps_per_epoch,
                            lambda t, p: cfg.gamma ** sum(t >= m * steps_per_epoch for m in cfg.milestones))
    if isinstance(cfg, PolySchedule):
        # polynomial decay, as in the large-batch LARS ImageNet runs
        return _with_warmup(cfg, total_steps, steps_per_epoch,
                            lambda t, p: cfg.end + (1 - cfg.end) * (1 - p) ** cfg.power)
    raise TypeError(f"unknown schedule {cfg!r}")


def momenta(cfg, base_momentum: float, total_steps: int) -> list[float] | None:
    """One-cycle's momentum, cycled inversely to the LR; None when momentum is constant."""
    if isinstance(cfg, OneCycleSchedule) and cfg.momentum_low is not None:
        return piecewise_linear([0, cfg.peak_at, 1], [base_momentum, cfg.momentum_low, base_momentum],
                                total_steps)
    return None


class ScheduleTables:
    """A run's schedule, step by step: on the host for logs (:attr:`lrs`, :attr:`moms`), and
    on the device for the training step, which looks its step up with its counter (a device
    tensor), so that a compiled step never sees a changing Python number. The device tables
    are allocated once; :meth:`idle` zeroes the LR (the warm-up's steps must not train) and
    :meth:`restore` puts it back."""

    def __init__(self, cfg, base_momentum: float, total_steps: int, steps_per_epoch: int, device: torch.device):
        self.lrs = lr_multipliers(cfg, total_steps, steps_per_epoch)
        self.moms = momenta(cfg, base_momentum, total_steps)
        self.lr_table = torch.tensor(self.lrs, dtype=torch.float32, device=device)
        self.mom_table = None if self.moms is None else torch.tensor(self.moms, dtype=torch.float32, device=device)

    def at(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(LR multiplier, momentum or None) of the step ``index`` (a 1-element device tensor)."""
        lr_mult = self.lr_table.index_select(0, index)[0]
        return lr_mult, None if self.mom_table is None else self.mom_table.index_select(0, index)[0]

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.lr_table] + ([self.mom_table] if self.mom_table is not None else [])

    def idle(self) -> None:
        self.lr_table.zero_()

    def restore(self) -> None:
        self.lr_table.copy_(torch.tensor(self.lrs, dtype=torch.float32))
