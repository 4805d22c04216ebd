"""``speedrun data prepare`` and ``speedrun data export``.

prepare: decode an image folder once into a fixed-resolution uint8 ``.npz`` (members
stored uncompressed, so training memory-maps them), so that sets such as downsampled
ImageNet or Tiny-ImageNet train through the device-resident path.

export: write a built-in dataset as an image folder in the ImageNet layout, for trying
the folder pipeline on known data.
"""
from __future__ import annotations

import multiprocessing.context
import multiprocessing.pool
import os
import shutil
import sys
import tempfile
import zipfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image
from rich.progress import Progress

from ..errors import DataError, RunFolderError
from ..files import check_output_file, check_output_folder, disk_error, make_folder
from .sources.folder import ImageList, folder_splits, probe
from .sources.builtin import load_dataset
from .sources.skipped import Skipped
from ..stop_signals import worker_of
from .pipeline.stream import Decoding, ImageItems, Unreadable, default_workers, worker_context

DECODERS = ("auto", "pillow", "simplejpeg", "torchvision")

_items: ImageItems | None = None


def progress_bar() -> Progress:
    """A transient progress bar on a terminal; none where output goes to a file (a bar written
    to a file leaves only blank lines there)."""
    return Progress(transient=True, disable=not sys.stdout.isatty())


@contextmanager
def worker_pool(workers: int, initializer=None, initargs=()) -> Iterator[multiprocessing.pool.Pool]:
    """A pool of ``workers`` processes that are never forked from this one (see
    :func:`.stream.worker_context`), for a ``with`` block: closed and waited for when the block
    ends, ended (``Pool.terminate``, by SIGKILL: :class:`_PoolContext`) when it fails or is
    interrupted."""
    worker_context()                            # (the fork server, started as every worker needs it)
    pool = multiprocessing.pool.Pool(workers, initializer=_pool_worker, initargs=(os.getpid(), initializer, initargs),
                                     context=_PoolContext())
    try:
        yield pool
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()


class _KilledByTerminate(multiprocessing.context.ForkServerProcess):
    def terminate(self) -> None:
        self.kill()


class _PoolContext(multiprocessing.context.ForkServerContext):
    """The fork server's context, whose processes ``terminate`` ends with SIGKILL: a pool's workers
    ignore the stop signals from their first instruction (as every process of the fork server
    does), and ``Pool.terminate`` ends the ones still waiting for work by terminating them, once
    it holds the task queue's lock (so none is killed holding it)."""
    Process = _KilledByTerminate


def _pool_worker(owner: int, initializer, initargs) -> None:
    worker_of(owner)
    if initializer is not None:
        initializer(*initargs)


def _init_worker(items: ImageItems) -> None:
    global _items
    _items = items


def _decode_one(args):
    i, size = args
    out = _items[(i, size, 0)]
    if isinstance(out, Unreadable):
        raise DataError(str(out))
    return i, (out if isinstance(out, Skipped) else out[0].numpy().transpose(2, 0, 1))


def _decode_split(images: ImageList, channels: int, size: int, workers: int, skip_corrupt: bool,
                  scratch: Path, label: str, decoder: str = "auto",
                  device: torch.device | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """Decode a split into a scratch memmap; returns (images, kept mask, {skipped file: why})."""
    arr = np.lib.format.open_memmap(scratch / f"{label}.npy", mode="w+", dtype=np.uint8,
                                    shape=(len(images), channels, size, size))
    kept = np.ones(len(images), dtype=bool)
    skipped: dict[int, Skipped] = {}          # list index -> why it was left out
    if decoder == "torchvision":
        _decode_on_device(images, channels, size, skip_corrupt, label, device or torch.device("cpu"), arr, kept)
        arr.flush()
        return arr, kept, {str(images.path(int(i))): "cannot decode this image" for i in np.flatnonzero(~kept)}
    items = ImageItems(images, Decoding(channels, False, decoder=decoder, skip_corrupt=skip_corrupt))
    jobs = [(i, size) for i in range(len(images))]
    with ExitStack() as stack:
        # the workers start before the progress bar's thread does (and from a fork server)
        pool = stack.enter_context(worker_pool(workers, _init_worker, (items,))) if workers > 0 else None
        bar = stack.enter_context(progress_bar())
        task = bar.add_task(f"decoding {label}", total=len(jobs))
        if pool is not None:
            for i, x in pool.imap_unordered(_decode_one, jobs, chunksize=64):
                _store(arr, kept, skipped, i, x)
                bar.advance(task)
        else:
            _init_worker(items)
            for job in jobs:
                _store(arr, kept, skipped, *_decode_one(job))
                bar.advance(task)
    arr.flush()
    return arr, kept, {s.path: s.reason for _, s in sorted(skipped.items())}


def _decode_on_device(images: ImageList, channels: int, size: int, skip_corrupt: bool, label: str,
                      device: torch.device, arr: np.ndarray, kept: np.ndarray) -> None:
    """The torchvision decoder: lists of files decoded and resized on ``device``, the next list
    read while one decodes (:class:`.device_decode.SquareDecoder`)."""
    from .sources.device_decode import SquareDecoder
    decoder = SquareDecoder(size, channels, device, skip_corrupt)
    with progress_bar() as bar:
        task = bar.add_task(f"decoding {label} on {device.type}", total=len(images))
        for start, x, ok in decoder.stream([images.path(i) for i in range(len(images))]):
            arr[start:start + len(x)] = x.numpy()
            kept[start:start + len(x)] = ok.numpy()
            bar.advance(task, len(x))


def _store(arr, kept, skipped, i, x) -> None:
    if isinstance(x, Skipped):
        kept[i] = False
        skipped[i] = x
    else:
        arr[i] = x


MEMBER_SLICE = 64 << 20
"""Bytes of rows handed to the zip file at a time."""


def _write_member(zf: zipfile.ZipFile, name: str, arr: np.ndarray, rows: np.ndarray | None = None) -> None:
    """Write one .npy member uncompressed, streaming rows so nothing is held whole in memory:
    the kept rows (``rows``: a mask, default all) in runs of consecutive rows, each run in
    slices of at most 64 MiB handed to the zip file as they lie in ``arr`` (a memory-mapped
    scratch file: read from the page cache, not gathered row by row)."""
    keep = np.ones(arr.shape[0], dtype=bool) if rows is None else np.asarray(rows, dtype=bool)
    shape = (int(keep.sum()), *arr.shape[1:])
    header = {"descr": np.lib.format.dtype_to_descr(arr.dtype), "fortran_order": False, "shape": shape}
    step = max(1, MEMBER_SLICE // max(1, arr[:1].nbytes))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(np.int8), [0]])))
    with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_2_0(f, header)
        for first, stop in zip(edges[::2].tolist(), edges[1::2].tolist()):
            for start in range(first, stop, step):
                f.write(np.ascontiguousarray(arr[start:min(stop, start + step)]).reshape(-1).view(np.uint8))


def prepare(src: str | Path, size: int, out: str | Path, val_fraction: float = 0.0, seed: int = 0,
            workers: int = -1, skip_corrupt: bool = False, decoder: str = "auto",
            device: str | torch.device | None = None) -> dict:
    """Decode the image folder ``src`` into ``out`` (.npz) at size x size. ``decoder``: as
    data.decoder; "torchvision" decodes in batches on ``device`` (default: CUDA when available,
    nvjpeg for JPEGs; else the CPU) instead of in ``workers`` processes."""
    out = Path(out)
    check_output_file(out)
    if size < 8:
        raise DataError(f"--size {size}: too small; give the side of the square images in pixels (>= 8)")
    if decoder not in DECODERS:
        raise DataError(f"--decoder {decoder!r}: use one of {', '.join(DECODERS)}")
    if decoder == "torchvision":
        from .sources.device_decode import torchvision_io
        torchvision_io()                            # refused before anything is written
        device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    train, val = folder_splits(src, val_fraction, seed)
    channels = probe(train)["channels"]
    workers = default_workers(workers)
    # the decoded arrays, written twice (a scratch copy and the .npz)
    check_output_file(out, need_bytes=2 * (len(train) + len(val)) * channels * size * size + (1 << 20))
    with _staged(out) as scratch:
        x_train, keep_train, skipped_train = _decode_split(train, channels, size, workers, skip_corrupt, scratch,
                                                           "train", decoder, device)
        x_val, keep_val, skipped_val = _decode_split(val, channels, size, workers, skip_corrupt, scratch, "val",
                                                     decoder, device)
        tmp = scratch / "out.npz"
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            _write_member(zf, "x_train", x_train, keep_train)
            _write_member(zf, "y_train", train.labels[keep_train])
            _write_member(zf, "x_test", x_val, keep_val)
            _write_member(zf, "y_test", val.labels[keep_val])
            _write_member(zf, "classes", np.asarray(train.classes))
        del x_train, x_val
        os.replace(tmp, out)
    return {"out": str(out), "train": int(keep_train.sum()), "test": int(keep_val.sum()),
            "skipped": int((~keep_train).sum() + (~keep_val).sum()), "classes": len(train.classes),
            "size": size, "channels": channels, "skipped_files": {**skipped_train, **skipped_val}}


@contextmanager
def _staged(out: Path):
    """A scratch folder beside ``out`` (its missing parents made) in which the block builds what
    it then moves onto ``out``: removed afterwards, with the parents made for it where ``out``
    was not written; a disk that fails is named in one line (:func:`disk_error`)."""
    created = _make_parent(out)
    try:
        scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    except OSError as err:
        raise disk_error(out, err) from None
    try:
        yield scratch
    except OSError as err:
        raise disk_error(out, err) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if created and not out.exists():
            _remove_empty(out.parent, created)


def _make_parent(out: Path) -> list[Path]:
    """Make ``out``'s parent folders; returns those it made (to remove them after a failure)."""
    made, p = [], out.parent
    while not p.exists():
        made.append(p)
        p = p.parent
    make_folder(out.parent)
    return made


def _remove_empty(parent: Path, made: list[Path]) -> None:
    for p in made:                                  # deepest first
        try:
            p.rmdir()
        except OSError:
            break


# ------------------------------------------------------------------------------------------
def _safe(name: str) -> str:
    return name.replace("/", "-").replace("\\", "-")


def _write_image(args) -> None:
    path, img, fmt, quality, size = args
    im = Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0))
    if size and im.size != (size, size):
        im = im.resize((size, size), Image.BICUBIC)
    if fmt == "jpeg":
        im.save(path, format="JPEG", quality=quality)
    else:
        im.save(path, format="PNG", compress_level=1)


LAYOUTS = ("imagenet", "tiny-imagenet")


def _export_jobs(staging: Path, ds, layout: str, ext: str, limit: int | None, side: int) -> tuple[list, list[str]]:
    """(one (path, image) per image to write, lines of Tiny-ImageNet's val_annotations.txt)."""
    jobs, annotations = [], []
    for split, x, y in (("train", ds.train_x, ds.train_y), ("val", ds.test_x, ds.test_y)):
        xs, ys = x.numpy(), y.numpy()
        n = min(len(ys), limit or len(ys))
        for i in range(n):
            cls = _safe(ds.classes[ys[i]])
            if layout == "imagenet":
                path = staging / split / cls / f"{i:05d}.{ext}"
            elif split == "train":                  # tiny-imagenet: train/<class>/images/<class>_N.ext
                path = staging / "train" / cls / "images" / f"{cls}_{i}.{ext}"
            else:                                   # val/images/val_N.ext, classes in val_annotations.txt
                path = staging / "val" / "images" / f"val_{i}.{ext}"
                annotations.append(f"val_{i}.{ext}\t{cls}\t0\t0\t{side - 1}\t{side - 1}")
            jobs.append((path, xs[i]))
    return jobs, annotations


def export(name: str, fmt: str, out: str | Path, data_dir=None, quality: int = 95, workers: int = -1,
           limit: int | None = None, size: int | None = None, layout: str = "imagenet") -> dict:
    """Write a built-in dataset as an image folder: DIR/train/<class>/NNNNN.ext and
    DIR/val/<class>/NNNNN.ext (``layout="imagenet"``), or Tiny-ImageNet's layout
    (train/<class>/images/, val/images/ with val_annotations.txt). ``limit``: only the first
    that many images of each split; ``size``: resized (bicubic) to size x size pixels."""
    if fmt not in ("png", "jpeg"):
        raise DataError(f"--format {fmt!r}: use png or jpeg")
    if layout not in LAYOUTS:
        raise DataError(f"--layout {layout!r}: use {' or '.join(LAYOUTS)}")
    if limit is not None and limit < 1:
        raise DataError(f"--limit {limit}: give the number of images per split to write (at least 1)")
    if not 1 <= quality <= 100:
        raise DataError(f"--quality {quality}: JPEG quality goes from 1 to 100")
    if size is not None and not 8 <= size <= 4096:
        raise DataError(f"--size {size}: give the side of the square images in pixels, 8 to 4096")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunFolderError(f"--out {out} exists and is not an empty folder; choose another --out")
    check_output_folder(out)
    ds = load_dataset(name, data_dir)
    ext = "png" if fmt == "png" else "jpg"
    n_images = min(len(ds.train_y), limit or len(ds.train_y)) + min(len(ds.test_y), limit or len(ds.test_y))
    pixels = (size * size * ds.in_channels) if size else ds.train_x[0].numel()
    check_output_folder(out, need_bytes=n_images * pixels * 2 + (1 << 20))
    with _staged(out) as staging:
        jobs, annotations = _export_jobs(staging, ds, layout, ext, limit, size or ds.image_size[0])
        for folder in sorted({path.parent for path, _ in jobs}):      # only folders with images
            folder.mkdir(parents=True, exist_ok=True)
        if annotations:
            (staging / "val" / "val_annotations.txt").write_text("\n".join(annotations) + "\n")
        # each job carries its own image (a few kB pickled), never the whole set
        with worker_pool(default_workers(workers) or 1) as pool, progress_bar() as bar:
            task = bar.add_task(f"writing {name} as {fmt}", total=len(jobs))
            args = ((path, img, fmt, quality, size) for path, img in jobs)
            for _ in pool.imap_unordered(_write_image, args, chunksize=256):
                bar.advance(task)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    n = lambda total: min(total, limit or total)
    return {"out": str(out), "train": n(len(ds.train_y)), "val": n(len(ds.test_y)), "classes": ds.classes,
            "format": fmt, "size": size or ds.image_size[0], "layout": layout}
