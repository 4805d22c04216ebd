"""Learning-rate (and momentum) schedules as per-step multipliers, computed once up front.

Piecewise-linear and one-cycle schedules place their knots at fractions of training (the
speed-run convention); cosine, step and polynomial schedules count warm-up and milestones
in epochs (the ImageNet convention). Warm-up is linear from ``warmup_start`` to 1 (Goyal et
al. 2017).
"""
from __future__ import annotations

import math

import numpy as np

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
