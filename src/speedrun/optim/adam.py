"""AdamW (Loshchilov & Hutter 2019, "Decoupled weight decay regularization") and the Adam
direction it shares with LAMB.

Adam keeps two moving averages per tensor, of the gradient (``m``) and of its square (``v``);
both start at zero, so each is divided by ``1 - beta**t`` after ``t`` steps (the bias
correction). The direction is ``m̂ / (sqrt(v̂) + eps)``. AdamW takes the decay out of the
gradient: each step first shrinks every weight by ``lr · weight_decay`` of itself, then moves
it by ``lr`` times the direction, so the decay is not divided by ``sqrt(v̂)`` as an L2 term in
the gradient would be:

    w ← w · (1 − lr·wd) − lr · m̂ / (sqrt(v̂) + eps)

This is the update of ``torch.optim.AdamW`` (checked step for step in tests/test_adamw.py); a
group's ``lr`` is its per-step rate and ``weight_decay`` that optimizer's coefficient.

The step count ``t`` is a 0-d float tensor per group, advanced on the device, and the bias
corrections are computed from it there: a compiled update sees the same graph at every step
and never waits for the host (see base.py).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

from .base import Number, Optimizer, scaled


def adam_direction(m: list[Tensor], v: list[Tensor], step: Tensor, grads: list[Tensor], betas: tuple[float, float],
                   eps: float) -> list[Tensor]:
    """Advance one group's moments by ``grads`` and its counter ``step`` by one, in place, and
    return the bias-corrected Adam direction ``m̂ / (sqrt(v̂) + eps)`` of each tensor (new
    tensors; the moments are left as the next step needs them)."""
    beta1, beta2 = betas
    step.add_(1)
    torch._foreach_lerp_(m, grads, 1 - beta1)              # m = beta1·m + (1 - beta1)·g
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    # sqrt(v̂) + eps = sqrt(v) / sqrt(1 - beta2**t) + eps; then m / that / (1 - beta1**t)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, torch.sqrt(1 - torch.pow(beta2, step)))
    torch._foreach_add_(denom, eps)
    direction = torch._foreach_div(m, denom)
    torch._foreach_div_(direction, 1 - torch.pow(beta1, step))
    return direction


class AdamW(Optimizer):
    """Adam with decoupled weight decay. Per group: ``lr`` (per step), ``betas``, ``eps`` and
    ``weight_decay`` (each step removes ``lr · weight_decay`` of each weight, before the Adam
    step, as torch.optim.AdamW does). The betas stay fixed: a schedule's momentum is not
    applied to them."""

    state_names = ("exp_avg", "exp_avg_sq")
    counters = ("step",)

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def scheduled_momentum(self, group: dict) -> bool:
        return False

    def _update_group(self, group: dict, params: list[Tensor], grads: list[Tensor], state: dict, lr: Number,
                      momentum) -> None:
        direction = adam_direction(state["exp_avg"], state["exp_avg_sq"], state["step"], grads, group["betas"],
                                   group["eps"])
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_sub_(params, scaled(direction, lr))
