"""Which images of each batch this process takes, when several processes train together.

Every rank draws the same permutation from the seed, so the global batches are the same
whatever the number of processes; each rank then takes a disjoint share of each one. With
gradient accumulation the global batch is first cut into micro-batches and each micro-batch
is shared out, so micro-batch j of every rank together is exactly micro-batch j of a single
process: runs with 1 and N processes see the same images in the same groups (which batch
norm, synchronised across ranks, depends on).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def shard_slice(n: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` items split over ``world`` ranks (the first
    ``n % world`` ranks take one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


@dataclass(frozen=True)
class Shard:
    """This process's place: rank ``rank`` of ``world``, whose training steps are cut into
    ``micro_batches`` micro-batches (train.accumulate)."""
    rank: int = 0
    world: int = 1
    micro_batches: int = 1

    def train_positions(self, batch: int) -> slice | np.ndarray:
        """Positions, within a global training batch of ``batch``, of this rank's images:
        its share of each micro-batch, in micro-batch order."""
        if self.world == 1:
            return slice(0, batch)
        if self.micro_batches == 1:
            return shard_slice(batch, self.rank, self.world)
        micro = batch // self.micro_batches
        mine = shard_slice(micro, self.rank, self.world)
        return np.concatenate([np.arange(j * micro + mine.start, j * micro + mine.stop)
                               for j in range(self.micro_batches)])

    def eval_slice(self, n: int) -> slice:
        """This rank's contiguous share of an evaluation batch of ``n`` images."""
        return shard_slice(n, self.rank, self.world)

    def eval_size(self, n: int) -> int:
        sl = self.eval_slice(n)
        return sl.stop - sl.start
