"""The training step's numeric precision, in one place.

The runtime chooses the compute dtype (``runtime.precision``: fp32, bf16 or fp16) and how it
is applied (``runtime.cast``: autocast around the forward, or the model stored in it);
:class:`StepPrecision` is what the training step asks about it:

- **autocast** around the forward and the loss (:meth:`StepPrecision.autocast`);
- with fp16, **dynamic loss scaling kept on the device** (:class:`LossScale`): the loss is
  multiplied by the scale before the backward, the optimizer reads the gradients times its
  inverse, and the scale halves on an overflow and doubles after 2,000 clean steps;
- the **overflow revert**: an fp16 step whose gradients overflowed leaves the weights and the
  optimizer state as they were, decided on the device (no host read-back per step);
- the **non-finite patience** the loop applies when it reads an epoch's losses back: without
  loss scaling the first NaN or infinite loss stops the run; with it, only
  :data:`NONFINITE_PATIENCE` bad steps in a row do (:func:`first_bad_step`), and the run stops
  with :class:`NonFiniteLoss`, which carries the last good weights.
"""
from __future__ import annotations

import math

import torch

from .runtime import Runtime

NONFINITE_PATIENCE = 20
"""With fp16 loss scaling a step whose loss or gradients overflow is skipped by the scaler
(which lowers the scale); the run stops only after this many such steps in a row."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; carries the last good weights."""

    def __init__(self, step: int, epoch: int, value: float, last_good: dict, last_good_step: int):
        self.step, self.epoch, self.value = step, epoch, value
        self.last_good, self.last_good_step = last_good, last_good_step
        what = f"loss became {value}" if not math.isfinite(value) else \
            f"fp16 gradients overflowed on {NONFINITE_PATIENCE} steps in a row (the loss scale collapsed; loss {value:.4g})"
        super().__init__(f"{what} at step {step} (epoch {epoch}); training stopped")


def first_bad_step(losses: list[float], loss_scaling: bool, run_before: int = 0,
                   overflowed: list[float] | None = None) -> tuple[int | None, int, int]:
    """(index of the step that stops the run or None, steps skipped as overflows, the run of
    bad steps at the end). A step is bad when its loss is not finite or, with loss scaling,
    when its gradients overflowed (``overflowed[j]`` > 0; the step was undone on the
    device). Without loss scaling the first non-finite loss stops the run; with it, only
    ``NONFINITE_PATIENCE`` bad steps in a row (counting ``run_before`` from the previous
    epoch) do, so a collapsing loss scale stops the run even while the loss stays finite."""
    flags = overflowed or [0.0] * len(losses)
    run, skipped = run_before, 0
    for j, (v, o) in enumerate(zip(losses, flags)):
        if math.isfinite(v) and not (loss_scaling and o > 0):
            run = 0
            continue
        if not loss_scaling:
            return j, 0, 0
        run += 1
        skipped += 1
        if run >= NONFINITE_PATIENCE:
            return j, 0, run
    return None, skipped, run


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


class MasterWeights:
    """fp32 copies of the parameters of a model stored in bf16/fp16 (``runtime.master_weights =
    "fp32"``), which the optimizer and the weight averaging update in place of the parameters:
    an update smaller than half a step of the low-precision format is then kept, not rounded
    away. Each step the model's gradients are copied into the copies' own fp32 ``.grad``
    (allocated once), and after the update the model gets the copies rounded."""

    def __init__(self, params: list[torch.Tensor]):
        self.low = list(params)
        self.high = [p.detach().float().clone() for p in self.low]
        for h in self.high:
            h.grad = torch.zeros_like(h)
        self.stand_ins = {id(p): h for p, h in zip(self.low, self.high)}

    @torch.no_grad()
    def take_grads(self) -> None:
        """The model's gradients (this step's) into the fp32 copies' ``.grad``."""
        torch._foreach_copy_([h.grad for h in self.high], [p.grad for p in self.low])

    @torch.no_grad()
    def write_back(self) -> None:
        """The model's weights from the fp32 copies (rounded to its dtype)."""
        torch._foreach_copy_(self.low, self.high)

    @torch.no_grad()
    def reset(self) -> None:
        """The copies from the model's weights (a new run, or a resumed one without saved copies)."""
        torch._foreach_copy_(self.high, self.low)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.high + [h.grad for h in self.high]


class StepPrecision:
    """The precision a training step runs in (see the module docstring): autocast, and with
    fp16 the loss scale, the overflow check and the revert. Its device tensors are allocated
    once and reset in place for each run."""

    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.scaler = LossScale(runtime.device) if runtime.precision == "fp16" else None

    @property
    def loss_scaling(self) -> bool:
        return self.scaler is not None

    def autocast(self):
        """The context the forward and the loss run in."""
        return self.rt.autocast()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate: times the loss scale with fp16."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def check(self, params: list[torch.Tensor], state: list[torch.Tensor]):
        """Before the update: (overflow flag, the factor the optimizer reads the gradients
        times or None, the tensors the update may have to be undone to or None). With fp16 the
        flag is read from the gradients of ``params`` and ``params`` and ``state`` (the
        optimizer's) are copied; otherwise the flag is 0 and nothing is copied."""
        if self.scaler is None:
            return torch.zeros(1, device=self.rt.device), None, None
        overflow = self.scaler.overflowed([p.grad for p in params if p.grad is not None])
        return overflow, self.scaler.inverse(), [t.clone() for t in params + state]

    def settle(self, overflow: torch.Tensor, before: list[torch.Tensor] | None, after: list[torch.Tensor]) -> None:
        """After the update: an overflowing fp16 step leaves ``after`` (the tensors copied into
        ``before`` by :meth:`check`) as they were, and the loss scale moves by the flag."""
        if self.scaler is None:
            return
        torch._foreach_copy_(after, [torch.where(overflow[0] > 0, b, a) for b, a in zip(before, after)])
        self.scaler.update(overflow)

    # -- state -------------------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        return [self.scaler.scale, self.scaler.growth_tracker] if self.scaler is not None else []

    def reset(self) -> None:
        if self.scaler is not None:
            self.scaler.reset()

    def state_dict(self) -> list[torch.Tensor] | None:
        return [self.scaler.scale.cpu(), self.scaler.growth_tracker.cpu()] if self.scaler is not None else None

    @torch.no_grad()
    def load_state_dict(self, state: list[torch.Tensor] | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.scale.copy_(state[0])
            self.scaler.growth_tracker.copy_(state[1])
