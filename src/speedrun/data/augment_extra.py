"""ImageNet-style batched augmentations: random-resized crop, colour jitter, PCA lighting,
mixup and CutMix.

As in ``augment.py``, each operation is a pure function of the images and the random numbers
it is handed, and the samplers that draw those numbers are separate. Images are normalised
(N, C, H, W) tensors; nothing here reads a tensor back to the host, so a training step stays
free of synchronisation. Mixing draws its per-batch numbers from a host
``numpy.random.Generator`` instead, because they are scalars that steer Python control flow.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------
# Random-resized crop
# ------------------------------------------------------------------------------------------

RRC_TRIES = 10
"""Candidate boxes drawn per image before falling back to a centre crop."""


def random_resized_crop(x: torch.Tensor, boxes: torch.Tensor, out_size: tuple[int, int]) -> torch.Tensor:
    """Resample box i = (top, left, height, width), in input pixels, of image i to ``out_size``.

    One affine grid for the whole batch, sampled bilinearly. The grid is built and sampled
    in fp32: in bf16 its coordinates would be off by up to half a pixel on a 224 px image."""
    n, c, h, w = x.shape
    top, left, bh, bw = boxes.to(x.device, torch.float32).unbind(1)
    theta = torch.zeros(n, 2, 3, device=x.device)
    # With align_corners=False, -1 and +1 are the outer edges of the edge pixels, so a box
    # spanning pixel edges [left, left + bw) has centre (2 left + bw) / W - 1, half-width bw / W.
    theta[:, 0, 0] = bw / w
    theta[:, 0, 2] = (2 * left + bw) / w - 1
    theta[:, 1, 1] = bh / h
    theta[:, 1, 2] = (2 * top + bh) / h - 1
    grid = F.affine_grid(theta, [n, c, *out_size], align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.to(x.dtype)


def _centre_fallback(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int]:
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
    fh, fw = _centre_fallback(height, width, ratio)
    bh = torch.where(found, bh.gather(1, first).squeeze(1), fh)
    bw = torch.where(found, bw.gather(1, first).squeeze(1), fw)
    # a uniform position among the valid ones; the fallback box is centred
    top = (torch.rand(n, generator=generator, device=device) * (height - bh + 1)).long()
    left = (torch.rand(n, generator=generator, device=device) * (width - bw + 1)).long()
    top = torch.where(found, top, (height - fh) // 2)
    left = torch.where(found, left, (width - fw) // 2)
    return torch.stack([top, left, bh, bw], 1)


# ------------------------------------------------------------------------------------------
# Colour: jitter and PCA lighting
# ------------------------------------------------------------------------------------------

LUMA_WEIGHTS = (0.299, 0.587, 0.114)
"""ITU-R BT.601 weights of R, G, B in the grey level."""

IMAGENET_EIGVAL = torch.tensor([0.2175, 0.0188, 0.0045])
"""Eigenvalues of the covariance of ImageNet RGB pixels in the 0..1 scale (as published)."""

IMAGENET_EIGVEC = torch.tensor([[-0.5675, 0.7192, 0.4009],
                                [-0.5808, -0.0045, -0.8140],
                                [-0.5836, -0.6948, 0.4203]])
"""The matching eigenvectors, one per column."""


def _grey(p: torch.Tensor) -> torch.Tensor:
    """Per-pixel grey level (N, 1, H, W) of images in the 0..1 scale."""
    if p.shape[1] == 1:
        return p
    if p.shape[1] != 3:
        raise ValueError(f"colour jitter needs 1 or 3 channels, got {p.shape[1]}")
    r, g, b = p.unbind(1)
    return (LUMA_WEIGHTS[0] * r + LUMA_WEIGHTS[1] * g + LUMA_WEIGHTS[2] * b)[:, None]


def _per_image(f: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return f.to(like.device, like.dtype)[:, None, None, None]


def color_jitter(x: torch.Tensor, brightness: torch.Tensor, contrast: torch.Tensor,
                 saturation: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Scale brightness, then contrast, then saturation of image i by the (N,) factors.

    Works on pixels in the 0..1 scale (undoing the per-channel ``mean``/``std``
    normalisation and redoing it after), clipping to [0, 1] after each step as if each were
    applied to a stored picture. Contrast blends with the image's mean grey, saturation with
    each pixel's grey; a factor of 1 leaves the image as it is."""
    mean = mean.to(x.device, x.dtype)[:, None, None]
    std = std.to(x.device, x.dtype)[:, None, None]
    p = x * std + mean
    p = (p * _per_image(brightness, p)).clamp(0, 1)
    c = _per_image(contrast, p)
    p = (c * p + (1 - c) * _grey(p).mean((2, 3), keepdim=True)).clamp(0, 1)
    s = _per_image(saturation, p)
    p = (s * p + (1 - s) * _grey(p)).clamp(0, 1)
    return (p - mean) / std


def sample_jitter(n: int, strength: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """(3, N) factors uniform in [1 - strength, 1 + strength]: brightness, contrast, saturation
    rows, to be unpacked into :func:`color_jitter`."""
    return 1 + strength * (2 * torch.rand(3, n, generator=generator, device=device) - 1)


def lighting(x: torch.Tensor, alpha: torch.Tensor, eigval: torch.Tensor, eigvec: torch.Tensor,
             std: torch.Tensor) -> torch.Tensor:
    """Add the colour eigvec @ (alpha[i] * eigval) to every pixel of image i (Krizhevsky et
    al., 2012): a random change of illuminant along the principal axes of pixel colour.

    The shift is in 0..1 pixel units, divided by the per-channel ``std`` to match the
    normalised images. Grey images (C=1) have no colour axes and are returned unchanged."""
    if x.shape[1] == 1:
        return x
    f32 = dict(device=x.device, dtype=torch.float32)
    shift = (alpha.to(**f32) * eigval.to(**f32)) @ eigvec.to(**f32).T    # (N, 3) in pixels
    return x + (shift / std.to(**f32)).to(x.dtype)[:, :, None, None]


def sample_lighting(n: int, strength: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """(N, 3) lighting coefficients alpha ~ N(0, strength^2), one per image and component."""
    return strength * torch.randn(n, 3, generator=generator, device=device)


# ------------------------------------------------------------------------------------------
# Mixup and CutMix
# ------------------------------------------------------------------------------------------

def _mixup(x: torch.Tensor, lam: float) -> torch.Tensor:
    """Blend each image with its partner, weight ``lam`` on itself (Zhang et al., 2018)."""
    return lam * x + (1 - lam) * x.flip(0)


def _cutmix(x: torch.Tensor, lam: float, rng: np.random.Generator) -> tuple[torch.Tensor, float]:
    """Paste a box of about 1 - ``lam`` of the area from each image's partner (Yun et al., 2019).

    The box is centred uniformly and clipped at the border, so the returned weight is
    recomputed from the pixels actually kept."""
    h, w = x.shape[2:]
    cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
    cy, cx = int(rng.integers(h)), int(rng.integers(w))
    top, bottom = max(cy - cut_h // 2, 0), min(cy - cut_h // 2 + cut_h, h)
    left, right = max(cx - cut_w // 2, 0), min(cx - cut_w // 2 + cut_w, w)
    out = x.clone()
    out[:, :, top:bottom, left:right] = x[:, :, top:bottom, left:right].flip(0)
    return out, 1 - (bottom - top) * (right - left) / (h * w)


def mix_batch(x: torch.Tensor, y: torch.Tensor, mixup_alpha: float, cutmix_alpha: float,
              prob: float, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Mix the batch with its reverse by mixup or CutMix; returns (x, y, y_partner, lam).

    With probability ``prob`` the batch is mixed, by whichever method has alpha > 0 (each
    with probability 1/2 when both have), lam ~ Beta(alpha, alpha). An unmixed batch comes
    back as it is, with y as its own partner and lam = 1. All draws come from the host
    ``rng``, so the mix is fixed by its seed and needs nothing from the device."""
    if not (mixup_alpha > 0 or cutmix_alpha > 0) or rng.random() >= prob:
        return x, y, y, 1.0
    use_mixup = cutmix_alpha <= 0 or (mixup_alpha > 0 and rng.random() < 0.5)
    alpha = mixup_alpha if use_mixup else cutmix_alpha
    lam = float(rng.beta(alpha, alpha))
    if use_mixup:
        return _mixup(x, lam), y, y.flip(0), lam
    x, lam = _cutmix(x, lam, rng)
    return x, y, y.flip(0), lam


def mixed_targets(y: torch.Tensor, y_partner: torch.Tensor, lam: float, num_classes: int,
                  smoothing: float) -> torch.Tensor:
    """(N, K) target distribution lam * smooth(onehot(y)) + (1 - lam) * smooth(onehot(y_partner)),
    with smooth(t) = (1 - smoothing) t + smoothing / K, the target of F.cross_entropy's
    label smoothing."""
    def smooth(labels):
        return (1 - smoothing) * F.one_hot(labels, num_classes).float() + smoothing / num_classes
    return lam * smooth(y) + (1 - lam) * smooth(y_partner)


def mixed_loss(logits: torch.Tensor, y: torch.Tensor, y_partner: torch.Tensor, lam: float,
               smoothing: float) -> torch.Tensor:
    """lam * CE(y) + (1 - lam) * CE(y_partner): the cross entropy against
    :func:`mixed_targets`, without building the (N, K) targets. An unmixed batch costs one CE."""
    loss = F.cross_entropy(logits, y, label_smoothing=smoothing)
    if lam == 1:
        return loss
    return lam * loss + (1 - lam) * F.cross_entropy(logits, y_partner, label_smoothing=smoothing)
