"""Decoding image files on the device with torchvision: nvjpeg on a CUDA GPU, libjpeg-turbo
on the CPU, through the same calls (``data.decoder = "torchvision"``, ``speedrun data prepare
--decoder torchvision``).

:class:`SquareDecoder` turns lists of files into size x size uint8 squares on the device:

* A pool of host threads reads the files of the next list while the device decodes the current
  one, checks each JPEG's header (its size against the pixel limit, before the decoder
  allocates it), and decodes on the host what nvJPEG's batched path does not take: every
  format other than JPEG (by the default Pillow path, ``folder.decode``: torchvision reads
  neither BMP, TIFF nor PPM, and returns 16-bit PNGs as uint16) and progressive JPEGs (which
  nvJPEG decodes one at a time, its Huffman stage on the calling host thread, under a lock
  that serialises every other decode). On a GPU the list's bytes sit in one pinned buffer.
* The baseline JPEGs of a list are decoded by one ``torchvision.io.decode_jpeg`` call.
* Each image is brought to size x size on the device: its centre square (the whole shorter
  side) resampled with Pillow's antialiased bilinear filter in float32 (separable weight
  matrices, :func:`filter_weights`, built on the device once per side length and kept) and
  rounded back to uint8, which is the geometry and filter of the streamed pipeline's centre
  crop with crop fraction 1.0 (``ImageItems._resize_centre``). Images of one shape are
  resized by one pair of matrix products; nothing in the resize waits on the host.
* :meth:`SquareDecoder.stream` copies each list's squares to pinned host memory without
  waiting and hands them over one list later, so reading, decoding and copying overlap.

One difference from the streamed pipeline remains: JPEGs are decoded at full size, where that
path lets libjpeg down-scale them in the DCT domain first.
"""
from __future__ import annotations

import io
import os
import re
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from PIL import Image, UnidentifiedImageError

from ...errors import DataError
from .folder import MAX_PIXELS, _open, _too_large, corrupt_error, decode, read_bytes

JPEG_MAGIC = b"\xff\xd8\xff"
_DEPRECATION = r"The image decoding and encoding capabilities of TorchVision are deprecated"

LIST = 256
"""Files per list (one batched decode call)."""

THREADS = 8
"""Host threads that read files (at most; fewer on a host with fewer cores)."""

GROUP = 64
"""Images of one shape resized in one call (float32 copies: 64 x 3 x 500 x 375 is 144 MB)."""


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


@dataclass
class _Read:
    """One file as a reading thread leaves it: a baseline JPEG's bytes for the device decoder,
    an image the host decoded (C x H x W uint8), or why it cannot be decoded."""
    jpeg: torch.Tensor | None = None
    image: torch.Tensor | None = None
    error: DataError | None = None


def _read(path: Path, channels: int) -> _Read:
    try:
        data = read_bytes(path)
        if data.startswith(JPEG_MAGIC) and not _check_header(data, path):
            return _Read(jpeg=torch.frombuffer(bytearray(data), dtype=torch.uint8))
        # other formats and progressive JPEGs; Pillow's libjpeg with the accurate DCT, as torchvision's
        img = torch.tensor(decode(data, path, channels, decoder="pillow"))   # a copy: Pillow's array is read-only
        return _Read(image=img.permute(2, 0, 1))
    except DataError as err:
        return _Read(error=err)


def _check_header(data: bytes, path: Path) -> bool:
    """Whether the JPEG is progressive; refuses one whose header is unreadable or claims more
    pixels than the limit, before the decoder allocates it (on a GPU, a bomb would run it out
    of memory)."""
    try:
        with _open(io.BytesIO(data)) as im:
            w, h = im.size
            progressive = bool(im.info.get("progressive") or im.info.get("progression"))
    except Image.DecompressionBombError:
        raise _too_large(path) from None
    except (OSError, ValueError, UnidentifiedImageError, SyntaxError, EOFError) as err:
        raise corrupt_error(path, err) from None
    if h * w > MAX_PIXELS:
        raise _too_large(path, h, w)
    return progressive


def read_ahead(lists: Sequence[Sequence[Path]], channels: int, threads: int | None = None) -> Iterator[list[_Read]]:
    """Each list's files as the reading threads leave them (:func:`_read`), in order; the next
    list's files are already being read when a list is handed over. ``threads``: default one
    per core, at most :data:`THREADS`."""
    if not lists:
        return
    pool = ThreadPoolExecutor(threads or max(1, min(THREADS, os.cpu_count() or 1)))
    try:
        def submit(paths):
            return [pool.submit(_read, p, channels) for p in paths]
        reading = submit(lists[0])
        for k in range(len(lists)):
            reads = [f.result() for f in reading]
            if k + 1 < len(lists):
                reading = submit(lists[k + 1])
            yield reads
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def decode_reads(tvio, paths: Sequence[Path], reads: list[_Read], mode, device: torch.device,
                 failed: Callable[[int, DataError], None]) -> dict[int, torch.Tensor]:
    """{position: uint8 C x H x W on ``device``} of a list's files read by :func:`read_ahead`:
    the baseline JPEGs decoded by one call (from one pinned buffer on a GPU), the rest moved as
    the threads decoded them; ``failed(position, error)`` hears each file that cannot be decoded
    (the error names it) and raises or lets it be left out."""
    images: dict[int, torch.Tensor] = {}
    jpegs: list[tuple[int, torch.Tensor]] = []      # position -> the file's bytes (host)
    for i, r in enumerate(reads):
        if r.error is not None:
            failed(i, r.error)
        elif r.jpeg is not None:
            jpegs.append((i, r.jpeg))
        else:
            images[i] = r.image.to(device, non_blocking=True)
    for i, img in _decode_jpegs(tvio, pinned(jpegs) if device.type == "cuda" else jpegs, mode, device):
        if isinstance(img, Exception):
            failed(i, corrupt_error(paths[i], img))
        else:
            images[i] = img
    return images


class SquareDecoder:
    """Image files to uint8 squares (channels x size x size) on ``device``. An unreadable file
    raises a DataError naming it; with ``skip_corrupt`` its square is left zero and marked not
    kept."""

    def __init__(self, size: int, channels: int, device: torch.device | str, skip_corrupt: bool = False,
                 threads: int | None = None):
        self.tvio = torchvision_io()
        self.size, self.channels, self.skip_corrupt = size, channels, skip_corrupt
        self.device, self.threads = torch.device(device), threads
        self._weights: dict[tuple[int, int], torch.Tensor] = {}
        self.mode = self.tvio.ImageReadMode.RGB if channels == 3 else self.tvio.ImageReadMode.GRAY

    def __call__(self, paths: Sequence[Path]) -> tuple[torch.Tensor, torch.Tensor]:
        """(squares N x channels x size x size on the device, bool kept-mask on the CPU) of one list."""
        [reads] = list(read_ahead([paths], self.channels, self.threads))
        return self._squares(paths, reads)

    def stream(self, paths: Sequence[Path], per_list: int = LIST) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(first index, squares on the host, kept mask) for each list of ``per_list`` files, in
        order: the next list's files are read while this one decodes, and each list's squares
        are copied to the host while the next one decodes."""
        starts = range(0, len(paths), per_list)
        lists = [paths[start:start + per_list] for start in starts]
        waiting = None
        for start, files, reads in zip(starts, lists, read_ahead(lists, self.channels, self.threads)):
            squares, kept = self._squares(files, reads)
            host, done = self._to_host(squares)
            if waiting is not None:
                yield self._ready(*waiting)
            waiting = (start, host, kept, done)
        if waiting is not None:
            yield self._ready(*waiting)

    def _to_host(self, squares: torch.Tensor):
        if self.device.type != "cuda":
            return squares.cpu(), None
        host = torch.empty(squares.shape, dtype=squares.dtype, pin_memory=True)
        host.copy_(squares, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    @staticmethod
    def _ready(start, host, kept, done):
        if done is not None:
            done.synchronize()
        return start, host, kept

    def _squares(self, paths: Sequence[Path], reads: list[_Read]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(paths)
        kept = torch.ones(n, dtype=torch.bool)
        images = decode_reads(self.tvio, paths, reads, self.mode, self.device,
                              lambda i, err: self._failed(kept, i, err))
        out = torch.zeros((n, self.channels, self.size, self.size), dtype=torch.uint8, device=self.device)
        _squares_into(out, images, self.size, self._weights)
        return out, kept

    def _failed(self, kept: torch.Tensor, i: int, err: DataError) -> None:
        if not self.skip_corrupt:
            raise err
        kept[i] = False

def pinned(jpegs: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """The files' bytes in one pinned buffer (a GPU's decoder copies them from there without
    staging), each file a view of it."""
    if not jpegs:
        return jpegs
    buffer = torch.empty(sum(len(d) for _, d in jpegs), dtype=torch.uint8, pin_memory=True)
    views, at = [], 0
    for i, d in jpegs:
        buffer[at:at + len(d)].copy_(d)
        views.append((i, buffer[at:at + len(d)]))
        at += len(d)
    return views


def decode_to_square(paths: list[Path], size: int, channels: int, device: torch.device | str,
                     skip_corrupt: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images N x channels x size x size on ``device``, bool kept-mask on the CPU) of the
    files ``paths``, as one list (:class:`SquareDecoder`)."""
    return SquareDecoder(size, channels, device, skip_corrupt)(paths)


def decode_one(path: Path, size: int, channels: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One file alone to its channels x size x size square: the per-image path (one decode
    call, the resize of one image) that :class:`SquareDecoder`'s lists must match."""
    tvio = torchvision_io()
    device = torch.device(device)
    r = _read(path, channels)
    if r.error is not None:
        raise r.error
    if r.jpeg is not None:
        mode = tvio.ImageReadMode.RGB if channels == 3 else tvio.ImageReadMode.GRAY
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
            try:
                img = tvio.decode_jpeg(r.jpeg, mode=mode, device=device)
            except RuntimeError as err:
                raise corrupt_error(path, RuntimeError(_reason(err))) from None
    else:
        img = r.image.to(device)
    out = torch.zeros((1, channels, size, size), dtype=torch.uint8, device=device)
    _squares_into(out, {0: img}, size)
    return out[0]


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


def _squares_into(out: torch.Tensor, images: dict[int, torch.Tensor], size: int,
                  weights: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
    """Each image's centre square (the whole shorter side) resized to size x size into ``out``;
    images of the same shape are resized together, at most ``GROUP`` at a time, into a list in
    shape order that one indexed copy puts in place. ``weights``: the centre filter matrices
    (:func:`filter_weights`) by (axis length, side), kept there for later calls."""
    if not images:
        return
    weights = {} if weights is None else weights

    def centre(length: int, side: int) -> torch.Tensor:
        if (length, side) not in weights:
            weights[length, side] = filter_weights(length, (length - side) / 2, side, size, out.device)
        return weights[length, side]

    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, img in images.items():
        groups[tuple(img.shape[1:])].append(i)
    order = [i for members in groups.values() for i in members]
    resized = torch.empty((len(order), *out.shape[1:]), dtype=torch.uint8, device=out.device)
    at = 0
    for (h, w), members in groups.items():
        side = min(h, w)
        wy, wx = centre(h, side), centre(w, side)
        for start in range(0, len(members), GROUP):
            chunk = members[start:start + GROUP]
            x = torch.stack([images[i] for i in chunk])
            if not h == w == size:                  # already the size: no resampling
                x = (wy @ (x.float() @ wx.T)).round_().clamp_(0, 255).to(torch.uint8)
            resized[at:at + len(chunk)] = x
            at += len(chunk)
    out.index_copy_(0, to_device(torch.tensor(order), out.device), resized)


def filter_weights(length: int, start: float, side: float, size: int, device: torch.device) -> torch.Tensor:
    """(size, length) float32 weights that resample the span [start, start + side) of an axis of
    ``length`` pixels to ``size`` pixels with Pillow's antialiased bilinear filter (a triangle
    as wide as the down-scaling factor, normalised; pixels beside the span take part as in
    Pillow's box resize). As matrices, unlike ``F.interpolate``, the span may start on a half
    pixel: the centre square of an image whose sides differ by an odd number of pixels does.
    (:func:`box_weights` for one axis, built on ``device``.)"""
    geometry = to_device(torch.tensor([[length, start, side]], dtype=torch.float64), torch.device(device))
    return box_weights(geometry[:, 0], geometry[:, 1], geometry[:, 2], size, length)[0]


def box_weights(lengths: torch.Tensor, starts: torch.Tensor, spans: torch.Tensor, size: int, extent: int) -> torch.Tensor:
    """(N, size, extent) float32: for each of N axes, :func:`filter_weights` of the span
    [start, start + span) of an axis of ``lengths`` pixels, built for all N at once (float64
    vectors on their device), the columns past an axis's length zero (its image padded there)."""
    device = lengths.device
    scale = spans / size
    support = scale.clamp(min=1.0)
    centre = starts[:, None] + (torch.arange(size, dtype=torch.float64, device=device) + 0.5)[None, :] * scale[:, None]
    k = torch.arange(extent, dtype=torch.float64, device=device) + 0.5
    weights = (1 - ((k[None, None, :] - centre[:, :, None]) / support[:, None, None]).abs()).clamp_(min=0)
    weights = weights * (k[None, None, :] < lengths[:, None, None])
    return (weights / weights.sum(dim=2, keepdim=True)).to(torch.float32)


CANVAS = 1 << 26
"""Elements of the padded float32 canvas one resize call fills (256 MB): images of very different
sizes are resized in several calls rather than all padded to the largest."""


def crops_of(images: list[torch.Tensor], boxes: list[tuple[float, float, float, float]], size: int) -> torch.Tensor:
    """N x C x size x size uint8: each image's box (top, left, height, width; fractional) resampled
    to size x size with Pillow's antialiased bilinear filter (as ``Image.resize(BILINEAR, box=)``),
    the images padded onto canvases of their largest sides so that one pair of batched matrix
    products serves many (a constant number of calls, not a few per image)."""
    device = images[0].device
    n, c = len(images), images[0].shape[0]
    out = torch.empty((n, c, size, size), dtype=torch.uint8, device=device)
    order = sorted(range(n), key=lambda i: -images[i].shape[1] * images[i].shape[2])
    start = 0
    while start < n:
        stop, h_max, w_max = start, 0, 0
        while stop < n:
            h, w = images[order[stop]].shape[1:]
            if stop > start and (stop - start + 1) * c * max(h_max, h) * max(w_max, w) > CANVAS:
                break
            h_max, w_max, stop = max(h_max, h), max(w_max, w), stop + 1
        members = order[start:stop]
        canvas = torch.zeros((len(members), c, h_max, w_max), dtype=torch.float32, device=device)
        for j, i in enumerate(members):
            canvas[j, :, :images[i].shape[1], :images[i].shape[2]] = images[i]
        geometry = to_device(torch.tensor([[images[i].shape[1], images[i].shape[2], *boxes[i]] for i in members],
                                          dtype=torch.float64), device)
        wy = box_weights(geometry[:, 0], geometry[:, 2], geometry[:, 4], size, h_max)
        wx = box_weights(geometry[:, 1], geometry[:, 3], geometry[:, 5], size, w_max)
        x = (wy[:, None] @ (canvas @ wx.transpose(1, 2)[:, None])).round_().clamp_(0, 255).to(torch.uint8)
        out.index_copy_(0, to_device(torch.tensor(members), device), x)
        start = stop
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``; to a GPU through pinned memory, without waiting for
    the device's queued work (a copy from pageable memory waits for it)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
