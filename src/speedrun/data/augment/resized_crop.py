"""Random-resized crops (Szegedy et al., 2015) on whole batches on the device: the boxes are
drawn for a batch at once and every image is resampled by one affine grid.

As in ``batch.py``, the operation is a pure function of the images and the numbers it is
handed, and the sampler that draws those numbers is separate; nothing is read back to the
host, so a training step stays free of synchronisation.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

RRC_TRIES = 10
"""Candidate boxes drawn per image before falling back to a centre crop."""


def supersampling(stored: int, out: int, antialias: bool) -> int:
    """Sub-samples per output pixel side for crops cut from ``stored`` px images at ``out`` px:
    with ``antialias``, the ratio of the two rounded (1 where the crops are not shrunk by about
    1.5 times or more), at most 4; without, 1."""
    return max(1, min(4, round(stored / out))) if antialias else 1


def random_resized_crop(x: torch.Tensor, boxes: torch.Tensor, out_size: tuple[int, int],
                        supersample: int = 1) -> torch.Tensor:
    """Resample box i = (top, left, height, width), in input pixels, of image i to ``out_size``.

    One affine grid for the whole batch, sampled bilinearly. The grid is built and sampled
    in fp32: in bf16 its coordinates would be off by up to half a pixel on a 224 px image.

    ``supersample`` k > 1 samples a grid k times finer and averages each k x k block: each
    output pixel becomes the mean of k x k bilinear samples spread over its footprint, an area
    filter that keeps a crop shrunk by up to about k times free of aliasing (bilinear sampling
    alone reads only the four pixels nearest each output pixel's centre)."""
    n, c, h, w = x.shape
    top, left, bh, bw = boxes.to(x.device, torch.float32).unbind(1)
    theta = torch.zeros(n, 2, 3, device=x.device)
    # With align_corners=False, -1 and +1 are the outer edges of the edge pixels, so a box
    # spanning pixel edges [left, left + bw) has centre (2 left + bw) / W - 1, half-width bw / W.
    theta[:, 0, 0] = bw / w
    theta[:, 0, 2] = (2 * left + bw) / w - 1
    theta[:, 1, 1] = bh / h
    theta[:, 1, 2] = (2 * top + bh) / h - 1
    k = supersample
    grid = F.affine_grid(theta, [n, c, out_size[0] * k, out_size[1] * k], align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    if k > 1:
        out = F.avg_pool2d(out, k)
    return out.to(x.dtype)


def centre_fallback(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int]:
    """Height and width of the largest centred box whose aspect lies in ``ratio``."""
    aspect = width / height
    if aspect < ratio[0]:
        return round(width / ratio[0]), width
    if aspect > ratio[1]:
        return height, round(height * ratio[1])
    return height, width


def sample_rrc_boxes(n: int, height: int, width: int, scale: tuple[float, float],
                     ratio: tuple[float, float], generator: torch.Generator,
                     device: torch.device) -> torch.Tensor:
    """Draw (N, 4) int64 boxes (top, left, height, width) as in Szegedy et al. (2015).

    Area fraction uniform in ``scale``, log aspect (width / height) uniform in log ``ratio``;
    each image takes the first of ``RRC_TRIES`` candidates that fits inside the image, at a
    uniform position, and images with none that fits get the centred fallback box."""
    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=generator, device=device)

    area = uniform((n, RRC_TRIES), *scale) * (height * width)
    aspect = uniform((n, RRC_TRIES), math.log(ratio[0]), math.log(ratio[1])).exp()
    bw = (area * aspect).sqrt().round().long()
    bh = (area / aspect).sqrt().round().long()
    fits = (bw >= 1) & (bw <= width) & (bh >= 1) & (bh <= height)
    first = fits.int().argmax(1, keepdim=True)                        # first True, or 0 if none
    found = fits.any(1)
    fh, fw = centre_fallback(height, width, ratio)
    bh = torch.where(found, bh.gather(1, first).squeeze(1), fh)
    bw = torch.where(found, bw.gather(1, first).squeeze(1), fw)
    # a uniform position among the valid ones; the fallback box is centred
    top = (torch.rand(n, generator=generator, device=device) * (height - bh + 1)).long()
    left = (torch.rand(n, generator=generator, device=device) * (width - bw + 1)).long()
    top = torch.where(found, top, (height - fh) // 2)
    left = torch.where(found, left, (width - fw) // 2)
    return torch.stack([top, left, bh, bw], 1)
