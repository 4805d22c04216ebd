"""One training step, top to bottom: the only place in the training code that runs a
backward pass. Training, the warm-up, the batch finder and the data/model time split all
call :class:`TrainStep`.

A step, for a batch ``(x, y)`` already augmented by the data pipeline:

1. **Forward and loss** (``_forward_loss``), once per micro-batch: the step's mixup/CutMix
   draws are looked up on the device, autocast runs the model, the loss (label smoothing,
   mixed labels, distillation from a teacher) is weighted by the micro-batch's share of the
   batch and, with fp16, multiplied by the loss scale. Compiled, this is one graph, and
   AOTAutograd compiles its backward as a second one.
2. **Backward**, once per micro-batch; under data parallelism every micro-batch but the
   last runs in ``no_sync()``, so gradients are all-reduced once per step.
3. **Update** (``_update``): the schedule's LR and momentum for this step, read from device
   tables with the step counter; with fp16, the gradients checked for overflow and read
   unscaled (out of place) by the optimizer, on the device (an overflowing step is undone on
   the device, not skipped by a host decision); the optimizer (SGD groups, LARS/LAMB, orthogonal filter updates); the weight
   averaging (its every-N condition on the device); the step's loss, correct count and
   overflow flag written into the run's metrics table; the counter advanced. Compiled,
   this is the third graph.

Everything that changes from step to step (the counter, LR and momentum, the averaging
decay and its every-N condition, the whitening-bias freeze, mixing weights and CutMix boxes,
the loss scale) is a device tensor, so the compiled step never recompiles as the run
advances, and nothing in a step reads a value back to the host: the loop reads the metrics
table once per epoch. ``benchmarks/step_structure.py`` counts graphs, graph breaks, eager
ops and host syncs per step, and tests keep them from creeping back. (An eager step in one
process instead takes the frozen whitening bias out of the backward: see
:func:`drop_frozen_grads`.)
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.mixing import MixPlan, apply_mix, mixed_loss
from ..errors import CheckpointError, RecipeError
from ..models import build_model
from ..optim import build_averager, build_optimizer, lr_multipliers, momenta
from ..optim.orthogonal import ns_dtype
from ..recipe import Recipe, load_recipe
from .checkpoint import read_weights
from .runtime import Runtime, compile_function

WHITEN_FROZEN = frozenset({"whiten_bias"})
"""Parameter groups whose LR drops to 0 after ``model.whiten.train_bias_epochs``."""


def drop_frozen_grads(compiled: bool, single_process: bool) -> bool:
    """Whether a frozen parameter group (the whitening bias after its epochs) is taken out of
    the backward (``requires_grad`` off) rather than kept at LR 0: only in an eager step of one
    process. A compiled step would recompile at the change, and DDP reduces a fixed set of
    gradients."""
    return not compiled and single_process


def resized_in_step(recipe: Recipe) -> bool:
    """Whether progressive resizing happens inside the training step (``augment.low_res =
    "bilinear_in_step"``) rather than in the data pipeline."""
    return bool(recipe.data.progressive) and recipe.augment.low_res == "bilinear_in_step"


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Hinton et al. (2015): KL(teacher || student) of temperature-softened distributions,
    times T^2 so gradients keep their scale as T changes."""
    t = temperature
    return F.kl_div(F.log_softmax(student / t, dim=1), F.log_softmax(teacher / t, dim=1),
                    reduction="batchmean", log_target=True) * t * t


def load_teacher(path: str | Path, runtime: Runtime, in_channels: int, num_classes: int) -> nn.Module:
    """A teacher model from a run's ``model.pt`` and the ``config.toml`` beside it, on the
    runtime's device and in its memory layout (compiled with the step where the step is);
    any problem is a :class:`CheckpointError` naming ``distill.teacher``."""
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
    return runtime.place(model).eval().requires_grad_(False)


class LossScale:
    """Dynamic fp16 loss scaling on the device (the rule of torch.amp.GradScaler, with its
    defaults: start at 2**16, halve on overflow, double after 2,000 clean steps), without
    GradScaler's read-back of the overflow flag at every step."""

    INIT, GROWTH, BACKOFF, INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000

    def __init__(self, device: torch.device):
        self.scale = torch.full((), self.INIT, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.scale.fill_(self.INIT)
        self.growth_tracker.zero_()

    def overflowed(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The overflow flag (1-element float tensor: 1 where any of the scaled gradients is
        inf or NaN). Read from each gradient's sum of magnitudes (one foreach kernel, traced by
        dynamo), which any inf or NaN makes inf or NaN on every device; a finite gradient whose
        magnitudes sum past fp32's largest value (3.4e38) counts as an overflow too. The
        gradients are not touched: the optimizer reads them times :meth:`inverse` (GradScaler
        divides them in place, but they are new tensors every step, so an update that wrote
        them could not run as a CUDA graph)."""
        if not grads:
            return torch.zeros(1, device=self.scale.device)
        sums = torch.stack(torch._foreach_norm(grads, 1))
        return (~torch.isfinite(sums).all()).float().reshape(1)

    def inverse(self) -> torch.Tensor:
        return self.scale.reciprocal()

    def update(self, found: torch.Tensor) -> None:
        torch._amp_update_scale_(self.scale, self.growth_tracker, found, self.GROWTH, self.BACKOFF, self.INTERVAL)


class TrainStep:
    """One optimizer step of ``recipe`` for ``model``, called with a batch: see the module
    docstring. ``module`` is what the forward calls (the model, or its DDP wrapper); the
    optimizer, averaging and loss-scale state, the schedule tables, the step counter and
    the run's metrics table are allocated once and reset in place for each run, so a
    compiled step is compiled once per process and serves every run of a benchmark."""

    def __init__(self, recipe: Recipe, runtime: Runtime, model: nn.Module, module: nn.Module, total_steps: int,
                 steps_per_epoch: int, step_sizes: list[tuple[int, int]], teacher: nn.Module | None = None,
                 no_sync=nullcontext):
        r, device = recipe, runtime.device
        self.r, self.rt, self.model, self.module, self.teacher = r, runtime, model, module, teacher
        self.no_sync, self.total, self.step_sizes = no_sync, total_steps, step_sizes
        self.k = r.train.accumulate
        self.opt = build_optimizer(model, r.optim, r.data.batch_size,
                                   ns_dtype(r.optim.ns_precision, device.type, runtime.precision))
        self.averager = build_averager(model, r.averaging, total_steps)
        self.scaler = LossScale(device) if runtime.precision == "fp16" else None
        # the schedule, per step: on the host for logs, on the device for the step
        self.lrs = lr_multipliers(r.schedule, total_steps, steps_per_epoch)
        self.moms = momenta(r.schedule, r.optim.momentum, total_steps)
        self.lr_table = torch.tensor(self.lrs, dtype=torch.float32, device=device)
        self.mom_table = None if self.moms is None else torch.tensor(self.moms, dtype=torch.float32, device=device)
        whitened = getattr(model, "whiten", None) is not None
        self.whiten_steps = round(r.model.whiten.train_bias_epochs * steps_per_epoch) if whitened else 0
        a = r.augment
        self.mixing = a.mixup > 0 or a.cutmix > 0
        self.mix = MixPlan(a.mixup, a.cutmix, a.mix_prob, step_sizes, r.train.seed, device) if self.mixing else None
        self.counter = torch.zeros((), dtype=torch.int64, device=device)
        self.host_step = 0            # the counter's value, known on the host without asking the device
        self.metrics = torch.zeros(total_steps, 3, device=device)     # loss, correct count, overflow skipped
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.pruner = None            # the run's LossPruner (data.prune), set by the loop
        # Eager, in one process, the frozen whitening bias stops asking for a gradient: the
        # backward then skips the first convolution's input gradient and the activation after
        # the whitening (a full-resolution map), with the same weights as the LR-0 freeze.
        # Compiled steps and DDP keep the LR-0 freeze (a fixed graph and a fixed set of
        # gradients to reduce).
        self.freezable = [p for g in self.opt.param_groups if g["name"] in WHITEN_FROZEN for p in g["params"]] \
            if drop_frozen_grads(runtime.compile, module is model) else []
        self._forward_loss, self._update = self.forward_loss, self.update
        if runtime.compile:
            if runtime.cuda_graphs:                   # CUDA graphs read and write these at fixed addresses
                live = self.averager.live if self.averager is not None else []
                for t in {id(t): t for t in self.state_tensors() + self.params + live}.values():
                    torch._dynamo.mark_static_address(t)
            self._forward_loss = compile_function(self.forward_loss, runtime)
            self._update = compile_function(self.update, runtime)

    # ======================================================================================
    # The step
    # ======================================================================================
    def __call__(self, x: torch.Tensor, y: torch.Tensor, size: int | None = None) -> None:
        """Train on one batch; its loss and correct count go to :attr:`metrics`. ``size``: the
        side the batch is shrunk to inside the step (``augment.low_res = "bilinear_in_step"``)."""
        losses, corrects = [], []
        if self.freezable:
            needed = self.host_step < self.whiten_steps
            for p in self.freezable:
                p.requires_grad_(needed)
        copy_outputs = self.k > 1 and self.rt.cuda_graphs     # the next replay would overwrite them
        if self.pruner is not None:
            weights = self.pruner.batch_weights().tensor_split(self.k)
        elif self.r.data.prune:       # the warm-up: the weighted graph the run will use (no recompile)
            weights = torch.ones(len(x), device=x.device).tensor_split(self.k)
        else:
            weights = [None] * self.k
        per_image = []
        for i, (xm, ym, wm) in enumerate(zip(x.tensor_split(self.k), y.tensor_split(self.k), weights)):
            with self.no_sync() if i < self.k - 1 else nullcontext():
                scaled, loss, correct, each = self._forward_loss(xm, ym, len(xm) / len(x), wm, size)
                scaled.backward()
            losses.append(loss.clone() if copy_outputs else loss)
            corrects.append(correct.clone() if copy_outputs else correct)
            per_image.append(each)
        if self.pruner is not None:
            self.pruner.record(torch.cat(per_image))
        self._update(losses, corrects)
        self.host_step += 1                           # (outside the compiled update, which must not read it)
        for p in self.params:
            p.grad = None

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor, share: float, weight: torch.Tensor | None = None,
                     size: int | None = None):
        """(loss to back-propagate, loss, correct count, each image's loss or None) of one
        micro-batch that is ``share`` of the batch; ``weight``: per-image loss weights
        (``data.prune``), whose images' own losses are then returned too; ``size``: the side
        to shrink the images to first (plain bilinear, fused into the compiled step)."""
        r = self.r
        if size is not None and size != x.shape[-1]:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        with self.rt.autocast():
            if self.mixing:
                pixel_lam, box, lam = self.mix.at(self.counter % self.total)
                x = apply_mix(x, pixel_lam, box)
            logits = self.module(x).float()
        smoothing = r.train.label_smoothing
        each = None
        if weight is not None:
            each = F.cross_entropy(logits, y, label_smoothing=smoothing, reduction="none")
            loss = (each * weight).mean()
            each = each.detach()
        elif self.mixing:
            loss = mixed_loss(logits, y, y.flip(0), lam, smoothing)
        else:
            loss = F.cross_entropy(logits, y, label_smoothing=smoothing)
        if self.teacher is not None:
            with torch.no_grad(), self.rt.autocast():
                t_logits = self.teacher(x).float()
            d = r.distill
            loss = (1 - d.alpha) * loss + d.alpha * distillation_loss(logits, t_logits, d.temperature)
        loss = loss * share
        correct = (logits.argmax(1) == y).sum()
        scaled = loss * self.scaler.scale if self.scaler is not None else loss
        return scaled, loss.detach(), correct, each

    @torch.no_grad()
    def update(self, losses: list[torch.Tensor], corrects: list[torch.Tensor]) -> None:
        """The optimizer and averaging update after the backward passes, and the step's
        metrics; see the module docstring."""
        step = self.counter
        at = (step % self.total).reshape(1)     # (drivers that profile may run more steps than a run has)
        lr_mult = self.lr_table.index_select(0, at)[0]
        momentum = None if self.mom_table is None else self.mom_table.index_select(0, at)[0]
        overflow, grad_scale = torch.zeros(1, device=step.device), None
        if self.scaler is not None:
            overflow = self.scaler.overflowed([p.grad for p in self.params if p.grad is not None])
            grad_scale = self.scaler.inverse()
            before = [t.clone() for t in self.params + self.opt.state_tensors()]
        self.opt.update(lr_mult, momentum, WHITEN_FROZEN, step >= self.whiten_steps, grad_scale)
        if self.scaler is not None:                   # an overflowing step leaves weights and state as they were
            after = self.params + self.opt.state_tensors()
            torch._foreach_copy_(after, [torch.where(overflow[0] > 0, b, a) for b, a in zip(before, after)])
            self.scaler.update(overflow)
        if self.averager is not None:
            # compiled: every-N decided on the device (one graph for every step); eager: on the
            # host, which knows the step number, so the steps between averages skip the work
            self.averager.update(step + 1 if self.rt.compile else self.host_step + 1)
        row = torch.stack([sum(losses), sum(corrects).float(), overflow[0]])
        self.metrics.index_copy_(0, at, row[None])
        self.counter.add_(1)

    # ======================================================================================
    # State: per run, checkpoints
    # ======================================================================================
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the step changes besides the model's own."""
        out = self.opt.state_tensors() + [self.counter, self.metrics, self.lr_table]
        if self.mom_table is not None:
            out.append(self.mom_table)
        if self.averager is not None:
            out += self.averager.shadow
        if self.scaler is not None:
            out += [self.scaler.scale, self.scaler.growth_tracker]
        if self.mix is not None:
            out += [self.mix.pixel_lam, self.mix.box, self.mix.loss_lam]
        return out

    @torch.no_grad()
    def reset(self, seed: int) -> None:
        """A new run from the model's current (freshly initialised) weights: optimizer state
        zero, average = the weights, loss scale back to its start, counter and metrics zero,
        the schedule restored, mixing drawn from ``seed``."""
        self.opt.reset()
        if self.averager is not None:
            self.averager.reset()
        if self.scaler is not None:
            self.scaler.reset()
        self.rewind()
        self.metrics.zero_()
        self.lr_table.copy_(torch.tensor(self.lrs, dtype=torch.float32))
        if self.mix is not None:
            a = self.r.augment
            self.mix.refill(MixPlan(a.mixup, a.cutmix, a.mix_prob, self.step_sizes, seed, torch.device("cpu")))

    @torch.no_grad()
    def idle(self) -> None:
        """LR 0 from here until :meth:`reset`, and the counter at step 0: the warm-up and the
        batch finder run real steps on random data that must not train anything."""
        self.lr_table.zero_()
        self.rewind()

    @torch.no_grad()
    def rewind(self, to: int = 0) -> None:
        """The step counter back to ``to`` (on the device and on the host)."""
        self.counter.fill_(to)
        self.host_step = to

    @property
    def averaging_due_after(self) -> int:
        """A counter value whose step ends with an averaging update (the warm-up runs one)."""
        return self.averager.cfg.every - 1 if self.averager is not None else 0

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "counter": int(self.counter),
                "averager": [t.detach().cpu().clone() for t in self.averager.shadow] if self.averager else None,
                "scaler": [self.scaler.scale.cpu(), self.scaler.growth_tracker.cpu()] if self.scaler else None,
                "metrics": self.metrics.cpu().clone()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.counter.fill_(state["counter"])
        self.host_step = int(state["counter"])
        self.metrics.copy_(state["metrics"])
        if self.averager is not None and state["averager"] is not None:
            torch._foreach_copy_(self.averager.shadow, [t.to(self.counter.device) for t in state["averager"]])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.scale.copy_(state["scaler"][0])
            self.scaler.growth_tracker.copy_(state["scaler"][1])
