"""Device-resident data for small datasets: the whole set is moved to the device once and
stays there as uint8 (a quarter of the bytes of float32), in the runtime's memory layout.
Each epoch is a permutation plus batched work on the device: gather a batch, normalise it in
the compute dtype, reflect-pad it for the random crop and augment it. No worker processes,
no per-image Python, and no float copy of the whole set is ever made.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from ..augment.batch import BatchAugment, reflect_pad
from ..sources.builtin import ArrayDataset
from .shard import Shard

STATS_BYTES = 64 << 20
"""Bytes of float64 temporaries per chunk when summing channel statistics: 4,096 CIFAR
images, 55 ImageNet images at 224 px (a fixed 4,096 images would be about 10 GB there)."""


def stats_chunk(image_shape: tuple[int, ...], budget: int = STATS_BYTES) -> int:
    """Images per chunk of channel statistics for images of ``image_shape`` (C, H, W)."""
    per_image = 8
    for d in image_shape:
        per_image *= d
    return max(1, budget // per_image)


def channel_stats(images_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (N-1 normalised) of uint8 images, on the images' device, in
    [0, 255] units; summed in float64 chunk by chunk (:func:`stats_chunk`), so no float copy
    of the set, nor a large temporary, is made."""
    c = images_u8.shape[1]
    total = torch.zeros(c, dtype=torch.float64, device=images_u8.device)
    squares = torch.zeros(c, dtype=torch.float64, device=images_u8.device)
    for chunk in images_u8.split(stats_chunk(tuple(images_u8.shape[1:]))):
        x = chunk.double()
        total += x.sum(dim=(0, 2, 3))
        squares += x.square().sum(dim=(0, 2, 3))
    count = images_u8.numel() // c
    mean = total / count
    var = (squares - count * mean.square()) / max(count - 1, 1)
    return mean.float(), var.clamp_min(0).sqrt().float()


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """Antialiased bilinear resize of a batch to size x size (progressive resizing), computed
    in fp32: the CPU kernel has no bf16 version, and fp32 is exact enough to round from."""
    out = F.interpolate(x.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out.to(x.dtype)


class ResidentData:
    """Train and test images on ``device`` as uint8; batches come out normalised in ``dtype``."""

    crops_in_workers = False              # random-resized crops are cut here, on the device

    def __init__(self, ds: ArrayDataset, device: torch.device, dtype: torch.dtype,
                 memory_format: torch.memory_format, translate: int = 0, shard: Shard = Shard(),
                 whole_epoch: bool = False):
        """``shard``: batches are this rank's share of each global batch
        (every rank holds the whole set and draws the same permutation from the seed);
        ``whole_epoch``: augment the whole training set at the start of each epoch and cut the
        batches from it (``augment.whole_epoch``)."""
        self.train = ds.train_x.to(device, non_blocking=True).contiguous(memory_format=memory_format)
        self.test = ds.test_x.to(device, non_blocking=True).contiguous(memory_format=memory_format)
        given = getattr(ds, "normalisation", None)           # (the mean and std starting weights were trained with)
        self.mean, self.std = (given[0].to(device), given[1].to(device)) if given else channel_stats(self.train)
        self._scale = (1 / self.std)[:, None, None]
        self._shift = (-self.mean / self.std)[:, None, None]
        self.train_y = ds.train_y.to(device)
        self.test_y = ds.test_y.to(device)
        held = getattr(ds, "holdout_x", None)          # train.stop_at_target's validation split
        self.holdout = None if held is None else held.to(device, non_blocking=True).contiguous(
            memory_format=memory_format)
        self.holdout_y = None if held is None else ds.holdout_y.to(device)
        self.translate = translate
        self.image_size = ds.image_size                 # training size (random-resized crops)
        self.stored_size = tuple(self.train.shape[2:])
        self.dtype, self.memory_format, self.device = dtype, memory_format, device
        self.shard = shard
        self.whole_epoch = whole_epoch
        self.skipped, self.skipped_files = 0, {}         # nothing is skipped here (a decoded cache says its own)
        self.pruner = None               # a LossPruner (data.prune), set by the engine

    @property
    def n_train(self) -> int:
        return self.train.shape[0]

    @property
    def n_test(self) -> int:
        return self.test.shape[0]

    def normalise(self, x_u8: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(x - mean) / std of a uint8 batch, computed in fp32 and stored in ``dtype``."""
        return torch.addcmul(self._shift, x_u8.float(), self._scale).to(dtype or self.dtype)

    def whitening_sample(self, n: int) -> torch.Tensor:
        """The first ``n`` training images, normalised (float32)."""
        return self.normalise(self.train[:n], torch.float32)

    def epoch(self, epoch: int, batch_size: int, augment: BatchAugment, generator: torch.Generator,
              size: int | None = None, skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled, augmented full batches for one epoch (the last partial batch is dropped),
        resized to ``size`` for progressive resizing, starting after ``skip`` batches."""
        if self.pruner is not None:
            yield from self._pruned_epoch(epoch, batch_size, augment, generator, size, skip)
            return
        perm = torch.randperm(self.n_train, generator=generator, device=self.device)
        draws = augment.draw(epoch)
        mine = self.shard.train_positions(batch_size)
        if not isinstance(mine, slice):
            mine = torch.as_tensor(mine, device=self.device)
        if self.whole_epoch:
            # the same per-image draws applied to every image at once: the batches are the ones
            # below to the bit, cut from one augmented copy of the set by a gather each
            every = torch.arange(self.n_train, device=self.device)
            images, _ = self._train_batch(every, augment, draws, size)
            for i in range(skip, self.n_train // batch_size):
                idx = perm[i * batch_size:(i + 1) * batch_size][mine]
                yield images[idx].contiguous(memory_format=self.memory_format), self.train_y[idx]
            return
        for i in range(skip, self.n_train // batch_size):
            idx = perm[i * batch_size:(i + 1) * batch_size][mine]
            yield self._train_batch(idx, augment, draws, size)

    def _pruned_epoch(self, epoch, batch_size, augment, generator, size, skip):
        """An epoch's worth of steps from the pruner's passes (see :mod:`speedrun.data.pipeline.pruning`)."""
        spe = self.n_train // batch_size
        for i in range(skip, spe):
            idx = self.pruner.batch(batch_size, epoch * spe + i, generator, augment)
            yield self._train_batch(idx, augment, self.pruner.draws, size)

    def _train_batch(self, idx, augment, draws, size):
        x = reflect_pad(self.normalise(self.train[idx]), self.translate)
        x = augment(x, idx, draws, size)
        if size is not None and size != x.shape[-1]:
            x = resize(x, size)
        return x.contiguous(memory_format=self.memory_format), self.train_y[idx]

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test set in batches of ``batch_size`` (this rank's slice of each)."""
        for x, y, _ in self.indexed_test_batches(batch_size):
            yield x, y

    def indexed_test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """test_batches with the test-set index of each image."""
        return self._evaluation_batches(self.test, self.test_y, batch_size)

    def holdout_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The validation split held out of the training images (train.stop_at_target), batched
        as the test set is; the test set is not read."""
        for x, y, _ in self._evaluation_batches(self.holdout, self.holdout_y, batch_size):
            yield x, y

    def _evaluation_batches(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int):
        n_images = images.shape[0]
        for i in range(0, n_images, batch_size):
            n = min(batch_size, n_images - i)
            mine = self.shard.eval_slice(n)
            part = slice(i + mine.start, i + mine.stop)
            x = self.normalise(images[part])
            yield x.contiguous(memory_format=self.memory_format), labels[part], torch.arange(part.start, part.stop)
