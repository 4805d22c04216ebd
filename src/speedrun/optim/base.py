"""The optimizers' common frame: parameter groups whose state tensors are allocated once, at
construction, and an update whose hyperparameters may be 0-d device tensors.

Why not ``torch.optim``: the training step compiles the whole update (every group, the
weight averaging, the fp16 overflow skip) into one program that never recompiles as the run
advances. That needs the learning rate and momentum of each step to arrive as device
tensors (a Python float that changes each step is a new constant to dynamo, hence a new
graph), the state to exist before the first step (no lazily created buffers that change the
graph after step one), and every step-dependent condition (a renormalisation every N steps,
LAMB's bias correction) computed on the device. The rules themselves are the published ones,
checked against references written from the papers in the tests.

Two entry points share each rule:

- :meth:`Optimizer.update` is what the training step calls (traced by dynamo when compiled):
  ``lr_mult`` and ``momentum`` are 0-d device tensors from the schedule, each group's LR is
  its ``base_lr`` times ``lr_mult``, and groups named in ``frozen`` get LR 0 while the
  ``frozen_now`` tensor is true.
- :meth:`Optimizer.step` steps eagerly with each group's own ``lr`` and ``momentum`` (floats),
  as ``torch.optim`` does; tests and small scripts use it.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor

Number = float | Tensor


class Optimizer:
    """Parameter groups (dicts, as in torch.optim: ``params`` plus hyperparameters) and their
    state, a dict of tensor lists per group aligned with its ``params``."""

    state_names: tuple[str, ...] = ()        # per-parameter state tensors, zero at the start
    counters: tuple[str, ...] = ()           # per-group 0-d step counters (float32)

    def __init__(self, params: Iterable, defaults: dict):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [dict(params=groups)]
        self.defaults = defaults
        self.param_groups: list[dict] = []
        for g in groups:
            group = {**defaults, **g, "params": list(g["params"])}
            group.setdefault("base_lr", group["lr"])
            group.setdefault("name", f"group{len(self.param_groups)}")
            p0 = group["params"][0] if group["params"] else None
            group["state"] = {name: [torch.zeros_like(p, memory_format=torch.preserve_format) for p in group["params"]]
                              for name in self.state_names}
            for name in self.counters:
                group["state"][name] = torch.zeros((), device=p0.device if p0 is not None else None)
            self.param_groups.append(group)

    # -- stepping ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """One eager step with each group's ``lr`` and ``momentum`` as they stand."""
        for group in self.param_groups:
            self._group_step(group, group["lr"], group.get("momentum"))

    @torch.no_grad()
    def update(self, lr_mult: Number, momentum: Number | None = None, frozen: frozenset[str] = frozenset(),
               frozen_now: Tensor | bool = False, grad_scale: Tensor | None = None,
               head_only: Tensor | bool = False) -> None:
        """One step at the schedule's ``lr_mult`` (and ``momentum`` where the schedule sets it;
        a group's own otherwise), with the gradients multiplied by ``grad_scale`` where given
        (fp16's inverse loss scale; the gradients themselves are left as they are). Groups
        marked ``held`` (fine-tuning's body) get LR 0 while ``head_only`` is true. Nothing
        here reads a value back from the device."""
        for group in self.param_groups:
            lr = group["base_lr"] * lr_mult
            if group["name"] in frozen:
                lr = _held(lr, frozen_now)
            if group.get("held"):
                lr = _held(lr, head_only)
            self._group_step(group, lr, momentum if momentum is not None and self.scheduled_momentum(group)
                             else group.get("momentum"), grad_scale)

    def scheduled_momentum(self, group: dict) -> bool:
        """Whether the schedule's momentum replaces this group's own."""
        return "momentum" in group

    def _group_step(self, group: dict, lr: Number, momentum: Number | None, grad_scale: Tensor | None = None) -> None:
        live = [(p, i) for i, p in enumerate(group["params"]) if p.grad is not None]
        if not live:
            return
        params = [p for p, _ in live]
        state = {k: ([v[i] for _, i in live] if isinstance(v, list) else v) for k, v in group["state"].items()}
        grads = [p.grad for p in params]
        if grad_scale is not None:
            grads = torch._foreach_mul(grads, grad_scale)
        self._update_group(group, params, grads, state, lr, momentum)

    def _update_group(self, group: dict, params: list[Tensor], grads: list[Tensor], state: dict, lr: Number,
                      momentum: Number | None) -> None:
        """The optimizer's rule, applied to one group's parameters that have gradients (``params``,
        their ``grads`` and ``state``, already cut to those) at ``lr`` and ``momentum``."""
        raise NotImplementedError

    # -- state -------------------------------------------------------------------------------
    def state_tensors(self) -> list[Tensor]:
        """Every state tensor, in a fixed order (checkpoints, resets, the fp16 skip)."""
        out = []
        for g in self.param_groups:
            for name in (*self.state_names, *self.counters):
                v = g["state"][name]
                out.extend(v if isinstance(v, list) else [v])
        return out

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the state before the first step (a new run in the same tensors)."""
        tensors = self.state_tensors()
        if tensors:
            torch._foreach_zero_(tensors)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        return {"state": [t.detach().clone() for t in self.state_tensors()],
                "lr": [g["lr"] for g in self.param_groups]}

    @torch.no_grad()
    def load_state_dict(self, saved: dict) -> None:
        mine = self.state_tensors()
        if len(saved["state"]) != len(mine) or any(a.shape != b.shape for a, b in zip(mine, saved["state"])):
            raise ValueError("the saved optimizer state does not fit this optimizer's parameters")
        if mine:
            torch._foreach_copy_(mine, [t.to(m.device) for m, t in zip(mine, saved["state"])])
        for g, lr in zip(self.param_groups, saved.get("lr", [])):
            g["lr"] = lr


def _held(lr: Number, now: Tensor | bool) -> Number:
    """``lr``, or 0 where ``now`` (a 0-d device tensor, or a bool) is true."""
    return torch.where(now, 0.0, lr) if isinstance(now, Tensor) else (0.0 if now else lr)


def scaled(tensors: list[Tensor], factor: Number) -> list[Tensor]:
    """``tensors * factor`` for a float or a 0-d tensor factor."""
    return torch._foreach_mul(tensors, factor)


class SGD(Optimizer):
    """Momentum SGD with coupled weight decay and optional Nesterov momentum, torch.optim.SGD's
    rule: ``d = g + wd·w``; ``v = momentum·v + d``; ``w -= lr·(d + momentum·v)`` (Nesterov) or
    ``w -= lr·v``. The buffer starts at zero, so its first value is exactly ``d``, as torch's."""

    state_names = ("momentum_buffer",)

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    def _update_group(self, group, params, grads, state, lr, momentum):
        bufs = state["momentum_buffer"]
        wd = group["weight_decay"]
        d = torch._foreach_add(grads, params, alpha=wd) if wd else grads
        if isinstance(momentum, Tensor) or momentum:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, d)
            d = torch._foreach_add(d, scaled(bufs, momentum)) if group["nesterov"] else bufs
        torch._foreach_sub_(params, scaled(d, lr))
