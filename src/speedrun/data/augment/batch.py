"""Batched augmentation on whole batches on the device: one random draw per image, no loops
over images, no worker processes.

Each operation is a pure function of the images and the random numbers it is given, so
tests can check it exactly; the samplers that draw those numbers are kept separate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .colour import (IMAGENET_EIGVAL, IMAGENET_EIGVEC, color_jitter, lighting, sample_jitter, sample_lighting,
                     sample_shift_and_scale, shift_and_scale)
from .resized_crop import random_resized_crop, sample_rrc_boxes, supersampling


def reflect_pad(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Pad the two spatial dims by mirroring (without repeating the edge pixel)."""
    return F.pad(x, (pad,) * 4, mode="reflect") if pad else x


def crop(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Crop image i of ``x`` at (top[i], left[i]) to ``size``, for the whole batch at once."""
    n, c, hp, wp = x.shape
    h, w = size
    rows = top[:, None] + torch.arange(h, device=x.device)            # (N, h)
    cols = left[:, None] + torch.arange(w, device=x.device)           # (N, w)
    x = x.gather(2, rows[:, None, :, None].expand(n, c, h, wp))
    return x.gather(3, cols[:, None, None, :].expand(n, c, h, w))


def flip(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mirror left-right the images where ``mask`` is true."""
    return torch.where(mask[:, None, None, None], x.flip(3), x)


def alternating_flip_mask(first: torch.Tensor, epoch: int) -> torch.Tensor:
    """Alternating flip: each image gets a random flip on epoch 0 and the opposite on each
    following epoch, so it is seen mirrored on exactly every other epoch (airbench, 2024)."""
    return first ^ bool(epoch % 2)


def cutout(x: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: int) -> torch.Tensor:
    """Zero a ``size`` x ``size`` square at (top[i], left[i]) in image i (clipped at the border).

    Zero is the mean colour once images are normalised (DeVries & Taylor, 2017)."""
    h, w = x.shape[2:]
    ys = torch.arange(h, device=x.device)[None, :]
    xs = torch.arange(w, device=x.device)[None, :]
    in_rows = (ys >= top[:, None]) & (ys < top[:, None] + size)       # (N, H)
    in_cols = (xs >= left[:, None]) & (xs < left[:, None] + size)     # (N, W)
    hole = in_rows[:, None, :, None] & in_cols[:, None, None, :]
    return x.masked_fill(hole, 0)


class BatchAugment:
    """Draws the random numbers for one epoch at once and applies the recipe's batched
    augmentations: crop (translate or random-resized), flip, cutout, colour jitter, brightness
    shift and contrast scale, lighting.

    For ``crop = "translate"`` the images handed to :meth:`__call__` are already
    reflect-padded by ``translate`` pixels, so a random crop is a random translation; the
    crop keeps the unpadded size of the images given, so batches of any size (progressive
    resizing) are translated. ``mean``/``std`` are the per-channel (C,) normalisation
    statistics in 0..255 units.
    """

    def __init__(self, cfg, n: int, image_size: tuple[int, int], generator: torch.Generator,
                 device: torch.device, mean: torch.Tensor | None = None, std: torch.Tensor | None = None,
                 resized_crop: bool = True, input_size: tuple[int, int] | None = None):
        """``input_size``: the size of the images random-resized crops are cut from, where it is
        not ``image_size`` (a decoded folder is stored larger than it is trained)."""
        self.cfg, self.n, self.size = cfg, n, image_size
        self.input_size = tuple(input_size) if input_size else image_size
        self.translate = cfg.translate if cfg.crop == "translate" else 0
        # the streamed pipeline cuts random-resized crops in its workers, not here
        self.resized_crop = cfg.crop == "random_resized" and resized_crop
        self.gen, self.device = generator, device
        self.mean = None if mean is None else mean.reshape(-1).to(device) / 255
        self.std = None if std is None else std.reshape(-1).to(device) / 255
        self.first_flip = self._bits() if cfg.flip == "alternating" else None

    def _bits(self) -> torch.Tensor:
        return torch.rand(self.n, generator=self.gen, device=self.device) < 0.5

    def _ints(self, high: int) -> torch.Tensor:
        return torch.randint(0, high, (self.n,), generator=self.gen, device=self.device)

    def draw(self, epoch: int) -> dict[str, torch.Tensor]:
        """Per-image random numbers for one epoch, indexed by image id."""
        cfg, r = self.cfg, {}
        if self.translate:
            r["top"], r["left"] = self._ints(2 * self.translate + 1), self._ints(2 * self.translate + 1)
        if cfg.low_res == "crop":
            # where a smaller (progressive) batch's window sits, as fractions of the free room
            r["win_y"] = torch.rand(self.n, generator=self.gen, device=self.device)
            r["win_x"] = torch.rand(self.n, generator=self.gen, device=self.device)
        if self.resized_crop:
            r["boxes"] = sample_rrc_boxes(self.n, *self.input_size, cfg.rrc_scale, cfg.rrc_ratio, self.gen, self.device)
        if cfg.flip == "random":
            r["flip"] = self._bits()
        elif cfg.flip == "alternating":
            r["flip"] = alternating_flip_mask(self.first_flip, epoch)
        if cfg.cutout:
            # centres as fractions of the image, so they fit images of any size
            r["cut_y"] = torch.rand(self.n, generator=self.gen, device=self.device)
            r["cut_x"] = torch.rand(self.n, generator=self.gen, device=self.device)
        if cfg.color_jitter:
            r["jitter"] = sample_jitter(self.n, cfg.color_jitter, self.gen, self.device).T   # (N, 3)
        if cfg.brightness or cfg.contrast:
            r["shift_scale"] = sample_shift_and_scale(self.n, cfg.brightness, cfg.contrast, self.gen, self.device)
        if cfg.lighting:
            r["lighting"] = sample_lighting(self.n, cfg.lighting, self.gen, self.device)
        return r

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, r: dict[str, torch.Tensor],
                 size: int | None = None) -> torch.Tensor:
        """Augment a batch; ``size``: the side of the random-resized crops when it is not the
        training size (progressive resizing cuts them straight at the epoch's size), or with
        ``low_res = crop`` the side of the window cut from the padded images."""
        t = self.translate
        if "win_y" in r and size and size < x.shape[2] - 2 * t:
            # low_res = crop: one random size x size window anywhere in the padded image (the
            # translation and the window in one cut), instead of the whole image resized
            room_y, room_x = x.shape[2] - size, x.shape[3] - size
            top = (r["win_y"][idx] * (room_y + 1)).long().clamp_(max=room_y)
            left = (r["win_x"][idx] * (room_x + 1)).long().clamp_(max=room_x)
            x = crop(x, top, left, (size, size))
        elif "top" in r:
            x = crop(x, r["top"][idx], r["left"][idx], (x.shape[2] - 2 * t, x.shape[3] - 2 * t))
        if "boxes" in r:
            out = (size, size) if size else self.size
            k = supersampling(self.input_size[0], out[0], self.cfg.rrc_antialias)
            x = random_resized_crop(x, r["boxes"][idx], out, k)
        if "flip" in r:
            x = flip(x, r["flip"][idx])
        if "jitter" in r:
            b, c, s = r["jitter"][idx].unbind(1)
            x = color_jitter(x, b, c, s, self.mean, self.std)
        if "shift_scale" in r:
            shift, scale = r["shift_scale"][idx].unbind(1)
            x = shift_and_scale(x, shift, scale)
        if "lighting" in r:
            x = lighting(x, r["lighting"][idx], IMAGENET_EIGVAL, IMAGENET_EIGVEC, self.std)
        if "cut_y" in r:
            h, w = x.shape[2:]
            half = self.cfg.cutout // 2
            top = (r["cut_y"][idx] * h).long() - half
            left = (r["cut_x"][idx] * w).long() - half
            x = cutout(x, top, left, self.cfg.cutout)
        return x
