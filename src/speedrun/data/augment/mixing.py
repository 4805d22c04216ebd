"""Mixing images: mixup (Zhang et al., 2018) and CutMix (Yun et al., 2019); the loss that
weights the two labels alike is :func:`speedrun.engine.loss.mixed_loss`. The per-batch
numbers are scalars that steer Python control flow, so they come from a host
``numpy.random.Generator``, fixed by its seed; nothing is read back from the device."""
from __future__ import annotations

import math

import numpy as np
import torch

def draw_mix(mixup_alpha: float, cutmix_alpha: float, prob: float, h: int, w: int,
             rng: np.random.Generator) -> tuple[float, tuple[int, int, int, int], float]:
    """One step's mixing, drawn on the host: (weight of each image on itself in the pixel
    blend, CutMix box (top, bottom, left, right), weight of its own label in the loss).

    With probability ``prob`` the batch is mixed, by whichever method has alpha > 0 (each
    with probability 1/2 when both have), lam ~ Beta(alpha, alpha). Mixup blends the pixels
    with weight lam (Zhang et al., 2018); CutMix pastes a box of about 1 - lam of the area
    from the partner, centred uniformly and clipped at the border, and its label weight is
    the area actually kept (Yun et al., 2019). Unmixed: (1, empty box, 1)."""
    none = (1.0, (0, 0, 0, 0), 1.0)
    if not (mixup_alpha > 0 or cutmix_alpha > 0) or rng.random() >= prob:
        return none
    use_mixup = cutmix_alpha <= 0 or (mixup_alpha > 0 and rng.random() < 0.5)
    alpha = mixup_alpha if use_mixup else cutmix_alpha
    lam = float(rng.beta(alpha, alpha))
    if use_mixup:
        return lam, (0, 0, 0, 0), lam
    cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
    cy, cx = int(rng.integers(h)), int(rng.integers(w))
    top, bottom = max(cy - cut_h // 2, 0), min(cy - cut_h // 2 + cut_h, h)
    left, right = max(cx - cut_w // 2, 0), min(cx - cut_w // 2 + cut_w, w)
    return 1.0, (top, bottom, left, right), 1 - (bottom - top) * (right - left) / (h * w)


def apply_mix(x: torch.Tensor, pixel_lam, box) -> torch.Tensor:
    """Each image blended with its partner (the batch reversed) with weight ``pixel_lam`` on
    itself, then the partner's pixels pasted inside ``box`` = (top, bottom, left, right).
    Works on Python numbers and on device tensors alike (inside the compiled step, where the
    step's draws are looked up on the device), with no data-dependent control flow."""
    partner = x.flip(0)
    h, w = x.shape[2:]
    rows = torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device)
    top, bottom, left, right = box
    inside = ((rows >= top) & (rows < bottom))[:, None] & ((cols >= left) & (cols < right))[None, :]
    blended = x * pixel_lam + partner * (1 - pixel_lam)
    return torch.where(inside, partner, blended.to(x.dtype))


class MixPlan:
    """Every step's mixing for a whole run, drawn on the host from the run's seed before it
    starts (so a resumed run draws the same), and kept on the device as three tables that
    the compiled step indexes with its step counter: nothing changes from step to step but
    a device tensor, and nothing is read back."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, prob: float, sizes: list[tuple[int, int]],
                 seed: int, device: torch.device):
        rng = np.random.default_rng([seed, 0x6D6978])          # its own stream, fixed by the seed
        draws = [draw_mix(mixup_alpha, cutmix_alpha, prob, h, w, rng) for h, w in sizes]
        self.pixel_lam = torch.tensor([d[0] for d in draws], dtype=torch.float32, device=device)
        self.box = torch.tensor([d[1] for d in draws], dtype=torch.int64, device=device).reshape(len(draws), 4)
        self.loss_lam = torch.tensor([d[2] for d in draws], dtype=torch.float32, device=device)

    def refill(self, other: "MixPlan") -> None:
        """Take another plan's draws into these tensors (a new run in the same tensors)."""
        for mine, theirs in ((self.pixel_lam, other.pixel_lam), (self.box, other.box),
                             (self.loss_lam, other.loss_lam)):
            mine.copy_(theirs)

    def at(self, step: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        """(pixel weight, box, label weight) of step ``step`` (a 0-d device tensor)."""
        i = step.reshape(1)
        box = self.box.index_select(0, i)[0]
        return self.pixel_lam.index_select(0, i)[0], tuple(box.unbind()), self.loss_lam.index_select(0, i)[0]
