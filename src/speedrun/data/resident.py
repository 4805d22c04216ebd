"""Device-resident data for small datasets: the whole set is moved to the device once as
uint8, and everything that is the same every epoch (normalisation, reflect padding for the
random crop, dtype) is done once there. Each epoch is then a permutation plus batched
augmentation on the device, with no worker processes and no per-image Python.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from .augment import BatchAugment, reflect_pad
from .sources import ArrayDataset


def channel_stats(images_u8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std of uint8 images, on the images' device, in [0, 255] units."""
    x = images_u8.float()
    return x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3))


class ResidentData:
    """Normalised train/test tensors on ``device``; train batches are augmented per epoch."""

    def __init__(self, ds: ArrayDataset, device: torch.device, dtype: torch.dtype,
                 memory_format: torch.memory_format, translate: int = 0):
        train_u8 = ds.train_x.to(device, non_blocking=True)
        self.mean, self.std = channel_stats(train_u8)
        norm = lambda u8: ((u8.float() - self.mean[:, None, None]) / self.std[:, None, None])
        self.translate = translate
        self.train = reflect_pad(norm(train_u8), translate).to(dtype)
        del train_u8
        self.test = norm(ds.test_x.to(device)).to(dtype).contiguous(memory_format=memory_format)
        self.train_y = ds.train_y.to(device)
        self.test_y = ds.test_y.to(device)
        self.image_size = ds.image_size
        self.memory_format = memory_format
        self.device = device
        self.skipped = 0

    @property
    def n_train(self) -> int:
        return self.train.shape[0]

    @property
    def n_test(self) -> int:
        return self.test.shape[0]

    def whitening_sample(self, n: int) -> torch.Tensor:
        """The first ``n`` training images, normalised and without padding (float32)."""
        p = self.translate
        x = self.train[:n]
        if p:
            x = x[:, :, p:-p, p:-p]
        return x.float()

    def epoch(self, epoch: int, batch_size: int, augment: BatchAugment, generator: torch.Generator,
              size: int | None = None, skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled, augmented full batches for one epoch (the last partial batch is dropped),
        resized to ``size`` for progressive resizing, starting after ``skip`` batches."""
        perm = torch.randperm(self.n_train, generator=generator, device=self.device)
        draws = augment.draw(epoch)
        for i in range(skip, self.n_train // batch_size):
            idx = perm[i * batch_size:(i + 1) * batch_size]
            x = augment(self.train[idx], idx, draws)
            if size is not None and size != x.shape[-1]:
                x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            yield x.contiguous(memory_format=self.memory_format), self.train_y[idx]

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, self.n_test, batch_size):
            yield self.test[i:i + batch_size], self.test_y[i:i + batch_size]
