"""Loss-based pruning of easy images between passes (``data.prune``).

Every training forward already computes each image's loss; keeping the last one per image
costs one scatter per step. After a first pass over every image, each new pass over the
training set leaves out a random fraction ``prune`` of the images whose last loss is below
the mean of all last losses (the easy ones), and the easy images that stay count
``1 / (1 - prune)`` in the loss, so the expected gradient of a pass is that of a full one.
The hard images are always kept. Passes that start in the last ``prune_full`` of the run's
steps take every image again, with weight 1. (The rule follows InfoBatch, Qin et al. 2024, which reports
unchanged accuracy with about 40% fewer images per epoch on long CIFAR-10 trainings.)

A pass is a shuffled list of the kept images cut into full batches; its remainder is
dropped, as a full epoch drops its last partial batch. Passes are not the recipe's epochs:
``train.epochs`` still counts steps (``len(train set) / batch`` of them per epoch), so a
pruned run of the same steps costs the same FLOPs and sees the hard images more often.
Augmentation draws (and the alternating flip) are made per pass.
"""
from __future__ import annotations

import math

import torch

from ...errors import RecipeError


class LossPruner:
    """The per-image losses and the current pass of one run, on ``device``."""

    def __init__(self, n: int, fraction: float, full_from_step: int, device: torch.device):
        """``fraction``: ``data.prune`` (the recipe holds it in (0, 1))."""
        self.n, self.fraction, self.full_from_step = n, fraction, full_from_step
        self.loss = torch.full((n,), math.inf, device=device)
        self.weight = torch.ones(n, device=device)
        self.order = torch.empty(0, dtype=torch.int64, device=device)   # the current pass's images
        self.next = 0                          # position of the next batch in ``order``
        self.passes = 0                        # passes started
        self.kept: list[int] = []              # images per pass, for the record
        self.draws: dict[str, torch.Tensor] = {}
        self.current: torch.Tensor | None = None      # image ids of the batch being trained

    def plan(self, generator: torch.Generator, full: bool) -> None:
        """Start a pass: which images it visits, in which order, and their loss weights."""
        loss, dev = self.loss, self.loss.device
        seen = torch.isfinite(loss)
        self.weight.fill_(1.0)
        if full or not bool(seen.any()):
            keep = torch.ones(self.n, dtype=torch.bool, device=dev)
        else:
            easy = seen & (loss < loss[seen].mean())
            drop = easy & (torch.rand(self.n, generator=generator, device=dev) < self.fraction)
            keep = ~drop
            self.weight[easy & keep] = 1.0 / (1.0 - self.fraction)
        ids = keep.nonzero().flatten()
        self.order = ids[torch.randperm(len(ids), generator=generator, device=dev)]
        self.next = 0
        self.passes += 1
        self.kept.append(len(ids))

    def batch(self, batch_size: int, step: int, generator: torch.Generator, augment) -> torch.Tensor:
        """The image ids of the batch for global ``step`` (a new pass where the current one
        has no full batch left)."""
        if self.next + batch_size > len(self.order):
            self.plan(generator, full=step >= self.full_from_step)
            self.draws = augment.draw(self.passes - 1)
            if batch_size > len(self.order):
                raise RecipeError(f"data.prune={self.fraction} left a pass of {len(self.order)} of {self.n} images, "
                                  f"fewer than data.batch_size={batch_size}: lower data.prune or data.batch_size")
        idx = self.order[self.next:self.next + batch_size]
        self.next += batch_size
        self.current = idx
        return idx

    def record(self, per_image_loss: torch.Tensor) -> None:
        """The losses of the batch just trained (in the order of its image ids)."""
        self.loss.index_copy_(0, self.current, per_image_loss.detach().float())

    def batch_weights(self) -> torch.Tensor:
        return self.weight.index_select(0, self.current)

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue the same passes (checkpoints)."""
        return {"loss": self.loss.cpu().clone(), "weight": self.weight.cpu().clone(), "order": self.order.cpu().clone(),
                "next": self.next, "passes": self.passes, "kept": list(self.kept),
                "draws": {k: v.cpu().clone() for k, v in self.draws.items()}}

    def load_state_dict(self, state: dict) -> None:
        dev = self.loss.device
        self.loss.copy_(state["loss"].to(dev))
        self.weight.copy_(state["weight"].to(dev))
        self.order = state["order"].to(dev)
        self.next, self.passes, self.kept = state["next"], state["passes"], list(state["kept"])
        self.draws = {k: v.to(dev) for k, v in state["draws"].items()}
