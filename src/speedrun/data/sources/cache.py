"""Decoding an image folder once, to a memory-mapped uint8 cache, and training it from memory.

A folder of photos streamed from disk is decoded again every epoch, by worker processes that
take their cores from training; on two cores that is a large share of the run. Decoded once at
the evaluation size (shorter side resized, centre square; the same as ``speedrun data
prepare``), the set trains through the device-resident path: random-resized crops are cut on
whole batches on the device, straight at the epoch's training size.

The cache is a ``.npz`` named by a digest of what it was made from (every file's name, size and
modification time, the size, channels, decoder and skip setting), so a changed folder is
decoded again and an unchanged one is never decoded twice. It is written atomically
(``prepare`` writes to a temporary name and renames); a cache folder that cannot take it (full,
read-only) stops the run in one line before any decoding, and leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from ...errors import DataError, RunFolderError
from ...files import atomic_write_json, cache_root, check_output_folder, disk_error
from .arrays import load_npz
from .builtin import ArrayDataset
from ..pipeline.resident import resize
from .skipped import LISTED
from .folder import ImageList

CACHE_VERSION = 1
MEMORY_SHARE = 0.5
"""auto: the cache is used when it takes at most this share of the machine's memory."""


DECODED_INSTEAD = ("set data.cache_dir or $SPEEDRUN_CACHE to a folder on another disk, or data.cache=off to "
                   "read the images from their folder every epoch")
"""What a user can do when the decoded-image cache cannot be written where it is."""


def check_cache_folder(folder: Path, what: str, need_bytes: int, instead: str) -> None:
    """Raise :class:`RunFolderError` unless ``what`` (a cache) can be written in ``folder`` with
    ``need_bytes`` free; the message adds how to put it elsewhere or do without (``instead``).
    Leaves nothing on disk."""
    try:
        check_output_folder(folder, what, need_bytes)
    except RunFolderError as err:
        raise RunFolderError(f"{err} ({instead})") from None


def cache_bytes(n_images: int, channels: int, size: int) -> int:
    return n_images * channels * size * size


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):          # pragma: no cover - non-POSIX
        return 0


def use_cache(setting: str, crop: str, eval_crop: float, n_images: int, channels: int, size: int,
              memory: int | None = None) -> tuple[bool, str]:
    """(whether to decode the folder once, why): ``on``/``off`` as set; ``auto`` for
    random-resized-crop recipes evaluated on whole centre squares (``eval_crop`` 1: the
    cache holds centre squares) whose cache takes at most half the memory."""
    need = cache_bytes(n_images, channels, size)
    if setting == "on":
        crops = (f"; evaluated on whole centre squares: data.eval_crop={eval_crop:g} does not apply to a cache"
                 if eval_crop != 1.0 else "")
        return True, f"decoded once at {size} px (data.cache=on{crops})"
    if setting == "off":
        return False, "streamed (data.cache=off)"
    if crop != "random_resized":
        return False, "streamed (translate crops are cut while decoding)"
    if eval_crop != 1.0:
        return False, f"streamed (data.eval_crop={eval_crop:g}: the cache holds whole centre squares)"
    memory = memory_bytes() if memory is None else memory
    if memory and need > MEMORY_SHARE * memory:
        return False, (f"streamed: decoded at {size} px it would take {need / 2**30:.1f} GiB, over half of "
                       f"the {memory / 2**30:.1f} GiB of memory")
    return True, f"decoded once at {size} px ({need / 2**30:.2f} GiB, memory-mapped)"


def cache_key(train: ImageList, val: ImageList, size: int, channels: int, decoder: str, skip_corrupt: bool) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION}|{size}|{channels}|{decoder}|{skip_corrupt}".encode())
    for split, images in (("train", train), ("val", val)):
        h.update(f"|{split}|{images.root.resolve()}|{len(images)}".encode())
        for name, label in zip(images.files, images.labels.tolist()):
            try:
                st = (images.root / name).stat()
            except OSError:
                stamp = "missing"
            else:
                stamp = f"{st.st_size}:{st.st_mtime_ns}"
            h.update(f"|{name}|{label}|{stamp}".encode())
    return h.hexdigest()[:20]


FINGERPRINT_BYTES = 1 << 20
"""Bytes at each end of a cache file whose digest is kept beside it: its arrays' headers at the
start and the end of its last array (a file overwritten there, or cut short, no longer matches)."""


def fingerprint(path: Path) -> dict:
    """The size of a decoded cache file and a SHA-256 of its first and last MiB."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        h.update(f.read(FINGERPRINT_BYTES))
    return {"bytes": size, "sha256_ends": h.hexdigest()}


def damaged(path: Path, expected: dict | None) -> str:
    """Why the cache file at ``path`` is not the one that was written ('' where it is, or where
    it was written without a fingerprint, by an earlier speedrun)."""
    if not isinstance(expected, dict) or "bytes" not in expected:
        return ""
    try:
        found = fingerprint(path)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if found["bytes"] != expected["bytes"]:
        return f"holds {found['bytes']:,} bytes where {expected['bytes']:,} were written (cut short or overwritten)"
    if found["sha256_ends"] != expected.get("sha256_ends"):
        return "differs from what was written (its checksum does not match)"
    return ""


def shrink(images: torch.Tensor, size: int, chunk: int = 256) -> torch.Tensor:
    """uint8 images (N, C, H, W) resized to ``size`` x ``size`` (the resident path's
    antialiased bilinear :func:`~speedrun.data.pipeline.resident.resize`, rounded to uint8), a chunk at
    a time so that no float copy of the whole set is made."""
    out = torch.empty(images.shape[0], images.shape[1], size, size, dtype=torch.uint8)
    for i in range(0, images.shape[0], chunk):
        out[i:i + chunk] = resize(images[i:i + chunk].float(), size).round_().clamp_(0, 255).to(torch.uint8)
    return out


def open_cached(train: ImageList, val: ImageList, channels: int, size: int, data, train_size: int,
                say=print, eval_size: int | None = None) -> tuple[ArrayDataset, dict]:
    """The folder decoded at ``size`` (made now if it is not cached), as an array dataset
    trained at ``train_size`` and evaluated at ``eval_size`` (the evaluation images are
    resized to it here where the cache is larger); and a description for the run's record."""
    from ..prepare import prepare
    root = cache_root(data.cache_dir)
    key = cache_key(train, val, size, channels, data.decoder, data.skip_corrupt)
    path = root / f"folder-{key}.npz"
    info_path = path.with_suffix(".json")
    made, seconds = False, 0.0

    def decode(why: str = "") -> dict:
        # the decoded arrays, written twice (prepare's scratch copy and the .npz), and the record beside them
        check_cache_folder(root, "the decoded-image cache", 2 * cache_bytes(len(train) + len(val), channels, size)
                           + (1 << 20), DECODED_INSTEAD)
        say(f"decoding {len(train) + len(val):,} images once at {size} px into {path}{why}")
        t0 = time.perf_counter()
        try:
            result = prepare(data.path, size, path, val_fraction=data.val_fraction, seed=data.split_seed,
                             workers=data.workers, skip_corrupt=data.skip_corrupt, decoder=data.decoder)
        except RunFolderError as err:                 # (the disk filled while decoding: nothing was kept)
            raise RunFolderError(f"the decoded-image cache: {err} ({DECODED_INSTEAD})") from None
        took = time.perf_counter() - t0
        say(f"decoded {result['train'] + result['test']:,} images in {took:.1f} s "
            f"({(len(train) + len(val)) / max(took, 1e-9):,.0f} images/s)"
            + (f", {result['skipped']:,} unreadable skipped" if result["skipped"] else ""))
        info = {"skipped": result["skipped"], "skipped_files": dict(list(result["skipped_files"].items())[:LISTED]),
                "decode_seconds": took, "images_per_s": (len(train) + len(val)) / took if took else None,
                "source": str(train.root.parent if train.root.name == "train" else train.root),
                "npz": fingerprint(path)}
        try:                                          # (a temporary name of its own: ranks may make it at once)
            atomic_write_json(info_path, info)
        except RunFolderError as err:                 # a cache without its record is not kept
            path.unlink(missing_ok=True)
            raise RunFolderError(f"the decoded-image cache: {err} ({DECODED_INSTEAD})") from None
        return info

    if not path.is_file():
        info, made = decode(), True
    else:
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            info = {"skipped": 0}
        damage = damaged(path, info.get("npz"))
        if damage:                                    # (speedrun's own file in its cache folder: made again)
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                raise RunFolderError(f"the decoded-image cache: {disk_error(path, err, 'replace the damaged')} "
                                     f"({DECODED_INSTEAD})") from None
            info, made = decode(f" again: the cached copy {damage}"), True
    seconds = info.get("decode_seconds", 0.0) if made else 0.0
    ds = load_npz(path)
    if ds.classes != train.classes:
        raise DataError(f"{path}: a decoded cache whose classes differ from the folder's; delete it and run "
                        "again")
    ds.train_size = train_size if train_size and train_size < size else 0
    if eval_size and eval_size < size:
        ds.test_x = shrink(ds.test_x, eval_size)
    ds.name, ds.source = "folder", str(train.root)
    named = info.get("skipped_files")
    ds.skipped_files = named if isinstance(named, dict) else {}      # (a cache made by an older speedrun: none)
    description = {"cache": str(path), "cache_made_now": made, "cache_size": size, "eval_size": ds.eval_size[0],
                   "decode_seconds": round(seconds, 2) if made else None,
                   "decode_images_per_s": info.get("images_per_s"), "skipped_images": info.get("skipped", 0)}
    return ds, description
