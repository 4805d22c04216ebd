"""Orthogonalised momentum updates for convolution filters (Muon; Jordan et al. 2024, used in
the airbench CIFAR-10 records).

Each conv filter bank's momentum-smoothed gradient, seen as a matrix (out, in*k*k), is
replaced by the nearest semi-orthogonal matrix, approximated by a few Newton-Schulz
iterations; every direction of the update then has the same size. Filter banks of the same
shape are orthogonalised together in one batched product (the 2025 CIFAR-10 record's
trick), and the filters' norms can be reset to sqrt(out channels) every few steps, which
keeps the effective step size fixed. torch.optim.Muon handles only 2-D parameters, hence
this one.

Everything else (biases, norms, the linear head) keeps torch's SGD; :class:`OptimizerList`
presents both as one optimizer to the training loop.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from .base import Optimizer, scaled

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)      # quintic iteration coefficients, Jordan et al. (2024)


def ns_dtype(setting: str, device_type: str, precision: str) -> torch.dtype:
    """The dtype of the Newton-Schulz products for ``optim.ns_precision`` = ``setting``.

    "auto": bf16 on CUDA (as the records run it) and wherever the run computes in bf16 (on a
    CPU, ``runtime.precision`` "auto" picks bf16 only where the CPU has native bf16 units,
    and there these products of up to 512 x 4608 matrices run about 4 times faster than in
    fp32: docs/speed.md); fp32 otherwise. The iteration only needs a rough orthogonalisation
    (its coefficients trade accuracy for speed), so bf16 loses nothing that matters."""
    if setting == "bf16" or (setting == "auto" and (device_type == "cuda" or precision == "bf16")):
        return torch.bfloat16
    return torch.float32


def newton_schulz(g: torch.Tensor, steps: int, coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalise each matrix of a (batch, rows, cols) tensor: U S V^T -> ~U V^T.

    The products run in ``dtype``; by default bf16 on CUDA (as the records do) and fp32
    elsewhere (:func:`ns_dtype` decides for a run)."""
    a, b, c = coefficients
    x = g.to(dtype or ns_dtype("auto", g.device.type, "fp32"))
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        m = x @ x.mT
        x = a * x + (b * m + c * m @ m) @ x
    return (x.mT if tall else x).to(g.dtype)


class OrthogonalFilters(Optimizer):
    """Nesterov momentum, then batched Newton-Schulz orthogonalisation, for 4-D conv filters.

    ``ns_dtype``: the dtype of the Newton-Schulz products (None: :func:`newton_schulz`'s
    default). Per group: ``lr``, ``momentum``, ``nesterov``, ``ns_steps``, ``norm_every`` (renormalise
    each filter bank to Frobenius norm sqrt(out channels) every this many steps; 0 = never;
    decided on the device from the group's step counter) and ``weight_decay`` (coupled to the
    LR as in torch's SGD: each step removes lr * weight_decay of each weight)."""

    state_names = ("momentum_buffer",)
    counters = ("steps_taken",)

    def __init__(self, params, lr: float, momentum: float = 0.6, nesterov: bool = True, ns_steps: int = 3,
                 norm_every: int = 1, weight_decay: float = 0.0, ns_dtype: torch.dtype | None = None):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, norm_every=norm_every,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 4:
                    raise ValueError(f"OrthogonalFilters takes 4-D conv filters, got a parameter of shape {tuple(p.shape)}")
            if group["params"]:            # each bank's target norm, sqrt(out channels), kept on the device
                group["target_norms"] = torch.tensor([p.shape[0] ** 0.5 for p in group["params"]],
                                                     device=group["params"][0].device)

    def scheduled_momentum(self, group: dict) -> bool:
        return False                                  # the filters keep their own momentum

    def _update_group(self, group, params, grads, state, lr, momentum) -> None:
        count = state["steps_taken"]
        count.add_(1)
        bufs = state["momentum_buffer"]
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads)
        updates = torch._foreach_add(grads, scaled(bufs, momentum)) if group["nesterov"] else bufs
        every = group["norm_every"]
        if every:
            due = torch.remainder(count, every) == 0
            norms = torch.stack(torch._foreach_norm(params))
            target = group["target_norms"] if len(params) == len(group["params"]) else \
                torch.tensor([p.shape[0] ** 0.5 for p in params], device=norms.device)
            torch._foreach_mul_(params, torch.where(due, target / norms, 1.0).unbind())
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            by_shape[tuple(p.shape)].append(i)
        for shape, idx in by_shape.items():
            rows, cols = shape[0], shape[1] * shape[2] * shape[3]
            stacked = torch.stack([updates[i].reshape(rows, cols) for i in idx])
            ortho = newton_schulz(stacked, group["ns_steps"], dtype=self.ns_dtype) * (max(1.0, rows / cols) ** 0.5 * lr)
            torch._foreach_sub_([params[i] for i in idx], [o.view(shape) for o in ortho.unbind()])


class OptimizerList:
    """Several optimizers stepped together, seen by the loop as one: ``param_groups`` is the
    concatenation of theirs (the same dicts)."""

    def __init__(self, *optimizers: Optimizer):
        self.optimizers = [o for o in optimizers if o.param_groups]

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def update(self, *args, **kwargs) -> None:
        for o in self.optimizers:
            o.update(*args, **kwargs)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for o in self.optimizers for t in o.state_tensors()]

    def reset(self) -> None:
        for o in self.optimizers:
            o.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)
