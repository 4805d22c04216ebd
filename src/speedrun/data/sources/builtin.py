"""Built-in datasets: where to find them, how to verify them, how to load them.

Search order for a dataset's files: ``--data-dir``, ``$SPEEDRUN_DATA``, ``~/.cache/speedrun``
and, for Fashion-MNIST, ``/usr/share/datasets`` (Debian's package). Each place may hold
the dataset's folder (``cifar-10-batches-py/``), its official archive, or be that folder
itself. When none has it, the files are downloaded from the official location (or
``$SPEEDRUN_MIRROR``) into the first of those places. Every file is checked before use:
size, md5 against the official value, then counts, shapes and label ranges. Pickled
CIFAR files are unpickled only after their checksum has matched.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ...errors import DataError
from .download import download, md5sum, safe_extract


@dataclass(frozen=True)
class FileSpec:
    name: str
    md5: str            # of the file as read (for .gz files: of the decompressed content)
    size: int | None    # bytes on disk (None where recompressed copies are accepted)
    content_size: int | None = None    # .gz files: bytes once decompressed (reading stops beyond it)


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    folder: str                     # folder name inside a data root
    files: tuple[FileSpec, ...]
    url: str                        # base URL of the official files
    archive: str | None             # a .tar.gz holding ``folder``; None: files fetched one by one
    shape: tuple[int, int, int]     # C, H, W
    counts: tuple[int, int]         # train, test images
    num_classes: int
    extra_roots: tuple[str, ...] = ()


@dataclass
class ArrayDataset:
    """A whole dataset in memory as uint8 images (N, C, H, W) and int64 labels."""
    crops_in_workers = False              # a class attribute: trained resident, cropped on the device
    name: str
    classes: list[str]
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    source: str
    choices: list = field(default_factory=list)        # what was chosen from the data, and why
    cache: dict | None = None                          # a decoded folder's cache, described
    skipped_files: dict = field(default_factory=dict)  # a decoded folder's unreadable images left out: path -> why
    train_size: int = 0
    """Side of the training crops when it is not the stored side: a decoded folder is stored at
    its evaluation size and trained on smaller random-resized crops (0: the stored size)."""
    holdout_x: torch.Tensor | None = None
    """train.stop_at_target: the training images held out as the validation split (never trained
    on), at the evaluation size; with ``holdout_y``, and ``holdout_index``, their positions in the
    training set as it was read (see :mod:`speedrun.data.sources.holdout`)."""
    holdout_y: torch.Tensor | None = None
    holdout_index: torch.Tensor | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def in_channels(self) -> int:
        return self.train_x.shape[1]

    @property
    def image_size(self) -> tuple[int, int]:
        """The training size (before progressive resizing)."""
        return (self.train_size, self.train_size) if self.train_size else tuple(self.train_x.shape[2:])

    @property
    def stored_size(self) -> tuple[int, int]:
        """The size the training images are stored at."""
        return tuple(self.train_x.shape[2:])

    def placed(self, device: torch.device, memory_format: torch.memory_format) -> "ArrayDataset":
        """This data set with its images on ``device`` in ``memory_format`` (a copy where they
        are not so already): the move a run makes before its clock starts, as a loader that
        holds the set on the device has made it before training."""
        move = lambda t: t.to(device, non_blocking=True)
        held = {} if self.holdout_x is None else {
            "holdout_x": move(self.holdout_x).contiguous(memory_format=memory_format),
            "holdout_y": move(self.holdout_y)}
        return replace(self, train_x=move(self.train_x).contiguous(memory_format=memory_format),
                       test_x=move(self.test_x).contiguous(memory_format=memory_format),
                       train_y=move(self.train_y), test_y=move(self.test_y), **held)

    @property
    def eval_size(self) -> tuple[int, int]:
        """The size the test images are evaluated at (stored so)."""
        return tuple(self.test_x.shape[2:])


CIFAR10 = DatasetSpec(
    name="cifar10", folder="cifar-10-batches-py",
    files=(
        FileSpec("data_batch_1", "c99cafc152244af753f735de768cd75f", 31035704),
        FileSpec("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec", 31035320),
        FileSpec("data_batch_3", "54ebc095f3ab1f0389bbae665268c751", 31035999),
        FileSpec("data_batch_4", "634d18415352ddfa80567beed471001a", 31035696),
        FileSpec("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb", 31035623),
        FileSpec("test_batch", "40351d587109b95175f43aff81a1287e", 31035526),
        FileSpec("batches.meta", "5ff9c542aee3614f3951f8cda6e48888", 158),
    ),
    url="https://www.cs.toronto.edu/~kriz/", archive="cifar-10-python.tar.gz",
    shape=(3, 32, 32), counts=(50_000, 10_000), num_classes=10)

CIFAR100 = DatasetSpec(
    name="cifar100", folder="cifar-100-python",
    files=(
        FileSpec("train", "16019d7e3df5f24257cddd939b257f8d", None),
        FileSpec("test", "f0ef6b0ae62326f3e7ffdfab6717acfc", None),
        FileSpec("meta", "7973b15100ade9c7d40fb424638fde48", None),
    ),
    url="https://www.cs.toronto.edu/~kriz/", archive="cifar-100-python.tar.gz",
    shape=(3, 32, 32), counts=(50_000, 10_000), num_classes=100)

# Fashion-MNIST copies are often recompressed (Debian's are), so the md5s are of the
# decompressed idx content, which is the same in every faithful copy.
FASHION_MNIST = DatasetSpec(
    name="fashion-mnist", folder="fashion-mnist",
    files=(
        FileSpec("train-images-idx3-ubyte.gz", "f4a8712d7a061bf5bd6d2ca38dc4d50a", None, 47_040_016),
        FileSpec("train-labels-idx1-ubyte.gz", "9018921c3c673c538a1fc5bad174d6f9", None, 60_008),
        FileSpec("t10k-images-idx3-ubyte.gz", "8181f5470baa50b63fa0f6fddb340f0a", None, 7_840_016),
        FileSpec("t10k-labels-idx1-ubyte.gz", "15d484375f8d13e6eb1aabb0c3f46965", None, 10_008),
    ),
    url="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/", archive=None,
    shape=(1, 28, 28), counts=(60_000, 10_000), num_classes=10,
    extra_roots=("/usr/share/datasets",))

FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot"]

SPECS = {s.name: s for s in (CIFAR10, CIFAR100, FASHION_MNIST)}


# ------------------------------------------------------------------------------------------
# Finding
# ------------------------------------------------------------------------------------------

def search_roots(spec: DatasetSpec, data_dir: str | os.PathLike | None) -> list[Path]:
    roots = []
    if data_dir:
        roots.append(Path(data_dir).expanduser())
    if os.environ.get("SPEEDRUN_DATA"):
        roots.append(Path(os.environ["SPEEDRUN_DATA"]).expanduser())
    roots.append(Path("~/.cache/speedrun").expanduser())
    roots.extend(Path(r) for r in spec.extra_roots)
    return roots


def _holds_files(folder: Path, spec: DatasetSpec) -> bool:
    return folder.is_dir() and any((folder / f.name).exists() for f in spec.files)


def locate(spec: DatasetSpec, data_dir=None, fetch: bool = True) -> Path:
    """The folder holding ``spec``'s files: found, extracted from an archive, or downloaded."""
    roots = search_roots(spec, data_dir)
    looked = []
    for root in roots:
        for folder in (root / spec.folder, root):
            looked.append(str(folder))
            if _holds_files(folder, spec):
                return folder
        if spec.archive:
            archive = root / spec.archive
            looked.append(str(archive))
            if archive.is_file():
                with writable_root(roots, prefer=root) as dest:
                    return _unpack(spec, archive, dest)
    if not fetch:
        raise DataError(_missing_message(spec, looked, None))
    with writable_root(roots) as dest_root:
        try:
            return _fetch(spec, dest_root)
        except ConnectionError as err:
            raise DataError(_missing_message(spec, looked, err)) from None


@contextmanager
def writable_root(roots: list[Path], prefer: Path | None = None) -> Iterator[Path]:
    """The first of ``roots`` (``prefer`` first) that is, or can be made, a writable folder.
    The folders made for it are removed again when the work done there fails (a missing
    dataset, a failed download): a refused command leaves the disk as it was."""
    for root in ([prefer] if prefer else []) + roots:
        made = _missing_folders(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
            usable = os.access(root, os.W_OK)
        except OSError:
            usable = False
        if not usable:
            _remove_made(made)
            continue
        try:
            yield root
        except BaseException:
            _remove_made(made)
            raise
        return
    raise DataError("no writable place for dataset files among: " + ", ".join(map(str, roots)))


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first."""
    missing = []
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_made(made: list[Path]) -> None:
    """Remove the folders in ``made`` (deepest first) that are empty, stopping at the first that is not."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            break


def _missing_message(spec: DatasetSpec, looked: list[str], err: Exception | None) -> str:
    what = spec.archive or ", ".join(f.name for f in spec.files)
    lines = [f"dataset {spec.name!r} not found. Looked in:"] + [f"  {p}" for p in looked]
    if err is not None:
        lines.append(f"and the download failed: {err}")
    lines.append(
        f"To provide it, put the official files ({what}) from {spec.url} into "
        f"DIR/{spec.folder}/ (or the archive into DIR/) and pass --data-dir DIR or set "
        "SPEEDRUN_DATA=DIR; with a network connection speedrun downloads them itself.")
    return "\n".join(lines)


def _mirror(spec: DatasetSpec) -> str:
    base = os.environ.get("SPEEDRUN_MIRROR") or spec.url
    return base.rstrip("/") + "/"


def _fetch(spec: DatasetSpec, root: Path) -> Path:
    if spec.archive:
        archive = download(_mirror(spec) + spec.archive, root / spec.archive)
        return _unpack(spec, archive, root)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{spec.folder}-"))
    try:
        for f in spec.files:
            download(_mirror(spec) + f.name, staging / f.name)
        verify_files(spec, staging, downloaded_from=_mirror(spec))   # nothing lands under the real name unless it is right
        move_into(staging, root / spec.folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root / spec.folder


def _unpack(spec: DatasetSpec, archive: Path, root: Path) -> Path:
    """Extract ``archive`` into a staging folder, verify, then move into ``root/folder``."""
    # errors name the member, not the staging path
    return unpack_checked(archive, root, spec.folder, spec.archive,
                          lambda extracted: verify_files(spec, extracted, archive=archive))


def unpack_checked(archive: Path, root: Path, folder: str, official: str, check, fix: str | None = None) -> Path:
    """Extract ``archive`` into a staging folder in ``root``, run ``check`` on the ``folder``
    it holds, and only then move it to ``root/folder``; on any failure nothing is left in
    ``root``. ``fix``: what to do, appended to the error of an archive without ``folder``."""
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{folder}-"))
    try:
        safe_extract(archive, staging)
        extracted = staging / folder
        if not extracted.is_dir():
            raise DataError(f"{archive}: has no folder {folder}/ inside; it is not the official {official}"
                            + (f". {fix}" if fix else ""))
        check(extracted)
        move_into(extracted, root / folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root / folder


def move_into(src: Path, dest: Path) -> None:
    """Move the verified folder ``src`` to ``dest``. Where ``dest`` already exists (it holds
    none of the dataset's files, or it would have been used), its files are the user's: the
    new files are moved in beside them and nothing there is replaced or deleted."""
    if not dest.exists():
        os.replace(src, dest)
        return
    for item in src.iterdir():
        if not (dest / item.name).exists():
            os.replace(item, dest / item.name)


# ------------------------------------------------------------------------------------------
# Verifying
# ------------------------------------------------------------------------------------------

def _read_checked(folder: Path, f: FileSpec, name: str | None = None, fix: str | None = None,
                  partial: str | None = None) -> bytes | None:
    """Check one file; returns decompressed content for .gz files (already read), else None.
    ``name``, ``fix``, ``partial``: how errors name the file, what they tell the user to do and
    what a missing file means, where the file is not the user's own (a member of an archive,
    a download), so that no message names a temporary staging path."""
    path = folder / f.name
    name = name or str(path)
    fix = fix or f"Delete {path} and let speedrun download it again, or copy a fresh official copy there."
    partial = partial or f"{folder} holds some but not all of the dataset"
    if not path.is_file():
        raise DataError(f"{name}: missing ({partial}). {fix}")
    if f.size is not None and path.stat().st_size != f.size:
        size = path.stat().st_size
        kind = "truncated" if size < f.size else "too large"
        raise DataError(f"{name}: {kind}: {size} bytes, expected {f.size}. {fix}")
    if f.name.endswith(".gz"):
        content = gunzip_bounded(path, f.content_size, fix, name=name)
        got = hashlib.md5(content).hexdigest()
    else:
        content, got = None, md5sum(path)
    if got != f.md5:
        raise DataError(f"{name}: checksum mismatch (md5 {got}, expected {f.md5}); "
                        f"the file is corrupt or not the official one. {fix}")
    return content


def gunzip_bounded(path: Path, expected: int | None, fix: str, name: str | None = None) -> bytes:
    """The decompressed content of ``path``, read in blocks and abandoned as soon as it
    exceeds ``expected`` bytes, so a file that expands without bound never fills memory.
    ``name``: how errors name the file (default: its path)."""
    limit = expected if expected is not None else 1 << 31
    shown = name or str(path)
    blocks, total = [], 0
    try:
        with gzip.open(path, "rb") as g:
            while block := g.read(1 << 20):
                total += len(block)
                if total > limit:
                    raise DataError(f"{shown}: decompresses to more than the {limit:,} bytes of the official file; "
                                    f"it is not the dataset's file. {fix}")
                blocks.append(block)
    except (OSError, EOFError, zlib.error) as err:
        raise DataError(f"{shown}: not a complete gzip file ({err}); truncated or corrupt. {fix}") from None
    return b"".join(blocks)


def verify_files(spec: DatasetSpec, folder: Path, archive: Path | None = None,
                 downloaded_from: str | None = None) -> dict[str, bytes | None]:
    """Check every file of ``spec`` in ``folder``. ``archive``: the folder was just extracted
    from it (into a staging folder), so errors name the archive and the member as it appears
    in the archive; ``downloaded_from``: the files were just downloaded from this base URL
    (into a staging folder), so errors name the URL."""
    if archive is not None:
        return {f.name: _read_checked(
            folder, f, name=f"{archive}: member {spec.folder}/{f.name}",
            fix=f"Delete {archive} and let speedrun download it again (or put a fresh official copy there).",
            partial="the archive holds some but not all of the dataset") for f in spec.files}
    if downloaded_from is not None:
        return {f.name: _read_checked(
            folder, f, name=f"{downloaded_from}{f.name}",
            fix="Nothing was kept; try again later, or check $SPEEDRUN_MIRROR if it is set.",
            partial="the server holds some but not all of the dataset") for f in spec.files}
    return {f.name: _read_checked(folder, f) for f in spec.files}


def check_arrays(spec: DatasetSpec, ds: ArrayDataset) -> None:
    """Counts, shapes, dtypes, label range and per-class balance of a loaded set."""
    for split, x, y, n in (("train", ds.train_x, ds.train_y, spec.counts[0]),
                           ("test", ds.test_x, ds.test_y, spec.counts[1])):
        where = f"{ds.source} ({split} split)"
        if tuple(x.shape) != (n, *spec.shape) or x.dtype != torch.uint8:
            raise DataError(f"{where}: images have shape {tuple(x.shape)} {x.dtype}, "
                            f"expected {(n, *spec.shape)} uint8")
        if tuple(y.shape) != (n,):
            raise DataError(f"{where}: {len(y)} labels for {n} images")
        if int(y.min()) < 0 or int(y.max()) >= spec.num_classes:
            raise DataError(f"{where}: labels outside 0..{spec.num_classes - 1}")
        per_class = torch.bincount(y, minlength=spec.num_classes)
        if int(per_class.min()) != int(per_class.max()):
            raise DataError(f"{where}: classes are unbalanced ({per_class.tolist()}); "
                            "the official set has the same count in every class")


# ------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------

def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def _load_cifar10(folder: Path, _content) -> tuple:
    def batch(name):
        d = _unpickle(folder / name)
        return np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(d[b"labels"])
    parts = [batch(f"data_batch_{i}") for i in range(1, 6)]
    train_x = np.concatenate([p[0] for p in parts])
    train_y = np.concatenate([p[1] for p in parts])
    test_x, test_y = batch("test_batch")
    classes = [c.decode() for c in _unpickle(folder / "batches.meta")[b"label_names"]]
    return classes, train_x, train_y, test_x, test_y


def _load_cifar100(folder: Path, _content) -> tuple:
    def split(name):
        d = _unpickle(folder / name)
        return np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(d[b"fine_labels"])
    train_x, train_y = split("train")
    test_x, test_y = split("test")
    classes = [c.decode() for c in _unpickle(folder / "meta")[b"fine_label_names"]]
    return classes, train_x, train_y, test_x, test_y


def parse_idx(content: bytes, name: str) -> np.ndarray:
    """Decode an idx file (the MNIST format): magic 0x0000 0x08 NDIM, NDIM big-endian sizes, uint8."""
    if len(content) < 4 or content[:3] != b"\x00\x00\x08":
        raise DataError(f"{name}: not an idx file of unsigned bytes")
    ndim = content[3]
    dims = tuple(int.from_bytes(content[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(content, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataError(f"{name}: holds {data.size} values, its header says {dims}")
    return data.reshape(dims)


def _load_fashion_mnist(folder: Path, content: dict) -> tuple:
    get = lambda n: parse_idx(content[n], str(folder / n))
    train_x = get("train-images-idx3-ubyte.gz")[:, None]
    test_x = get("t10k-images-idx3-ubyte.gz")[:, None]
    return (FASHION_MNIST_CLASSES, train_x, get("train-labels-idx1-ubyte.gz"),
            test_x, get("t10k-labels-idx1-ubyte.gz"))


LOADERS: dict[str, Callable] = {
    "cifar10": _load_cifar10, "cifar100": _load_cifar100, "fashion-mnist": _load_fashion_mnist,
}


def load_dataset(name: str, data_dir=None, fetch: bool = True) -> ArrayDataset:
    """Find, verify and load a built-in dataset as uint8 CPU tensors."""
    if name not in SPECS:
        raise DataError(f"unknown dataset {name!r}; built in: {', '.join(SPECS)}")
    spec = SPECS[name]
    folder = locate(spec, data_dir, fetch=fetch)
    content = verify_files(spec, folder)
    classes, train_x, train_y, test_x, test_y = LOADERS[name](folder, content)
    t = lambda a, dt: torch.from_numpy(np.require(a, requirements=["C", "W"])).to(dt)
    ds = ArrayDataset(name, list(classes), t(train_x, torch.uint8), t(train_y, torch.int64),
                      t(test_x, torch.uint8), t(test_y, torch.int64), source=str(folder))
    check_arrays(spec, ds)
    return ds
