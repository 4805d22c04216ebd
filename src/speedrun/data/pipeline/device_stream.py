"""The streamed folder pipeline with its images decoded and cropped on the device
(``data.decoder = "torchvision"`` with ``data.cache = "off"``): nvJPEG on a CUDA GPU, torchvision's
libjpeg-turbo on the CPU, through the same calls.

Batches come from the same samplers as the worker-decoded pipeline (the same images in the same
order, the same share on each rank), and each image's crop from the same random stream: a
training image's random-resized box is drawn by ``rrc_box`` from ``item_rng(seed, epoch,
index)``, on the image's full size, as a worker draws it; evaluation takes the centre
``data.eval_crop`` of the image. What differs is where the work is done: host threads read the
next batch's files (and decode what nvJPEG's batched call does not take: other formats,
progressive JPEGs) while the device decodes this one in one call, and every crop of a batch is
resampled by one pair of batched matrix products with Pillow's antialiased bilinear filter
(``device_decode.crops_of``); the worker path lets libjpeg down-scale in the DCT domain first, so
crops taken from much larger photos differ from it by a few grey levels.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader

from ..sources.device_decode import crops_of, decode_reads, read_ahead, torchvision_io
from ..sources.skipped import Skipped, reason_of
from .shard import Shard
from .stream import ImageItems, StreamedData, item_rng, rrc_box


class DeviceStreamedData(StreamedData):
    """:class:`StreamedData` whose batches are decoded and cropped on the runtime's device."""

    def __init__(self, source, recipe, runtime, seed: int, shard: Shard = Shard()):
        self.tvio = torchvision_io()                        # (a DataError saying how to install it)
        super().__init__(source, recipe, runtime, seed, shard)
        self.mode = self.tvio.ImageReadMode.RGB if source.channels == 3 else self.tvio.ImageReadMode.GRAY

    def _decoded(self, loader: DataLoader) -> Iterator:
        """(uint8 crops on the device, labels, indices, [Skipped]) of each of ``loader``'s batches
        (its sampler's keys, its items' files and decoding), the next batch's files read while
        this one is decoded."""
        items, keys = loader.dataset, list(loader.batch_sampler)
        lists = [[items.images.path(i) for i, _, _ in batch] for batch in keys]
        for batch, paths, reads in zip(keys, lists, read_ahead(lists, items.d.channels)):
            yield self._crops(items, batch, paths, reads)

    def _crops(self, items: ImageItems, batch: list, paths: list, reads: list):
        d, skipped = items.d, []

        def unreadable(j: int, err) -> None:
            if not d.skip_corrupt:
                raise err
            skipped.append(Skipped(str(paths[j]), reason_of(str(err), paths[j])))

        images = decode_reads(self.tvio, paths, reads, self.mode, self.device, unreadable)
        kept = sorted(images)
        if not kept:
            return None, None, None, skipped
        boxes = [self._box(d, batch[j], *images[j].shape[1:]) for j in kept]
        x = crops_of([images[j] for j in kept], boxes, batch[0][1])
        index = torch.tensor([batch[j][0] for j in kept], dtype=torch.int64)
        y = torch.as_tensor(items.images.labels[index.numpy()], dtype=torch.int64)
        return x.contiguous(memory_format=torch.channels_last), y, index, skipped

    @staticmethod
    def _box(d, key, h: int, w: int) -> tuple[float, float, float, float]:
        """(top, left, height, width) of the crop of one image of h x w: as ImageItems cuts it."""
        i, _, epoch = key
        if d.train and d.crop == "random_resized":
            return rrc_box(h, w, d.rrc_scale, d.rrc_ratio, item_rng(d.seed, epoch, i))
        side = min(h, w) * (1.0 if d.train else d.eval_crop)
        return (h - side) / 2, (w - side) / 2, side, side
