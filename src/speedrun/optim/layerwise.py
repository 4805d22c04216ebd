"""LARS and LAMB: layer-wise adaptive optimizers for large batches.

Both rescale the step of each parameter tensor by a trust ratio made from the tensor's weight
norm and the norm of its step, so every layer moves by a similar fraction of its own size and
a large batch (with its large LR) does not blow up the layers whose gradients are large.

- ``LARS`` (You, Gitman & Ginsburg 2017): momentum SGD with L2 decay. With ``d = g + wd·w`` and
  ``trust = eta·‖w‖ / (‖g‖ + wd·‖w‖)``, the buffer is ``v = momentum·v + trust·d`` and the step
  ``w -= lr·v`` (Nesterov: ``w -= lr·(trust·d + momentum·v)``).
- ``LAMB`` (You et al. 2019): ``r = m̂ / (sqrt(v̂) + eps) + wd·w`` from bias-corrected Adam
  moments, ``trust = ‖w‖ / ‖r‖`` and ``w -= lr·trust·r``.

In both, a group's ``lr`` is the per-step rate and ``weight_decay`` is the coefficient ``wd``
of the published formula (so the decay actually applied scales with ``lr`` and the trust
ratio). A group with ``adapt=False`` uses trust 1: momentum SGD with L2 decay (LARS) or AdamW
(LAMB), as is usual for biases and batch-norm parameters. Trust is also 1 for a tensor whose
weight norm or step norm is 0, so zero-initialised tensors can start moving. LAMB's Adam
direction is ``adam.py``'s, which AdamW shares.

Each group's norms are taken in one ``torch._foreach_norm`` call for the weights and one for
the steps, and the trust ratios stay on the device: a step never waits for the host. Both
are :class:`~speedrun.optim.base.Optimizer` rules: state allocated up front, LR and
momentum accepted as device tensors (see base.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .adam import adam_direction
from .base import Number, Optimizer, scaled


def _norms(tensors: list[Tensor]) -> Tensor:
    """The L2 norm of each tensor, as one 1-D tensor."""
    return torch.stack(torch._foreach_norm(tensors))


class LARS(Optimizer):
    """Momentum SGD whose step for each tensor is scaled by eta·‖w‖ / (‖g‖ + wd·‖w‖)."""

    state_names = ("momentum_buffer",)

    def __init__(self, params, lr: float, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, adapt: bool = True):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, adapt=adapt))

    def _update_group(self, group: dict, params: list[Tensor], grads: list[Tensor], state: dict, lr: Number,
                      momentum: Number) -> None:
        bufs = state["momentum_buffer"]
        wd = group["weight_decay"]
        d = torch._foreach_add(grads, params, alpha=wd) if wd else grads
        if group["adapt"]:
            w_norm, g_norm = _norms(params), _norms(grads)
            ratio = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm)
            trust = torch.where((w_norm > 0) & (g_norm > 0), ratio, 1.0)
            d = torch._foreach_mul(d, trust.unbind())
        # the buffer starts at zero, so its first value is exactly trust·d
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, d)
        update = torch._foreach_add(d, scaled(bufs, momentum)) if group["nesterov"] else bufs
        torch._foreach_sub_(params, scaled(update, lr))


class LAMB(Optimizer):
    """Adam with decay added to its direction r, and each tensor's step scaled by ‖w‖ / ‖r‖.
    The step count (for the bias corrections) is a 0-d tensor per group, counted on the device."""

    state_names = ("exp_avg", "exp_avg_sq")
    counters = ("step",)

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, adapt: bool = True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adapt=adapt))

    def scheduled_momentum(self, group: dict) -> bool:
        return False                                  # LAMB's betas stay fixed

    def _update_group(self, group: dict, params: list[Tensor], grads: list[Tensor], state: dict, lr: Number,
                      momentum) -> None:
        r = adam_direction(state["exp_avg"], state["exp_avg_sq"], state["step"], grads, group["betas"], group["eps"])
        if group["weight_decay"]:
            torch._foreach_add_(r, params, alpha=group["weight_decay"])
        if group["adapt"]:
            w_norm, r_norm = _norms(params), _norms(r)
            trust = torch.where((w_norm > 0) & (r_norm > 0), w_norm / r_norm, 1.0)
            torch._foreach_mul_(r, trust.unbind())
        torch._foreach_sub_(params, scaled(r, lr))
