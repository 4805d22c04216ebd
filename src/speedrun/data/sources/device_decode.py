"""Decoding image files on the device with torchvision: nvjpeg on a CUDA GPU, libjpeg-turbo
on the CPU, through the same calls (``speedrun data prepare --decoder torchvision``).

The files are read on the host. JPEGs are decoded by one batched ``torchvision.io.decode_jpeg``
call onto the device; every other format is decoded on the host by the default Pillow path
(``folder.decode``: torchvision reads neither BMP, TIFF nor PPM, and returns 16-bit PNGs as
uint16), then moved. Each image is then brought to size x size on the device: its centre
square (the whole shorter side) resampled with Pillow's antialiased bilinear filter in float32
(separable weight matrices, ``filter_weights``) and rounded back to uint8, which is the
geometry and filter of the streamed pipeline's centre crop with crop fraction 1.0
(``ImageItems._resize_centre``). One difference remains: JPEGs are decoded at full size, where
that path lets libjpeg down-scale them in the DCT domain first.
"""
from __future__ import annotations

import io
import re
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError

from ...errors import DataError
from .folder import MAX_PIXELS, _open, _too_large, corrupt_error, decode, read_bytes

JPEG_MAGIC = b"\xff\xd8\xff"
_DEPRECATION = r"The image decoding and encoding capabilities of TorchVision are deprecated"


def torchvision_io():
    """``torchvision.io``, or a DataError saying how to install torchvision. A torchvision
    built for another torch can fail at import with ImportError, RuntimeError, OSError (an
    undefined symbol) or other errors, so any exception counts as "cannot be imported"."""
    try:
        from torchvision import io as tvio
    except Exception as err:                        # noqa: BLE001 - whatever the failed import raises
        why = (str(err).strip().splitlines() or [""])[0][:200]
        raise DataError(
            f"decoder 'torchvision' needs torchvision, which cannot be imported beside torch {torch.__version__} "
            f"({type(err).__name__}: {why}); install the torchvision release built for this torch "
            f"(pip install torchvision from the index torch {torch.__version__} came from), or use decoder "
            "'auto'") from None
    return tvio


def decode_to_square(paths: list[Path], size: int, channels: int, device: torch.device | str,
                     skip_corrupt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images N x channels x size x size on ``device``, bool kept-mask on the CPU).

    An unreadable file raises a DataError naming it; with ``skip_corrupt`` its row is left
    zero and marked not kept."""
    tvio = torchvision_io()
    device = torch.device(device)
    n = len(paths)
    out = torch.zeros((n, channels, size, size), dtype=torch.uint8, device=device)
    kept = torch.ones(n, dtype=torch.bool)
    images: dict[int, torch.Tensor] = {}            # index -> uint8 C x H x W on the device
    jpegs: list[tuple[int, torch.Tensor]] = []      # index -> the file's bytes (host)

    def failed(i: int, err: DataError) -> None:
        if not skip_corrupt:
            raise err
        kept[i] = False

    for i, path in enumerate(paths):
        try:
            data = read_bytes(path)
            if data.startswith(JPEG_MAGIC):
                _check_header(data, path)
                jpegs.append((i, torch.frombuffer(bytearray(data), dtype=torch.uint8)))
            else:
                img = torch.tensor(decode(data, path, channels))         # a copy: Pillow's array is read-only
                images[i] = img.permute(2, 0, 1).to(device)
        except DataError as err:
            failed(i, err)
    mode = tvio.ImageReadMode.RGB if channels == 3 else tvio.ImageReadMode.GRAY
    for i, img in _decode_jpegs(tvio, jpegs, mode, device):
        if isinstance(img, Exception):
            failed(i, corrupt_error(paths[i], img))
        else:
            images[i] = img
    _squares_into(out, images, size)
    return out, kept


def _check_header(data: bytes, path: Path) -> None:
    """Refuse an image whose header is unreadable or claims more pixels than the limit,
    before the decoder allocates it (on a GPU, a bomb would run it out of memory)."""
    try:
        with _open(io.BytesIO(data)) as im:
            w, h = im.size
    except Image.DecompressionBombError:
        raise _too_large(path) from None
    except (OSError, ValueError, UnidentifiedImageError, SyntaxError, EOFError) as err:
        raise corrupt_error(path, err) from None
    if h * w > MAX_PIXELS:
        raise _too_large(path, h, w)


def _decode_jpegs(tvio, jpegs, mode, device):
    """(index, C x H x W uint8 on ``device``, or the decoder's error) for each JPEG: one batched
    call, and one call per file only when the batch failed (the batched call returns nothing
    when any of its files is corrupt)."""
    if not jpegs:
        return []
    with warnings.catch_warnings():                 # torchvision 0.29 deprecates its decoders for TorchCodec
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
        try:
            return list(zip([i for i, _ in jpegs], tvio.decode_jpeg([d for _, d in jpegs], mode=mode,
                                                                       device=device)))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            pass
        results = []
        for i, data in jpegs:
            try:
                results.append((i, tvio.decode_jpeg(data, mode=mode, device=device)))
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as err:
                results.append((i, RuntimeError(_reason(err))))
        return results


def _reason(err: Exception) -> str:
    """torchvision's message without its C++ source location ("decode_jpeg, .../x.cpp:171, why")."""
    first = (str(err).strip().splitlines() or [""])[0]
    return re.sub(r"^[\w:]+, \S+\.(?:cpp|cu|h):\d+, ", "", first)


def _squares_into(out: torch.Tensor, images: dict[int, torch.Tensor], size: int) -> None:
    """Each image's centre square (the whole shorter side) resized to size x size into ``out``;
    images of the same shape are resized together, at most ``GROUP`` at a time."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, img in images.items():
        groups[tuple(img.shape[1:])].append(i)
    for (h, w), members in groups.items():
        side = min(h, w)
        wy = filter_weights(h, (h - side) / 2, side, size, out.device)
        wx = filter_weights(w, (w - side) / 2, side, size, out.device)
        for start in range(0, len(members), GROUP):
            chunk = members[start:start + GROUP]
            x = torch.stack([images[i] for i in chunk])
            if not h == w == size:                  # already the size: no resampling
                x = (wy @ (x.float() @ wx.T)).round_().clamp_(0, 255).to(torch.uint8)
            out[torch.tensor(chunk, device=out.device)] = x


GROUP = 64
"""Images resized in one call (float32 copies: 64 x 3 x 500 x 375 is 144 MB)."""


def filter_weights(length: int, start: float, side: float, size: int, device: torch.device) -> torch.Tensor:
    """(size, length) float32 weights that resample the span [start, start + side) of an axis of
    ``length`` pixels to ``size`` pixels with Pillow's antialiased bilinear filter (a triangle
    as wide as the down-scaling factor, normalised; pixels beside the span take part as in
    Pillow's box resize). As matrices, unlike ``F.interpolate``, the span may start on a half
    pixel: the centre square of an image whose sides differ by an odd number of pixels does."""
    scale = side / size
    support = max(scale, 1.0)
    centre = start + (torch.arange(size, dtype=torch.float64) + 0.5) * scale
    k = torch.arange(length, dtype=torch.float64) + 0.5
    weights = (1 - ((k[None, :] - centre[:, None]) / support).abs()).clamp_(min=0)
    return (weights / weights.sum(dim=1, keepdim=True)).to(device, torch.float32)
