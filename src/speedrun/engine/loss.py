"""The training loss of one micro-batch, in one place.

Cross entropy with the recipe's label smoothing, and on top of it, where the recipe asks:

- **mixup / CutMix** (``augment.mixup``, ``augment.cutmix``): each step's draws are made on
  the host from the run's seed before the run starts (:class:`~speedrun.data.augment.mixing.MixPlan`)
  and looked up on the device with the step counter; the inputs are mixed with their
  partners (the batch reversed) and the loss weights the two labels alike (:func:`mixed_loss`);
- **loss-based pruning** (``data.prune``): each image's loss weighted by the pruner's weight
  for it, and handed back so that the pruner can record it;
- **distillation** (``distill.teacher``): the teacher's softened outputs on the same (mixed)
  inputs, mixed into the loss with weight ``distill.alpha`` (:func:`distillation_loss`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.augment.mixing import MixPlan, apply_mix
from ..data.pipeline.pruning import LossPruner
from ..recipe import Recipe


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Hinton et al. (2015): KL(teacher || student) of temperature-softened distributions,
    times T^2 so gradients keep their scale as T changes."""
    t = temperature
    return F.kl_div(F.log_softmax(student / t, dim=1), F.log_softmax(teacher / t, dim=1),
                    reduction="batchmean", log_target=True) * t * t


def mixed_loss(logits: torch.Tensor, y: torch.Tensor, y_partner: torch.Tensor, lam,
               smoothing: float) -> torch.Tensor:
    """lam * CE(y) + (1 - lam) * CE(y_partner), each with label smoothing: the cross entropy
    against the mixed (smoothed) one-hot targets, without building them. ``lam`` is a number
    (an unmixed batch, lam 1, costs one CE) or a device tensor (both CEs, weighted on the
    device)."""
    loss = F.cross_entropy(logits, y, label_smoothing=smoothing)
    if isinstance(lam, (int, float)) and lam == 1:
        return loss
    return lam * loss + (1 - lam) * F.cross_entropy(logits, y_partner, label_smoothing=smoothing)


class TrainingLoss:
    """The loss of ``recipe`` (see the module docstring). ``step_shapes``: the (height, width)
    of each step's batch (CutMix boxes are drawn for them); ``autocast``: the context the
    teacher runs in. The mixing tables are allocated once and refilled for each run
    (:meth:`new_run`); the pruner is the run's, attached by the loop."""

    def __init__(self, recipe: Recipe, step_shapes: list[tuple[int, int]], device: torch.device,
                 teacher: nn.Module | None = None, autocast=None):
        a = recipe.augment
        self.smoothing = recipe.train.label_smoothing
        self.distill, self.teacher, self.autocast = recipe.distill, teacher, autocast
        self.weighted = bool(recipe.data.prune)
        self._mix_args = (a.mixup, a.cutmix, a.mix_prob, step_shapes)
        self.mixing = a.mixup > 0 or a.cutmix > 0
        self.mix = MixPlan(*self._mix_args, recipe.train.seed, device) if self.mixing else None
        self.pruner: LossPruner | None = None

    def new_run(self, seed: int) -> None:
        """The mixing draws of a run from ``seed``."""
        if self.mix is not None:
            self.mix.refill(MixPlan(*self._mix_args, seed, torch.device("cpu")))

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.mix.pixel_lam, self.mix.box, self.mix.loss_lam] if self.mix is not None else []

    # -- per step ---------------------------------------------------------------------------
    def image_weights(self, x: torch.Tensor, parts: int) -> list[torch.Tensor | None]:
        """Each micro-batch's per-image loss weights (``data.prune``), or Nones. Without a
        pruner (the warm-up of a pruned run) the weights are ones, so that the step compiles
        the weighted graph the run will use."""
        if self.pruner is not None:
            return list(self.pruner.batch_weights().tensor_split(parts))
        if self.weighted:
            return list(torch.ones(len(x), device=x.device).tensor_split(parts))
        return [None] * parts

    def record(self, per_image: list[torch.Tensor]) -> None:
        """Hand the step's per-image losses to the pruner."""
        if self.pruner is not None:
            self.pruner.record(torch.cat(per_image))

    def mix_inputs(self, x: torch.Tensor, counter: torch.Tensor, total: int):
        """(the inputs mixed by the draws of step ``counter % total``, the weight of each
        image's own label), or (x, None) without mixing."""
        if not self.mixing:
            return x, None
        pixel_lam, box, lam = self.mix.at(counter % total)
        return apply_mix(x, pixel_lam, box), lam

    def __call__(self, logits: torch.Tensor, y: torch.Tensor, x: torch.Tensor, lam: torch.Tensor | None,
                 weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the micro-batch's loss, each image's loss when ``weight`` is given, else None):
        ``logits`` (fp32) of the model on ``x`` (the mixed inputs), ``lam`` from
        :meth:`mix_inputs`."""
        each = None
        if weight is not None:
            each = F.cross_entropy(logits, y, label_smoothing=self.smoothing, reduction="none")
            loss = (each * weight).mean()
            each = each.detach()
        elif self.mixing:
            loss = mixed_loss(logits, y, y.flip(0), lam, self.smoothing)
        else:
            loss = F.cross_entropy(logits, y, label_smoothing=self.smoothing)
        if self.teacher is not None:
            with torch.no_grad(), self.autocast():
                t_logits = self.teacher(x).float()
            d = self.distill
            loss = (1 - d.alpha) * loss + d.alpha * distillation_loss(logits, t_logits, d.temperature)
        return loss, each
