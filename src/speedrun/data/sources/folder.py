"""Folders of images in the ImageNet layout, and decoding single images.

``DIR/train/<class>/*.jpg`` with ``DIR/val/<class>/...``, or one ``DIR/<class>/...`` split
into train and validation by a fraction with a fixed seed (stratified per class). Class
names are the sub-folder names in sorted order, so the label of a class never depends on
the order the file system lists it in.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from ...errors import DataError

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff"}
JPEG_EXTENSIONS = {".jpg", ".jpeg"}

try:                                       # libjpeg-turbo with DCT-domain down-scaling
    import simplejpeg
except ImportError:                        # pragma: no cover - Pillow is the fallback
    simplejpeg = None


@dataclass
class ImageList:
    """Image files (relative to ``root``) and their labels."""
    root: Path
    classes: list[str]
    files: list[str]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.files)

    def path(self, i: int) -> Path:
        return self.root / self.files[i]

    def subset(self, idx: np.ndarray) -> "ImageList":
        return ImageList(self.root, self.classes, [self.files[i] for i in idx], self.labels[idx])


def scan(folder: Path, classes: list[str] | None = None) -> ImageList:
    """Every image under ``folder/<class>/`` (recursively), labelled by class folder. Without
    ``classes`` (a training folder) the class folders define the classes: at least two, none
    empty."""
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder. A folder dataset needs DIR/<class>/<images> or "
                        "DIR/train/<class>/... and DIR/val/<class>/...")
    found = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    defining = classes is None
    classes = found if defining else classes
    if not classes:
        raise DataError(f"{folder}: holds no class sub-folders; put each class's images in DIR/<class>/")
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise DataError(f"{folder}: classes {unknown[:5]} are not among the training classes")
    files, labels, empty = [], [], []
    for label, name in enumerate(classes):
        sub = folder / name
        if not sub.is_dir():
            continue
        before = len(files)
        for p in sorted(sub.rglob("*")):
            if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file():
                files.append(str(p.relative_to(folder)))
                labels.append(label)
        if len(files) == before:
            empty.append(name)
    if not files:
        raise DataError(f"{folder}: no images found (extensions: {', '.join(sorted(IMAGE_EXTENSIONS))})")
    if defining and empty:
        raise DataError(f"{folder}: class folder(s) {', '.join(repr(e) for e in empty[:5])} hold no images "
                        f"(extensions: {', '.join(sorted(IMAGE_EXTENSIONS))}); an empty class would be learnt "
                        "as a class with no examples. Add images or remove the folder")
    if defining and len(classes) < 2:
        raise DataError(f"{folder}: has only one class folder ({classes[0]!r}); a classifier needs at least "
                        "two classes, each in its own sub-folder")
    return ImageList(folder, list(classes), files, np.asarray(labels, dtype=np.int64))


def folder_splits(path: str | Path, val_fraction: float, seed: int) -> tuple[ImageList, ImageList]:
    """(train, validation) image lists of a folder dataset."""
    root = Path(path).expanduser()
    if (root / "train").is_dir():
        train = scan(root / "train")
        if (root / "val" / "val_annotations.txt").is_file():
            return train, annotated(root / "val", train.classes)
        val_dir = next((root / n for n in ("val", "validation", "test") if (root / n).is_dir()), None)
        if val_dir is not None:
            return train, scan(val_dir, train.classes)
        if not val_fraction:
            raise DataError(f"{root}: has train/ but no val/ (or test/); add one, or hold out part of "
                            "train/ with --set data.val_fraction=0.1")
        return split(train, val_fraction, seed)
    whole = scan(root)
    if not val_fraction:
        raise DataError(f"{root}: has no train/ and val/ sub-folders; hold out a validation part with "
                        "--set data.val_fraction=0.1 (a fixed, seeded split per class)")
    return split(whole, val_fraction, seed)


def annotated(folder: Path, classes: list[str]) -> ImageList:
    """Tiny-ImageNet's validation layout: images/ plus val_annotations.txt (file, class, box)."""
    index = {c: i for i, c in enumerate(classes)}
    files, labels = [], []
    for n, line in enumerate((folder / "val_annotations.txt").read_text().splitlines(), 1):
        parts = line.split("\t")
        if len(parts) < 2:
            continue
        if parts[1] not in index:
            raise DataError(f"{folder / 'val_annotations.txt'}: line {n} names class {parts[1]!r}, "
                            "which has no folder under train/")
        files.append(str(Path("images") / parts[0]))
        labels.append(index[parts[1]])
    if not files:
        raise DataError(f"{folder / 'val_annotations.txt'}: no annotations")
    return ImageList(folder, classes, files, np.asarray(labels, dtype=np.int64))


def split_indices(labels: np.ndarray, classes: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) positions, each sorted: a stratified, seeded split that holds out
    ``fraction`` of each class's images (at least one of a class with two or more)."""
    rng = np.random.default_rng(seed)
    kept, held = [], []
    for label in range(classes):
        idx = np.flatnonzero(labels == label)
        rng.shuffle(idx)
        n_held = max(1, round(len(idx) * fraction)) if len(idx) > 1 else 0
        held.append(idx[:n_held])
        kept.append(idx[n_held:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held))


def split(images: ImageList, val_fraction: float, seed: int) -> tuple[ImageList, ImageList]:
    """Stratified split: ``val_fraction`` of each class (at least one image) to validation."""
    kept, held = split_indices(images.labels, len(images.classes), val_fraction, seed)
    return images.subset(kept), images.subset(held)


# ------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------

def corrupt_error(path: Path, err: Exception) -> DataError:
    why = "not a recognised image format" if isinstance(err, UnidentifiedImageError) else f"{type(err).__name__}: {err}"
    return DataError(f"{path}: cannot decode this image ({why}). Replace or delete the file, or skip "
                     "unreadable images (train: --set data.skip_corrupt=true; data prepare: --skip-corrupt)")


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise corrupt_error(path, err) from None


def _is_jpeg(data: bytes, path: Path, decoder: str) -> bool:
    return (decoder in ("auto", "simplejpeg") and simplejpeg is not None
            and path.suffix.lower() in JPEG_EXTENSIONS and simplejpeg.is_jpeg(data))


MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485
"""Images with more pixels than this are refused (Pillow's decompression-bomb limit): a
small file that decodes to gigabytes is an attack or a mistake, never a training image."""


def _too_large(path: Path, h: int | None = None, w: int | None = None) -> DataError:
    size = f"{w}x{h} pixels" if h else "too many pixels"
    return DataError(f"{path}: {size}, over the limit of {MAX_PIXELS:,} (a decompression bomb, or far "
                     "larger than any training image); remove or shrink it, or skip unreadable images "
                     "(train: --set data.skip_corrupt=true; data prepare: --skip-corrupt)")


def _open(fp) -> Image.Image:
    """Image.open without Pillow's decompression-bomb warning (sizes are checked here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(fp)


def _pixels(im: Image.Image, channels: int, path: Path) -> np.ndarray:
    """The image as uint8 (H, W) or (H, W, 3): 16-bit images are scaled (not clipped) to
    8 bits; float images are refused."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        a = np.asarray(im)
        if a.size and (a.min() < 0 or a.max() > 65535):
            raise DataError(f"{path}: 32-bit integer pixels outside 0..65535; speedrun reads 8- and 16-bit "
                            "images. Convert it to 8-bit (or skip it with data.skip_corrupt)")
        grey = ((a.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2) if channels == 3 else grey
    if im.mode == "F":
        raise DataError(f"{path}: floating-point pixels (mode F) have no standard scale; speedrun reads 8- "
                        "and 16-bit images. Convert it to 8-bit (or skip it with data.skip_corrupt)")
    return np.asarray(im.convert("RGB" if channels == 3 else "L"))


def decode(data: bytes, path: Path, channels: int, min_hw=None, decoder: str = "auto") -> np.ndarray:
    """Decode image bytes to a uint8 array (H, W, channels).

    ``min_hw((height, width)) -> (rows, cols)``, given the stored size, says how many rows
    and columns are needed; JPEG decoders then down-scale in the DCT domain (by 1/2, 1/4 or
    1/8) while keeping at least that many: much cheaper than decoding the full image and
    resizing it afterwards. The file is parsed once."""
    try:
        if _is_jpeg(data, path, decoder):
            h, w = simplejpeg.decode_jpeg_header(data)[:2]
            if h * w > MAX_PIXELS:
                raise _too_large(path, h, w)
            need = min_hw((h, w)) if min_hw else (0, 0)
            img = simplejpeg.decode_jpeg(data, colorspace="RGB" if channels == 3 else "GRAY", fastdct=True,
                                         fastupsample=True, min_height=need[0], min_width=need[1])
        else:
            with _open(io.BytesIO(data)) as im:
                if im.size[0] * im.size[1] > MAX_PIXELS:
                    raise _too_large(path, im.size[1], im.size[0])
                if min_hw:                          # (asked of every format: a caller may draw its crop here)
                    rows, cols = min_hw((im.size[1], im.size[0]))
                    if im.format == "JPEG":
                        im.draft("RGB" if channels == 3 else "L", (cols, rows))
                img = _pixels(im, channels, path)
    except Image.DecompressionBombError:
        raise _too_large(path) from None
    except (OSError, ValueError, UnidentifiedImageError, SyntaxError, EOFError) as err:
        raise corrupt_error(path, err) from None
    return img if img.ndim == 3 else img[:, :, None]


def probe(images: ImageList, n: int = 64, seed: int = 0) -> dict:
    """Sizes and channels of a sample of the images, to choose defaults from the data."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(images), size=min(n, len(images)), replace=False)
    sizes, modes = [], set()
    for i in idx:
        try:
            with _open(images.path(int(i))) as im:
                sizes.append(im.size)
                modes.add(im.mode)
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError, Image.DecompressionBombError):
            continue
    if not sizes:
        raise DataError(f"{images.root}: none of {len(idx)} sampled images could be read")
    shorter = sorted(min(s) for s in sizes)
    grey = modes <= {"L", "LA", "1", "I;16", "I;16B", "I;16L", "I;16N", "I"}
    return {"median_shorter_side": shorter[len(shorter) // 2], "channels": 1 if grey else 3}
