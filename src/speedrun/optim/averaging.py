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
    return [t for t in model.state_dict().values() if t.is_floating_point()]


class WeightAverage:
    def __init__(self, model: nn.Module, cfg: AveragingConfig, total_steps: int):
        self.cfg, self.total = cfg, total_steps
        self.live = state_tensors(model)
        self.shadow = [t.detach().clone() for t in self.live]

    def decay_at(self, step: int) -> float:
        if self.cfg.kind == "lookahead":
            return self.cfg.decay * (step / self.total) ** self.cfg.power
        return self.cfg.decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Call after optimizer step number ``step`` (1-based)."""
        if step % self.cfg.every:
            return
        # shadow <- decay * shadow + (1 - decay) * live
        torch._foreach_lerp_(self.shadow, self.live, 1.0 - self.decay_at(step))
        if self.cfg.kind == "lookahead":
            torch._foreach_copy_(self.live, self.shadow)

    @torch.no_grad()
    def finalize(self) -> None:
        """Put the averaged weights into the model for good."""
        torch._foreach_copy_(self.live, self.shadow)

    @contextmanager
    @torch.no_grad()
    def applied(self):
        """Temporarily swap the averaged weights into the model (for a monitoring eval)."""
        saved = [t.clone() for t in self.live]
        torch._foreach_copy_(self.live, self.shadow)
        try:
            yield
        finally:
            torch._foreach_copy_(self.live, saved)


def build_averager(model: nn.Module, cfg: AveragingConfig, total_steps: int) -> WeightAverage | None:
    return None if cfg.kind == "none" else WeightAverage(model, cfg, total_steps)
