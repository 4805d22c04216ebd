"""``speedrun data prepare SRC --out STORE --reduce``: a reduced store of an image folder.

The folder again, in the same layout (``train/<class>/``, ``val/<class>/``, one
``<class>/`` folder, Tiny-ImageNet's ``val/images`` with ``val_annotations.txt``), each image
re-encoded as a JPEG whose longer side is at most ``max_side`` pixels (FFCV's trick): training
reads it as it reads any folder, while its workers decode several times fewer pixels. Images
already small enough are copied byte for byte when they are JPEGs. The store is built in a
hidden sibling folder and renamed into place; its manifest (``speedrun-store.json``) is
written last, so a store without one is known to be incomplete.
"""
from __future__ import annotations

import io
import os
from contextlib import ExitStack
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ..errors import DataError, RunFolderError, UsageError
from ..files import _UMASK, atomic_write_json, check_output_folder
from .pipeline.stream import default_workers
from .prepare import _staged, progress_bar, worker_pool
from .sources.folder import (JPEG_EXTENSIONS, MAX_PIXELS, ImageList, _open, _pixels, _too_large, annotated,
                             corrupt_error, scan)
from .sources.skipped import Skipped, listed, reason_of

MANIFEST = "speedrun-store.json"
FORMAT = "speedrun reduced store"
MAX_SIDE_RANGE = (16, 4096)
GREY_MODES = {"L", "LA", "1", "I;16", "I;16B", "I;16L", "I;16N", "I"}
"""Modes the folder reader counts as grey (:func:`.folder.probe`): kept grey in the store."""


def check_options(max_side: int, quality: int) -> None:
    lo, hi = MAX_SIDE_RANGE
    if not lo <= max_side <= hi:
        raise UsageError(f"--max-side {max_side}: give the longest side the stored images may have, in pixels, "
                         f"{lo} to {hi} (e.g. 320)")
    if not 1 <= quality <= 100:
        raise UsageError(f"--quality {quality}: JPEG quality goes from 1 to 100 (e.g. 90)")


def layout(src: Path) -> dict[str, ImageList]:
    """The splits of an image folder as the folder reader finds them, keyed by their folder
    relative to ``src`` ("train", "val", or "." for one folder of classes split at training)."""
    if (src / "train").is_dir():
        splits = {"train": scan(src / "train")}
        classes = splits["train"].classes
        if (src / "val" / "val_annotations.txt").is_file():
            splits["val"] = annotated(src / "val", classes)
        else:
            val = next((n for n in ("val", "validation", "test") if (src / n).is_dir()), None)
            if val is not None:
                splits[val] = scan(src / val, classes)
        return splits
    return {".": scan(src)}


def _stored_name(rel: str, taken: set[str]) -> str:
    """The store's name for the source file ``rel``: the same for a JPEG, else ``.jpg`` in place
    of the suffix (``.png.jpg`` after it where that name is another source file's)."""
    p = Path(rel)
    if p.suffix.lower() in JPEG_EXTENSIONS:
        return rel
    name = str(p.with_suffix(".jpg"))
    return name if name not in taken else rel + ".jpg"


def _jobs(src: Path, staging: Path, splits: dict[str, ImageList], max_side: int, quality: int):
    """(source path, stored path, max side, quality, split, class) per image, and the stored
    names of renamed files per split (for Tiny-ImageNet's annotations)."""
    jobs, renamed = [], {}
    for split, images in splits.items():
        taken = set(images.files)
        for rel, label in zip(images.files, images.labels):
            out = _stored_name(rel, taken)
            if out != rel:
                renamed.setdefault(split, {})[Path(rel).name] = Path(out).name
            jobs.append((str(images.root / rel), str(staging / split / out), max_side, quality, split,
                         images.classes[int(label)]))
    return jobs, renamed


def reduce_image(job) -> tuple[str, str, str | Skipped | None]:
    """Write one image of the store: (split, class, what was done: "copied", "resized" or
    "re-encoded"; or the error message of an unreadable file, or its :class:`Skipped` under
    ``skip_corrupt``). Runs in a pool worker."""
    src, out, max_side, quality, split, cls, skip_corrupt = job
    path = Path(src)
    try:
        done = _reduce(path, Path(out), max_side, quality)
    except DataError as err:
        return split, cls, Skipped(src, reason_of(str(err), path)) if skip_corrupt else str(err)
    return split, cls, done


def _reduce(path: Path, out: Path, max_side: int, quality: int) -> str:
    try:
        data = path.read_bytes()
        with _open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > MAX_PIXELS:
                raise _too_large(path, h, w)
            scale = max_side / max(w, h)
            grey = im.mode in GREY_MODES
            copy = scale >= 1 and im.format == "JPEG"
            size = (max(1, round(w * scale)), max(1, round(h * scale))) if scale < 1 else (w, h)
            if copy:
                im.load()                           # the whole file decodes: what training will read
            else:
                if scale < 1 and im.format == "JPEG":
                    im.draft("L" if grey else "RGB", size)      # DCT-domain down-scaling, never below size
                pixels = Image.fromarray(_pixels(im, 1 if grey else 3, path))
    except Image.DecompressionBombError:
        raise _too_large(path) from None
    except (OSError, ValueError, UnidentifiedImageError, SyntaxError, EOFError) as err:
        raise corrupt_error(path, err) from None
    out.parent.mkdir(parents=True, exist_ok=True)       # (a failed write is the disk's: named by _staged)
    if copy:
        out.write_bytes(data)
        return "copied"
    if pixels.size != size:
        pixels = pixels.resize(size, Image.LANCZOS, reducing_gap=3.0)
    pixels.save(out, format="JPEG", quality=quality)
    return "resized" if scale < 1 else "re-encoded"


def _need_bytes(jobs, max_side: int) -> int:
    """About what the store takes: each image at most its source file, and at most half its
    raw pixels at ``max_side`` (a JPEG at quality 90 takes far less)."""
    return sum(min(os.stat(j[0]).st_size, max_side * max_side * 3 // 2) for j in jobs) + (1 << 20)


def reduce_store(src: str | Path, out: str | Path, max_side: int, quality: int = 90, workers: int = -1,
                 skip_corrupt: bool = False) -> dict:
    """Write the reduced store of the image folder ``src`` to the new folder ``out``; returns
    the manifest. Refused before anything is written: bad options, an ``out`` that exists or
    lies inside ``src``, a ``src`` that is not an image folder."""
    check_options(max_side, quality)
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if os.path.lexists(out):
        raise RunFolderError(f"--out {out}: already exists; give a new folder for the store, so that nothing "
                             "of yours is overwritten")
    if Path(os.path.abspath(out)).is_relative_to(os.path.abspath(src)):
        raise RunFolderError(f"--out {out}: lies inside the source folder {src}, where it would be read as part "
                             "of it; give a folder outside it")
    if not src.is_dir():
        raise DataError(f"{src}: no such folder. Give an image folder: SRC/train/<class>/... with "
                        "SRC/val/<class>/..., or SRC/<class>/...")
    splits = layout(src)
    check_output_folder(out)
    with _staged(out) as staging:
        jobs, renamed = _jobs(src, staging, splits, max_side, quality)
        check_output_folder(out, need_bytes=_need_bytes(jobs, max_side))
        counts, done, skipped = _write_images(jobs, workers, skip_corrupt)
        _copy_annotations(src, staging, splits, renamed)
        manifest = {"format": FORMAT, "version": 1, "source": str(src.resolve()), "max_side": max_side,
                    "quality": quality, "splits": sorted(splits),
                    "images": sum(n for per_class in counts.values() for n in per_class.values()), "counts": counts, **done, "skipped": len(skipped),
                    **listed({s.path: s.reason for s in skipped}, len(skipped))}
        atomic_write_json(staging / MANIFEST, manifest)               # last: its presence says the store is whole
        os.chmod(staging, 0o777 & ~_UMASK)                            # (made private by mkdtemp)
        os.replace(staging, out)
    return manifest


def _write_images(jobs, workers: int, skip_corrupt: bool):
    """Run the jobs (in ``workers`` fork-server processes, or here with 0): (images per split
    and class, how many were copied/resized/re-encoded, the skipped)."""
    counts = {}
    for _, _, _, _, split, cls in jobs:
        counts.setdefault(split, {}).setdefault(cls, 0)
    done, skipped = {"copied": 0, "resized": 0, "re-encoded": 0}, []
    workers = default_workers(workers)
    args = [(*job, skip_corrupt) for job in jobs]
    with ExitStack() as stack:
        # the workers start before the progress bar's thread does (and from a fork server)
        pool = stack.enter_context(worker_pool(workers)) if workers > 0 else None
        bar = stack.enter_context(progress_bar())
        task = bar.add_task("writing the reduced store", total=len(args))
        results = pool.imap_unordered(reduce_image, args, chunksize=16) if pool else map(reduce_image, args)
        for split, cls, what in results:
            if isinstance(what, Skipped):
                skipped.append(what)
            elif what not in done:
                raise DataError(what)
            else:
                done[what] += 1
                counts[split][cls] += 1
            bar.advance(task)
    return counts, done, sorted(skipped)


def _copy_annotations(src: Path, staging: Path, splits: dict[str, ImageList], renamed: dict) -> None:
    """Tiny-ImageNet's val_annotations.txt, with the stored names of re-encoded files (and without
    the lines of skipped ones)."""
    if "val" not in splits or not (src / "val" / "val_annotations.txt").is_file():
        return
    names = renamed.get("val", {})
    lines = []
    for line in (src / "val" / "val_annotations.txt").read_text().splitlines():
        parts = line.split("\t")
        parts[0] = names.get(parts[0], parts[0])
        if len(parts) < 2 or (staging / "val" / "images" / parts[0]).is_file():    # (skipped files left out)
            lines.append("\t".join(parts))
    (staging / "val").mkdir(parents=True, exist_ok=True)
    (staging / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")

