"""Datasets as arrays in an ``.npz`` file: ``x_train``, ``y_train``, ``x_test``, ``y_test``
(and optionally ``classes``).

Images may be (N, H, W), (N, H, W, C) or (N, C, H, W) uint8. Members stored uncompressed
(as ``speedrun data prepare`` writes them, or ``numpy.savez``) are memory-mapped rather
than read, so a large prepared set costs no load time and no host memory before it is
moved to the device.
"""
from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np
import torch

from ...errors import DataError
from .builtin import ArrayDataset

REQUIRED = ("x_train", "y_train", "x_test", "y_test")


def _member_offset(f, info: zipfile.ZipInfo) -> int:
    """Byte offset of a stored zip member's data (after its local file header)."""
    f.seek(info.header_offset)
    header = f.read(30)
    if header[:4] != b"PK\x03\x04":
        raise DataError(f"{f.name}: damaged zip header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def open_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an .npz: memory-mapped where stored uncompressed, else loaded."""
    arrays = {}
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
            for info in zf.infolist():
                name = info.filename.removesuffix(".npy")
                if info.compress_type == zipfile.ZIP_STORED:
                    f.seek(_member_offset(f, info))
                    version = np.lib.format.read_magic(f)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, fortran, dtype = read_header(f)
                    if dtype.hasobject:
                        raise DataError(f"{path}: member {name} holds Python objects; store plain arrays")
                    # copy-on-write: writable for torch, never written back to the file
                    arrays[name] = np.memmap(path, dtype=dtype, mode="c", offset=f.tell(), shape=shape,
                                             order="F" if fortran else "C")
                else:
                    with zf.open(info) as member:
                        arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise DataError(f"{path}: not a readable .npz file ({err}); it may be truncated") from None
    return arrays


def _images(x: np.ndarray, name: str, path: Path) -> torch.Tensor:
    if x.dtype != np.uint8:
        raise DataError(f"{path}: {name} has dtype {x.dtype}; images must be uint8 (0..255)")
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[1] not in (1, 3) and x.shape[3] in (1, 3):
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))          # NHWC -> NCHW (a copy)
    elif x.ndim != 4 or x.shape[1] not in (1, 3):
        raise DataError(f"{path}: {name} has shape {x.shape}; expected (N, H, W), (N, H, W, C) or (N, C, H, W) "
                        "with 1 or 3 channels")
    return torch.from_numpy(x)


def load_npz(path: str | Path) -> ArrayDataset:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{path}: no such file. An npz dataset needs x_train, y_train, x_test, y_test arrays "
                        "(make one from an image folder with `speedrun data prepare`)")
    arrays = open_npz(path)
    missing = [k for k in REQUIRED if k not in arrays]
    if missing:
        raise DataError(f"{path}: missing arrays {missing}; it must hold {', '.join(REQUIRED)}")
    train_x, test_x = _images(arrays["x_train"], "x_train", path), _images(arrays["x_test"], "x_test", path)
    ys = {}
    for k in ("y_train", "y_test"):
        y = np.asarray(arrays[k]).reshape(-1)
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{path}: {k} has dtype {y.dtype}; labels must be integers")
        ys[k] = torch.from_numpy(y.astype(np.int64))
    for x, y, split in ((train_x, ys["y_train"], "train"), (test_x, ys["y_test"], "test")):
        if len(x) != len(y):
            raise DataError(f"{path}: {len(x)} {split} images but {len(y)} labels")
        if len(x) == 0:
            raise DataError(f"{path}: x_{split} holds no images")
    if train_x.shape[1:] != test_x.shape[1:]:
        raise DataError(f"{path}: train images are {tuple(train_x.shape[1:])}, test images {tuple(test_x.shape[1:])}")
    low = int(min(ys["y_train"].min(), ys["y_test"].min()))
    high = int(max(ys["y_train"].max(), ys["y_test"].max()))
    if low < 0:
        raise DataError(f"{path}: negative labels (down to {low}); labels are class numbers 0..K-1")
    if "classes" in arrays:
        classes = [str(c) for c in np.asarray(arrays["classes"]).reshape(-1)]
        if high >= len(classes):
            raise DataError(f"{path}: labels go up to {high} but only {len(classes)} classes are named")
    else:
        if high >= len(ys["y_train"]):
            raise DataError(f"{path}: labels go up to {high:,} with only {len(ys['y_train']):,} training images; "
                            "labels must be class numbers 0..K-1 (or name the classes in a 'classes' array)")
        classes = [str(i) for i in range(high + 1)]
    if len(classes) < 2:
        raise DataError(f"{path}: only one class; a classifier needs at least two")
    return ArrayDataset(path.stem, classes, train_x, ys["y_train"], test_x, ys["y_test"], source=str(path))
