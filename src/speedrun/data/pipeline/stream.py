"""The streamed input pipeline, for image folders too large to keep on the device.

Worker processes (a torch DataLoader: persistent, pinned memory) read and decode files,
cutting the training crop in the decoder where it can (DCT down-scaling of JPEGs), and
hand over uint8 batches. Everything else happens once per batch on the device: moving
the uint8 batch (a quarter of the bytes of float32), normalising, flips, translation,
colour jitter and lighting noise.

Every random choice is a function of (seed, epoch, image index), so the data order and
the crops do not depend on which worker handled which image, and a resumed run sees
exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import functools
import math
import multiprocessing as mp
import multiprocessing.forkserver
import os
import random
import re
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from ...errors import DataError
from ...stop_signals import ignored_by_children, worker_of
from ..augment.batch import reflect_pad
from ..augment.resized_crop import RRC_TRIES, centre_fallback
from ..sources.folder import ImageList, decode, read_bytes
from .shard import Shard
from ..sources.skipped import Skipped, reason_of


def default_workers(requested: int) -> int:
    return min(8, os.cpu_count() or 1) if requested < 0 else requested


def worker_context():
    """Where worker processes come from: a fork server (a fresh, single-threaded interpreter
    started by fork and exec, with this module and so torch, numpy and Pillow imported once)
    forks each of them. Forking this process itself could copy a lock held by one of its
    threads (gloo's when training is split over processes, the pin-memory thread's, a progress
    bar's) into a child that then waits on it forever: a data-parallel run over an image folder
    hung so once in CI. What the workers receive is pickled; a script that starts them must
    keep its own work under ``if __name__ == "__main__":`` (each worker imports the script).
    The server and multiprocessing's resource tracker are started here with the stop signals
    ignored and blocked from their first instruction, and the workers the server forks inherit
    the block (:func:`~speedrun.stop_signals.ignored_by_children`): a SIGTERM reaches none of
    them, not even in the moment after a worker's start when torch's DataLoader installs its
    own SIGTERM handler."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])     # only read when the server starts
    # the tracker first, on its own: starting it unblocks SIGINT and SIGTERM in this process, which
    # the server would then inherit unblocked (each is a no-op once its process runs)
    with ignored_by_children():
        resource_tracker.ensure_running()
    with ignored_by_children():
        mp.forkserver.ensure_running()
    return ctx


def start_worker_server(wait: bool = False) -> None:
    """Start the fork server (its imports take about a second) so that they overlap what this
    process does next; ``wait``: return only once it serves, by forking a child that does
    nothing (so that a run's clock, started later, does not count the server's start)."""
    ctx = worker_context()
    if wait:
        child = ctx.Process(target=int, daemon=True)
        child.start()
        child.join()


def _hwc(img: np.ndarray) -> torch.Tensor:
    img = img if img.ndim == 3 else img[:, :, None]
    return torch.from_numpy(img if img.flags.writeable and img.flags.c_contiguous else img.copy())


def _resize_box(img: np.ndarray, size: int, box) -> np.ndarray:
    """Crop ``box`` (left, top, right, bottom; fractional) and resize it to size x size."""
    pil = Image.fromarray(img[:, :, 0] if img.shape[2] == 1 else img)
    return np.asarray(pil.resize((size, size), Image.BILINEAR, box=box))


def rrc_box(h: int, w: int, scale, ratio, rng: random.Random) -> tuple[int, int, int, int]:
    """One random-resized-crop box (top, left, height, width) drawn on the host, with the same
    rule as ``resized_crop.sample_rrc_boxes`` (which draws whole batches on the device);
    plain Python, since numpy's per-call overhead dominates for one box."""
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(RRC_TRIES):
        area = rng.uniform(*scale) * h * w
        aspect = math.exp(rng.uniform(lo, hi))
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 1 <= cw <= w and 1 <= ch <= h:
            return rng.randrange(h - ch + 1), rng.randrange(w - cw + 1), ch, cw
    ch, cw = centre_fallback(h, w, ratio)
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def item_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The random stream of one image in one epoch, independent of which worker draws it."""
    return random.Random((seed * 1_000_003 + epoch) * 4_294_967_311 + index)


@dataclass(frozen=True)
class Decoding:
    """How one image becomes a uint8 crop: for training a random-resized box (``crop =
    "random_resized"``, from ``rrc_scale`` and ``rrc_ratio``) or the whole image resized; for
    evaluation the centre ``eval_crop`` of the image. Unreadable files are skipped or named."""
    channels: int
    train: bool
    crop: str = "translate"
    rrc_scale: tuple[float, float] = (1.0, 1.0)
    rrc_ratio: tuple[float, float] = (1.0, 1.0)
    eval_crop: float = 1.0
    decoder: str = "auto"
    skip_corrupt: bool = False
    seed: int = 0

    @classmethod
    def for_training(cls, channels: int, data, augment, seed: int) -> "Decoding":
        return cls(channels, True, augment.crop, tuple(augment.rrc_scale), tuple(augment.rrc_ratio), 1.0,
                   data.decoder, data.skip_corrupt, seed)

    @classmethod
    def for_evaluation(cls, channels: int, data, crop: float | None = None, skip_corrupt: bool | None = None) -> "Decoding":
        return cls(channels, False, eval_crop=data.eval_crop if crop is None else crop, decoder=data.decoder,
                   skip_corrupt=data.skip_corrupt if skip_corrupt is None else skip_corrupt)


class ImageItems(Dataset):
    """Items are keyed by (index, size, epoch): the sampler tells each worker the size of
    this epoch's crops (for progressive resizing) and the epoch (for the random stream).
    An item is (uint8 HWC tensor, label, index)."""

    def __init__(self, images: ImageList, decoding: Decoding):
        self.images, self.d = images, decoding

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key):
        i, size, epoch = key
        d, path = self.d, self.images.path(i)
        try:
            data = read_bytes(path)
            if d.train and d.crop == "random_resized":
                x = self._random_resized(data, path, size, item_rng(d.seed, epoch, i))
            else:
                x = self._resize_centre(data, path, size, 1.0 if d.train else d.eval_crop)
        except DataError as err:
            # reported from the main process (a worker's exception arrives wrapped in its traceback)
            return Skipped(str(path), reason_of(str(err), path)) if d.skip_corrupt else Unreadable(str(err))
        return _hwc(x), int(self.images.labels[i]), i

    def _random_resized(self, data: bytes, path, size: int, rng: random.Random) -> np.ndarray:
        box = []

        def need(hw):                                   # draw the box, then let the decoder shrink
            h, w = hw
            box[:] = [hw, rrc_box(h, w, self.d.rrc_scale, self.d.rrc_ratio, rng)]
            factor = min(box[1][2], box[1][3]) / size
            return (math.ceil(h / factor), math.ceil(w / factor)) if factor > 1 else (h, w)
        img = decode(data, path, self.d.channels, need, self.d.decoder)
        (h, w), (top, left, ch, cw) = box
        sy, sx = img.shape[0] / h, img.shape[1] / w
        return _resize_box(img, size, (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy))

    def _resize_centre(self, data: bytes, path, size: int, crop: float) -> np.ndarray:
        short = size / crop                             # shorter side before the centre crop

        def need(hw):
            factor = min(hw) / short
            return (math.ceil(hw[0] / factor), math.ceil(hw[1] / factor)) if factor > 1 else hw
        img = decode(data, path, self.d.channels, need, self.d.decoder)
        h2, w2 = img.shape[:2]
        if h2 == w2 == size and crop == 1.0:            # already the right size: no resampling
            return img
        side = min(h2, w2) * crop
        top, left = (h2 - side) / 2, (w2 - side) / 2
        return _resize_box(img, size, (left, top, left + side, top + side))


class Unreadable(str):
    """The error message of an image a worker could not decode."""


def collate(items):
    """(uint8 images, labels, indices, [Skipped]) of a batch; (the error, None, None, []) when
    an image could not be read and is not to be skipped."""
    failed = next((it for it in items if isinstance(it, Unreadable)), None)
    if failed is not None:
        return failed, None, None, []
    skipped = [it for it in items if isinstance(it, Skipped)]
    kept = [it for it in items if not isinstance(it, Skipped)]
    if not kept:
        return None, None, None, skipped
    x = torch.stack([it[0] for it in kept]).permute(0, 3, 1, 2)     # N, C, H, W in channels-last memory
    y = torch.tensor([it[1] for it in kept], dtype=torch.int64)
    idx = torch.tensor([it[2] for it in kept], dtype=torch.int64)
    return x, y, idx, skipped


class EpochSampler(Sampler):
    """Batches of (index, size, epoch): a seeded permutation per epoch for training (last
    partial batch dropped), the natural order for evaluation; ``skip`` leaves out batches
    already trained on before a resume. With a ``shard`` each batch is this rank's share of the
    global batch (training) or of the evaluation set's batch, so the ranks
    together see exactly what one process would."""

    def __init__(self, n: int, batch_size: int, seed: int, train: bool, size: int, shard: Shard = Shard()):
        self.n, self.batch_size, self.seed, self.train, self.shard = n, batch_size, seed, train, shard
        self.epoch, self.size, self.skip = 0, size, 0

    def set_epoch(self, epoch: int, size: int, skip: int = 0) -> None:
        self.epoch, self.size, self.skip = epoch, size, skip

    def __len__(self) -> int:
        return self.n // self.batch_size if self.train else math.ceil(self.n / self.batch_size)

    def __iter__(self):
        order = np.random.default_rng((self.seed, self.epoch)).permutation(self.n) if self.train else np.arange(self.n)
        for b in range(self.skip, len(self)):
            batch = order[b * self.batch_size:(b + 1) * self.batch_size]
            mine = self.shard.train_positions(len(batch)) if self.train else self.shard.eval_slice(len(batch))
            yield [(int(i), self.size, self.epoch) for i in batch[mine]]


def sample_stats(images: ImageList, channels: int, size: int, decoder: str, n: int = 1000,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std (0..255 units) of centre crops of up to ``n`` training images."""
    items = ImageItems(images, Decoding(channels, False, decoder=decoder, skip_corrupt=True, seed=seed))
    idx = np.random.default_rng(seed).choice(len(images), size=min(n, len(images)), replace=False)
    xs = [items[(int(i), size, 0)] for i in idx]
    x = torch.stack([it[0] for it in xs if not isinstance(it, (Unreadable, Skipped))])
    x = x.permute(0, 3, 1, 2).float()
    return x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3))


def batches_of(loader: DataLoader, folder) -> Iterator:
    """The loader's batches; a worker process that dies (the system's out-of-memory killer, a
    ``kill``) ends them with a :class:`DataError` naming the worker and the folder."""
    try:
        yield from loader
    except (RuntimeError, ConnectionResetError, EOFError) as err:   # (the dead worker's pipe, read first)
        if isinstance(err, RuntimeError) and "DataLoader worker" not in str(err):
            raise
        why = (str(err).splitlines() or [f"{type(err).__name__}: its pipe closed"])[0]   # (an EOFError says nothing)
        signalled = re.search(r"killed by signal: (.+?)\.?$", why)
        if signalled and signalled.group(1) != "Killed":           # (SIGKILL: the out-of-memory killer's)
            advice = f"another process sent it {signalled.group(1)}; find what signals speedrun's processes"
        else:
            advice = "the system may have run out of memory: lower data.workers or free memory"
        raise DataError(f"a data loader worker reading {folder} ended unexpectedly ({why}); {advice}") from None


class StreamedData:
    """Train and validation loaders for a folder dataset, yielding normalised device batches
    (this rank's share of each batch when training is split over processes)."""

    crops_in_workers = True               # random-resized crops are cut while decoding

    def __init__(self, source, recipe, runtime, seed: int, shard: Shard = Shard()):
        """``source``: a FolderSource (the folder split, measured); ``shard``: this process's share."""
        cfg, aug = recipe.data, recipe.augment
        self.device, self.dtype, self.memory_format = runtime.device, runtime.dtype, runtime.memory_format
        self.image_size = (source.size, source.size)
        self.n_train, self.n_test = len(source.train), len(source.val)
        self.translate = aug.translate if aug.crop == "translate" else 0
        self.mean = source.mean.reshape(-1).to(self.device)          # (C,), 0..255 units
        self.std = source.std.reshape(-1).to(self.device)
        self.skipped_files: dict[str, str] = {}     # unreadable images skipped (data.skip_corrupt): path -> why
        workers = default_workers(cfg.workers)
        self.common = dict(num_workers=workers, pin_memory=runtime.device.type == "cuda", collate_fn=collate,
                           persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
                           multiprocessing_context=worker_context() if workers else None,
                           worker_init_fn=functools.partial(worker_of, os.getpid()))
        self.train_items = ImageItems(source.train, Decoding.for_training(source.channels, cfg, aug, seed))
        self.val_items = ImageItems(source.val, Decoding.for_evaluation(source.channels, cfg))
        self.train_sampler = EpochSampler(len(source.train), cfg.batch_size, seed, True, source.size, shard)
        self.val_sampler = EpochSampler(len(source.val), recipe.eval.batch_size, seed, False,
                                        getattr(source, "eval_size", source.image_size)[0], shard)
        self.train_loader = DataLoader(self.train_items, batch_sampler=self.train_sampler, **self.common)
        self.val_loader = DataLoader(self.val_items, batch_sampler=self.val_sampler, **self.common)
        self.holdout_loader = None                      # train.stop_at_target's validation split
        if getattr(source, "holdout", None) is not None:
            items = ImageItems(source.holdout, self.val_items.d)     # decoded as the test images are
            sampler = EpochSampler(len(source.holdout), recipe.eval.batch_size, seed, False,
                                   self.val_sampler.size, shard)
            self.holdout_loader = DataLoader(items, batch_sampler=sampler, **self.common)

    @property
    def skipped(self) -> int:
        """Images skipped as unreadable so far, each counted once however often it was met."""
        return len(self.skipped_files)

    def _note(self, skipped: list[Skipped]) -> None:
        for s in skipped:
            self.skipped_files.setdefault(s.path, s.reason)

    def _to_device(self, x_u8: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        x = x_u8.to(self.device, non_blocking=True).float()
        if x.shape[1] == 1:
            # one channel: the batch's channels-last strides and a fresh tensor's both count as
            # contiguous in either layout, so no later .contiguous() unifies them, and compiled
            # code specialised on the warm-up's would compile again for these
            x = x.clone(memory_format=torch.contiguous_format)
        return ((x - self.mean[:, None, None]) / self.std[:, None, None]).to(dtype or self.dtype)

    def epoch(self, epoch: int, batch_size: int, augment, generator, size: int | None = None,
              skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if batch_size != self.train_sampler.batch_size:
            raise ValueError("the streamed loader was built for another batch size")
        self.train_sampler.set_epoch(epoch, size or self.image_size[0], skip)
        draws = augment.draw(epoch)
        for x_u8, y, idx, skipped in self._decoded(self.train_loader):
            self._note(skipped)
            if x_u8 is None:
                continue
            if isinstance(x_u8, Unreadable):
                raise DataError(str(x_u8))
            x = reflect_pad(self._to_device(x_u8), self.translate)
            x = augment(x, idx.to(self.device, non_blocking=True), draws)
            yield x.contiguous(memory_format=self.memory_format), y.to(self.device, non_blocking=True)

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y, _ in self.indexed_test_batches(batch_size):
            yield x, y

    def holdout_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The validation split held out of the training images (train.stop_at_target), decoded
        and batched as the test images are; the test images are not read."""
        for x, y, _ in self._evaluation_batches(self.holdout_loader):
            yield x, y

    def indexed_test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """test_batches with the validation-list index of each image (unreadable images skipped
        with data.skip_corrupt leave gaps)."""
        return self._evaluation_batches(self.val_loader)

    def _decoded(self, loader: DataLoader) -> Iterator:
        """(uint8 images, labels, indices, [Skipped]) of each of ``loader``'s batches, decoded by
        its worker processes."""
        return batches_of(loader, loader.dataset.images.root)

    def _evaluation_batches(self, loader: DataLoader):
        for x_u8, y, idx, skipped in self._decoded(loader):
            self._note(skipped)
            if isinstance(x_u8, Unreadable):
                raise DataError(str(x_u8))
            if x_u8 is not None:
                yield (self._to_device(x_u8).contiguous(memory_format=self.memory_format),
                       y.to(self.device, non_blocking=True), idx)

    def whitening_sample(self, n: int) -> torch.Tensor:
        """Centre crops of the first ``n`` training images, normalised (float32); the same
        images on every rank."""
        d = self.train_items.d
        items = ImageItems(self.train_items.images, Decoding(d.channels, False, decoder=d.decoder,
                                                             skip_corrupt=d.skip_corrupt))
        sampler = EpochSampler(min(n, self.n_train), self.val_sampler.batch_size, 0, False, self.image_size[0])
        loader = DataLoader(items, batch_sampler=sampler, num_workers=self.train_loader.num_workers,
                            collate_fn=collate, multiprocessing_context=self.common["multiprocessing_context"],
                            worker_init_fn=functools.partial(worker_of, os.getpid()))
        batches = []
        for x, _, _, skipped in loader:
            self._note(skipped)
            if isinstance(x, Unreadable):
                raise DataError(str(x))
            if x is not None:
                batches.append(self._to_device(x, torch.float32))
        return torch.cat(batches)
