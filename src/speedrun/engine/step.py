"""One training step, top to bottom: the only place in the training code that runs a
backward pass. Training, the warm-up, the batch finder and the data/model time split all
call :class:`TrainStep`.

A step, for a batch ``(x, y)`` already augmented by the data pipeline:

1. **Forward and loss** (:meth:`TrainStep.forward_loss`), once per micro-batch: the inputs
   are mixed by the step's mixup/CutMix draws (looked up on the device), the model runs under
   autocast, and the loss (:mod:`speedrun.engine.loss`: label smoothing, mixed labels,
   per-image pruning weights, distillation from a teacher) is weighted by the micro-batch's
   share of the batch and, with fp16, multiplied by the loss scale
   (:mod:`speedrun.engine.precision`). Compiled, this is one graph, and AOTAutograd compiles
   its backward as a second one.
2. **Backward**, once per micro-batch; under data parallelism every micro-batch but the
   last runs in ``no_sync()``, so gradients are all-reduced once per step.
3. **Update** (:meth:`TrainStep.update`): the schedule's LR and momentum for this step, read
   from device tables with the step counter; with fp16 the gradients checked for overflow
   and read unscaled by the optimizer, and an overflowing step undone on the device (not
   skipped by a host decision); the optimizer (SGD groups, LARS/LAMB/AdamW, orthogonal filter
   updates); the weight averaging (its every-N condition on the device); the step's loss,
   correct count and overflow flag written into the run's metrics table; the counter
   advanced. Compiled, this is the third graph.

Everything that changes from step to step (the counter, LR and momentum, the averaging
decay and its every-N condition, the whitening-bias freeze, mixing weights and CutMix boxes,
the loss scale) is a device tensor, so the compiled step never recompiles as the run
advances, and nothing in a step reads a value back to the host: the loop reads the metrics
table once per epoch. The step is counted twice, once on each side: :attr:`TrainStep.counter`
on the device (what the compiled code reads) and :attr:`TrainStep.steps_done` on the host
(what the loop and the eager decisions read), advanced together.
``benchmarks/step_structure.py`` counts graphs, graph breaks, eager ops and host syncs per
step, and tests keep them from creeping back. (An eager step in one process instead takes
the frozen whitening bias out of the backward: see :func:`drop_frozen_grads`.)
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..optim import ScheduleTables, build_averager, build_optimizer
from ..optim.orthogonal import ns_dtype
from ..optim.params import classify
from ..recipe import Recipe
from .loss import TrainingLoss
from .precision import MasterWeights, StepPrecision
from .runtime import Runtime, compile_function
from .sizes import sizes_share_one_graph

WHITEN_FROZEN = frozenset({"whiten_bias"})
"""Parameter groups whose LR drops to 0 after ``model.whiten.train_bias_epochs``."""


def drop_frozen_grads(compiled: bool, single_process: bool) -> bool:
    """Whether a frozen parameter group (the whitening bias after its epochs) is taken out of
    the backward (``requires_grad`` off) rather than kept at LR 0: only in an eager step of one
    process. A compiled step would recompile at the change, and DDP reduces a fixed set of
    gradients."""
    return not compiled and single_process


class TrainStep:
    """One optimizer step of ``recipe`` for ``model``, called with a batch: see the module
    docstring. ``module`` is what the forward calls (the model, or its DDP wrapper);
    ``step_shapes`` the (height, width) of every step's batch. The optimizer, averaging and
    loss-scale state, the schedule tables, the step counter and the run's metrics table are
    allocated once and reset in place for each run, so a compiled step is compiled once per
    process and serves every run of a benchmark."""

    def __init__(self, recipe: Recipe, runtime: Runtime, model: nn.Module, module: nn.Module, total_steps: int,
                 steps_per_epoch: int, step_shapes: list[tuple[int, int]], teacher: nn.Module | None = None,
                 no_sync=nullcontext):
        r, device = recipe, runtime.device
        self.recipe, self.runtime, self.model, self.module = r, runtime, model, module
        self.no_sync, self.total, self.k = no_sync, total_steps, r.train.accumulate
        self.precision = StepPrecision(runtime)
        self.loss = TrainingLoss(r, step_shapes, device, teacher, runtime.autocast)
        # with fp32 master weights the optimizer and the averaging update fp32 copies of the
        # parameters (self.params), and the model's own (self.model_params) get them rounded
        self.masters = MasterWeights([p for params in classify(model).values() for p in params]) \
            if runtime.fp32_master_weights else None
        stand_ins = self.masters.stand_ins if self.masters is not None else None
        self.opt = build_optimizer(model, r.optim, r.data.batch_size,
                                   ns_dtype(r.optim.ns_precision, device.type, runtime.precision), stand_ins,
                                   r.finetune)
        self.head_steps = round(r.finetune.head_epochs * steps_per_epoch)    # fine-tuning: the body held
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.model_params = self.masters.low if self.masters is not None else self.params
        self.averager = build_averager(model, r.averaging, total_steps, stand_ins)
        self.schedule = ScheduleTables(r.schedule, r.optim.momentum, total_steps, steps_per_epoch, device)
        whitened = getattr(model, "whiten", None) is not None
        self.whiten_steps = round(r.model.whiten.train_bias_epochs * steps_per_epoch) if whitened else 0
        self.counter = torch.zeros((), dtype=torch.int64, device=device)
        self.steps_done = 0           # the counter's value, known on the host without asking the device
        self.metrics = torch.zeros(total_steps, 3, device=device)     # loss, correct count, overflow skipped
        # Eager, in one process, the frozen whitening bias stops asking for a gradient: the
        # backward then skips the first convolution's input gradient and the activation after
        # the whitening (a full-resolution map), with the same weights as the LR-0 freeze.
        # Compiled steps and DDP keep the LR-0 freeze (a fixed graph and a fixed set of
        # gradients to reduce).
        self.freezable = [p for g in self.opt.param_groups if g["name"] in WHITEN_FROZEN for p in g["params"]] \
            if drop_frozen_grads(runtime.compile, module is model) and self.masters is None else []
        self._forward_loss, self._update = self.forward_loss, self.update
        self.dynamic_sides = runtime.compile and sizes_share_one_graph(r, device.type, runtime.compile_backend)
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
        if self.freezable:
            needed = self.steps_done < self.whiten_steps
            for p in self.freezable:
                p.requires_grad_(needed)
        copy_outputs = self.k > 1 and self.runtime.cuda_graphs     # the next replay would overwrite them
        weights = self.loss.image_weights(x, self.k)
        losses, corrects, per_image = [], [], []
        for i, (xm, ym, wm) in enumerate(zip(x.tensor_split(self.k), y.tensor_split(self.k), weights)):
            if self.dynamic_sides:                    # one graph for every training size
                torch._dynamo.maybe_mark_dynamic(xm, 2)
                torch._dynamo.maybe_mark_dynamic(xm, 3)
            with self.no_sync() if i < self.k - 1 else nullcontext():
                scaled, loss, correct, each = self._forward_loss(xm, ym, len(xm) / len(x), wm, size)
                scaled.backward()
            losses.append(loss.clone() if copy_outputs else loss)
            corrects.append(correct.clone() if copy_outputs else correct)
            per_image.append(each)
        self.loss.record(per_image)
        self._update(losses, corrects)
        self.steps_done += 1                          # (outside the compiled update, which must not read it)
        for p in self.model_params:
            p.grad = None

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor, share: float, weight: torch.Tensor | None = None,
                     size: int | None = None):
        """(loss to back-propagate, loss, correct count, each image's loss or None) of one
        micro-batch that is ``share`` of the batch; ``weight``: per-image loss weights
        (``data.prune``), whose images' own losses are then returned too; ``size``: the side
        to shrink the images to first (plain bilinear, fused into the compiled step)."""
        if size is not None and size != x.shape[-1]:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        with self.precision.autocast():
            x, lam = self.loss.mix_inputs(x, self.counter, self.total)
            logits = self.module(x).float()
        loss, each = self.loss(logits, y, x, lam, weight)
        loss = loss * share
        correct = (logits.argmax(1) == y).sum()
        return self.precision.scale(loss), loss.detach(), correct, each

    @torch.no_grad()
    def update(self, losses: list[torch.Tensor], corrects: list[torch.Tensor]) -> None:
        """The optimizer and averaging update after the backward passes, and the step's
        metrics; see the module docstring."""
        step = self.counter
        at = (step % self.total).reshape(1)     # (drivers that profile may run more steps than a run has)
        lr_mult, momentum = self.schedule.at(at)
        state = self.opt.state_tensors()
        if self.masters is not None:
            self.masters.take_grads()
        overflow, grad_scale, before = self.precision.check(self.params, state)
        self.opt.update(lr_mult, momentum, WHITEN_FROZEN, step >= self.whiten_steps, grad_scale,
                        step < self.head_steps if self.head_steps else False)
        self.precision.settle(overflow, before, self.params + state)   # an overflow leaves them as they were
        if self.averager is not None:
            # compiled: every-N decided on the device (one graph for every step); eager: on the
            # host, which knows the step number, so the steps between averages skip the work
            self.averager.update(step + 1 if self.runtime.compile else self.steps_done + 1)
        if self.masters is not None:
            self.masters.write_back()
        row = torch.stack([sum(losses), sum(corrects).float(), overflow[0]])
        self.metrics.index_copy_(0, at, row[None])
        self.counter.add_(1)

    # ======================================================================================
    # What the loop reads
    # ======================================================================================
    def base_lr(self) -> float:
        """The weights' LR before the schedule's multiplier (the figure the logs scale)."""
        return max(g["base_lr"] for g in self.opt.param_groups if g["name"] in ("weight", "filters"))

    @property
    def frozen_from(self) -> int | None:
        """The step from which the whitening bias gets no gradient at all (FLOP counts), or None
        where it is kept at LR 0 instead."""
        return self.whiten_steps if self.freezable else None

    @property
    def averaging_due_after(self) -> int:
        """A counter value whose step ends with an averaging update (the warm-up runs one)."""
        return self.averager.cfg.every - 1 if self.averager is not None else 0

    # ======================================================================================
    # State: per run, checkpoints
    # ======================================================================================
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the step changes besides the model's own."""
        out = self.opt.state_tensors() + [self.counter, self.metrics] + self.schedule.state_tensors()
        if self.averager is not None:
            out += self.averager.shadow
        if self.masters is not None:
            out += self.masters.state_tensors()
        return out + self.precision.state_tensors() + self.loss.state_tensors()

    @torch.no_grad()
    def reset(self, seed: int) -> None:
        """A new run from the model's current (freshly initialised) weights: optimizer state
        zero, average = the weights, loss scale back to its start, counter and metrics zero,
        the schedule restored, mixing drawn from ``seed``."""
        self.opt.reset()
        if self.masters is not None:
            self.masters.reset()
        if self.averager is not None:
            self.averager.reset()
        self.precision.reset()
        self.rewind()
        self.metrics.zero_()
        self.schedule.restore()
        self.loss.new_run(seed)

    @torch.no_grad()
    def idle(self) -> None:
        """LR 0 from here until :meth:`reset`, and the counter at step 0: the warm-up and the
        batch finder run real steps on random data that must not train anything."""
        self.schedule.idle()
        self.rewind()

    @torch.no_grad()
    def rewind(self, to: int = 0) -> None:
        """The step counter back to ``to`` (on the device and on the host)."""
        self.counter.fill_(to)
        self.steps_done = to

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "counter": int(self.counter),
                "averager": [t.detach().cpu().clone() for t in self.averager.shadow] if self.averager else None,
                "scaler": self.precision.state_dict(), "metrics": self.metrics.cpu().clone(),
                "masters": [t.detach().cpu().clone() for t in self.masters.high] if self.masters else None}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.rewind(state["counter"])
        self.metrics.copy_(state["metrics"])
        if self.averager is not None and state["averager"] is not None:
            torch._foreach_copy_(self.averager.shadow, [t.to(self.counter.device) for t in state["averager"]])
        self.precision.load_state_dict(state["scaler"])
        if self.masters is not None:
            if state.get("masters") is not None:
                torch._foreach_copy_(self.masters.high, [t.to(self.counter.device) for t in state["masters"]])
            else:
                self.masters.reset()
