"""Weight averaging over training: an exponential moving average of the weights (Page's
ResNet-9; Polyak averaging) or lookahead-style averaging (Zhang et al., 2019; airbench94),
where the fast weights are pulled back onto the average after each update.

Both average every floating-point tensor of the model's state (weights and batch-norm
running statistics) every ``every`` steps, with foreach kernels and no host sync.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from ..recipe import AveragingConfig


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]


class WeightAverage:
    def __init__(self, model: nn.Module, cfg: AveragingConfig, total_steps: int,
                 stand_ins: dict[int, torch.Tensor] | None = None):
        """``stand_ins``: fp32 copies that stand in for some of the model's tensors (by id),
        averaged in their place; :meth:`finalize` and :meth:`applied` round them into the model."""
        self.cfg, self.total = cfg, total_steps
        stand_ins = stand_ins or {}
        state = state_tensors(model)
        self.live = [stand_ins.get(id(t), t) for t in state]
        self.shadow = [t.detach().clone() for t in self.live]
        self._mirrored = ([t for t in state if id(t) in stand_ins], [stand_ins[id(t)] for t in state if id(t) in stand_ins])

    def _mirror(self) -> None:
        if self._mirrored[0]:
            torch._foreach_copy_(*self._mirrored)

    def decay_at(self, step):
        """The decay after optimizer step ``step`` (an int, or a device tensor in the step)."""
        if self.cfg.kind == "lookahead":
            return self.cfg.decay * (step / self.total) ** self.cfg.power
        return self.cfg.decay

    @torch.no_grad()
    def reset(self) -> None:
        """The average restarts from the model's current weights (a new run)."""
        torch._foreach_copy_(self.shadow, self.live)

    @torch.no_grad()
    def update(self, step) -> None:
        """Call after optimizer step number ``step`` (1-based): an int, or a 0-d device tensor
        inside the training step, where "every N steps" is decided on the device (both the
        average and its skip are computed, and the due one kept), so a compiled step never
        depends on the step number."""
        every = self.cfg.every
        if not isinstance(step, torch.Tensor):
            if step % every:
                return
            self._blend(1.0 - self.decay_at(step), None)
            return
        due = torch.remainder(step, every) == 0
        self._blend(1.0 - self.decay_at(step.float()), due)

    def _blend(self, weight, due) -> None:
        # shadow <- decay * shadow + (1 - decay) * live; lookahead then pulls live onto it
        blended = torch._foreach_add(self.shadow, torch._foreach_mul(torch._foreach_sub(self.live, self.shadow),
                                                                     weight))
        if due is not None:
            blended = [torch.where(due, b, s) for b, s in zip(blended, self.shadow)]
        torch._foreach_copy_(self.shadow, blended)
        if self.cfg.kind == "lookahead":
            pulled = self.shadow if due is None else [torch.where(due, s, v) for s, v in zip(self.shadow, self.live)]
            torch._foreach_copy_(self.live, pulled)

    @torch.no_grad()
    def finalize(self) -> None:
        """Put the averaged weights into the model for good."""
        torch._foreach_copy_(self.live, self.shadow)
        self._mirror()

    @contextmanager
    @torch.no_grad()
    def applied(self):
        """Temporarily swap the averaged weights into the model (for a monitoring eval)."""
        saved = [t.clone() for t in self.live]
        torch._foreach_copy_(self.live, self.shadow)
        self._mirror()
        try:
            yield
        finally:
            torch._foreach_copy_(self.live, saved)
            self._mirror()


def build_averager(model: nn.Module, cfg: AveragingConfig, total_steps: int,
                   stand_ins: dict[int, torch.Tensor] | None = None) -> WeightAverage | None:
    return None if cfg.kind == "none" else WeightAverage(model, cfg, total_steps, stand_ins)
