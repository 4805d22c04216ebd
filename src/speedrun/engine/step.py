"""One optimizer step: the loss (label smoothing, mixup/CutMix targets, distillation) and
the backward pass over micro-batches, with fp16 loss scaling where needed.

Gradient accumulation splits each batch into ``train.accumulate`` micro-batches and weights
each micro-batch's mean loss by its share of the batch, so the summed gradient equals the
full batch's for any split, uneven ones included (only batch-norm statistics differ).
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.mixing import mix_batch, mixed_loss
from ..errors import CheckpointError, RecipeError
from ..models import build_model
from ..recipe import Recipe, load_recipe
from .checkpoint import read_weights
from .runtime import Runtime


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Hinton et al. (2015): KL(teacher || student) of temperature-softened distributions,
    times T^2 so gradients keep their scale as T changes."""
    t = temperature
    return F.kl_div(F.log_softmax(student / t, dim=1), F.log_softmax(teacher / t, dim=1),
                    reduction="batchmean", log_target=True) * t * t


def backward_in_micro_batches(forward, x: torch.Tensor, targets: tuple, k: int, loss_fn,
                              scale=lambda loss: loss, no_sync=nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward over ``k`` micro-batches of (x, *targets); returns (mean loss, logits) of the
    whole batch, detached. ``loss_fn(logits, x_micro, *targets_micro)`` returns a mean loss.
    Under data parallelism, gradients are all-reduced once, with the last micro-batch's
    backward: the others run inside ``no_sync()``."""
    n = len(x)
    total, outputs = None, []
    for i, xm in enumerate(x.tensor_split(k)):
        tm = [t.tensor_split(k)[i] if isinstance(t, torch.Tensor) else t for t in targets]
        with no_sync() if i < k - 1 else nullcontext():
            logits = forward(xm)
            loss = loss_fn(logits, xm, *tm) * (len(xm) / n)
            scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
        # under CUDA graphs the next micro-batch's replay overwrites this output: keep a copy
        outputs.append(logits.detach() if k == 1 else logits.detach().clone())
    return total, outputs[0] if k == 1 else torch.cat(outputs)


def load_teacher(path: str | Path, device: torch.device, in_channels: int, num_classes: int) -> nn.Module:
    """A teacher model from a run's ``model.pt`` and the ``config.toml`` beside it; any
    problem is a :class:`CheckpointError` naming ``distill.teacher``."""
    path = Path(path).expanduser()
    config = path.parent / "config.toml"
    where = f"distill.teacher={path}"
    if not path.is_file():
        raise CheckpointError(f"{where}: no such file; give the model.pt of a finished run (its folder "
                              "holds config.toml too)")
    if not config.is_file():
        raise CheckpointError(f"{where}: no config.toml beside it; the teacher must be a run folder's model.pt")
    try:
        teacher_recipe = load_recipe(str(config))
    except RecipeError as err:
        raise CheckpointError(f"{where}: its run's config.toml cannot be used ({err})") from None
    state = read_weights(path, where)
    heads = [v for v in state.values() if v.ndim == 2]
    convs = [v for v in state.values() if v.ndim == 4]
    if not heads or not convs:
        raise CheckpointError(f"{where}: these weights are not those of a speedrun image classifier")
    classes, channels = heads[-1].shape[0], convs[0].shape[1]
    if (classes, channels) != (num_classes, in_channels):
        raise CheckpointError(f"{where}: the teacher classifies {classes} classes of {channels}-channel images; "
                              f"this run's data has {num_classes} classes of {in_channels}-channel images")
    model = build_model(teacher_recipe.model, in_channels, num_classes)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(f"{where}: the weights do not fit the model of its config.toml "
                              f"({str(err).splitlines()[0][:200]})") from None
    return model.to(device).eval().requires_grad_(False)


class Objective:
    """Computes and back-propagates the recipe's loss for a batch."""

    def __init__(self, recipe: Recipe, runtime: Runtime, forward, teacher: nn.Module | None = None,
                 no_sync=nullcontext):
        self.r, self.rt, self.forward, self.teacher, self.no_sync = recipe, runtime, forward, teacher, no_sync
        a = recipe.augment
        self.mixing = a.mixup > 0 or a.cutmix > 0
        self.scaler = torch.amp.GradScaler(runtime.device.type, enabled=runtime.precision == "fp16")

    def _loss(self, logits, x, y, y_partner, lam):
        r = self.r
        logits = logits.float()
        loss = mixed_loss(logits, y, y_partner, lam, r.train.label_smoothing) if self.mixing else \
            F.cross_entropy(logits, y, label_smoothing=r.train.label_smoothing)
        if self.teacher is not None:
            with torch.no_grad(), self.rt.autocast():
                t_logits = self.teacher(x).float()
            d = r.distill
            loss = (1 - d.alpha) * loss + d.alpha * distillation_loss(logits, t_logits, d.temperature)
        return loss

    def step(self, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward and optimizer step; returns (loss, correct count) on the device."""
        a = self.r.augment
        if self.mixing:
            x, y, y_partner, lam = mix_batch(x, y, a.mixup, a.cutmix, a.mix_prob, rng)
        else:
            y_partner, lam = y, 1.0

        def forward(xm):
            with self.rt.autocast():
                return self.forward(xm)

        loss, logits = backward_in_micro_batches(forward, x, (y, y_partner, lam), self.r.train.accumulate,
                                                 self._loss, self.scaler.scale, self.no_sync)
        if self.scaler.is_enabled():
            self.scaler.step(opt)             # skips the step (and lowers the scale) on inf/NaN
            self.scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, (logits.argmax(1) == y).sum()
