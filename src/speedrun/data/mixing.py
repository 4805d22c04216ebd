"""Mixing images and their labels: mixup (Zhang et al., 2018) and CutMix (Yun et al., 2019),
with the matching loss. The per-batch numbers are scalars that steer Python control flow, so
they come from a host ``numpy.random.Generator``, fixed by its seed; nothing is read back
from the device."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

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
