"""Learning-rate (and momentum) schedules as per-step multipliers, computed once up front."""
from __future__ import annotations

import numpy as np

from ..recipe import OneCycleSchedule, PiecewiseSchedule


def piecewise_linear(knots, values, total_steps: int) -> list[float]:
    """Multiplier at each step t (0..total-1), linear between (knot, value) points placed at
    fractions of training; used by Page's series for both warm-up and decay."""
    t = np.arange(total_steps) / total_steps
    return np.interp(t, knots, values).tolist()


def lr_multipliers(cfg, total_steps: int) -> list[float]:
    if isinstance(cfg, PiecewiseSchedule):
        return piecewise_linear(cfg.knots, cfg.values, total_steps)
    if isinstance(cfg, OneCycleSchedule):
        # one cycle (Smith & Topin, 2017): linear up to the peak, linear down to the end
        return piecewise_linear([0, cfg.peak_at, 1], [cfg.start, 1.0, cfg.end], total_steps)
    raise TypeError(f"unknown schedule {cfg!r}")


def momenta(cfg, base_momentum: float, total_steps: int) -> list[float] | None:
    """One-cycle's momentum, cycled inversely to the LR; None when momentum is constant."""
    if isinstance(cfg, OneCycleSchedule) and cfg.momentum_low is not None:
        return piecewise_linear([0, cfg.peak_at, 1], [base_momentum, cfg.momentum_low, base_momentum],
                                total_steps)
    return None
