"""The cifar10-94 algorithm the plain-PyTorch way, from the recipe's numbers, for the plain loop and the
Lightning module of ``peers.py``: both run what speedrun's recipe runs, differing only in the engine around
the step. Public torch API only (the model from ``speedrun.models``); Lightning imported on first use."""
from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from speedrun.models import build_model

CHANNELS_LAST = torch.channels_last
LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "fp32": "32-true"}


# --- Data: uint8 images in memory, normalised and augmented a whole batch at a time --------

class Normalise:
    """(pixel - mean) / std per channel, the training images' mean and (N-1) std in float64, as speedrun's."""

    def __init__(self, images_u8: torch.Tensor):
        total, squares = torch.zeros(2, images_u8.shape[1], dtype=torch.float64)
        for chunk in images_u8.split(4096):
            x = chunk.double()
            total += x.sum(dim=(0, 2, 3))
            squares += x.square().sum(dim=(0, 2, 3))
        count = images_u8.numel() // images_u8.shape[1]
        mean = total / count
        std = ((squares - count * mean.square()) / (count - 1)).sqrt()
        self.mean, self.std = mean.float()[:, None, None], std.float()[:, None, None]

    def __call__(self, x_u8: torch.Tensor) -> torch.Tensor:
        return (x_u8.float() - self.mean) / self.std


def random_translate(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Reflect-pad by ``pad`` and cut each image back at its own random offset with one gather (channels_last)."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect").permute(0, 2, 3, 1)     # N, H+2p, W+2p, C
    dy, dx = (torch.randint(0, 2 * pad + 1, (n,), generator=gen) for _ in range(2))     # (dy drawn first)
    rows, cols = (dy[:, None] + torch.arange(h))[:, :, None], (dx[:, None] + torch.arange(w))[:, None, :]
    return padded[torch.arange(n)[:, None, None], rows, cols].permute(0, 3, 1, 2)


class TrainBatches:
    """A pass per epoch: a fresh permutation in full batches, each normalised, translated and flipped whole;
    ``flip`` "alternating" mirrors each image every other epoch from a random start, "random" with p = 1/2."""

    def __init__(self, images_u8, labels, normalise: Normalise, batch_size: int, translate: int, flip: str,
                 seed: int):
        self.images, self.labels, self.normalise = images_u8, labels, normalise
        self.batch_size, self.translate, self.flip = batch_size, translate, flip
        self.gen = torch.Generator().manual_seed(seed)
        self.first_flip = torch.rand(len(labels), generator=self.gen) < 0.5
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.labels) // self.batch_size

    def __iter__(self):
        # (a generator: nothing is drawn until the first batch, so an iter() only to check is harmless)
        epoch, self.epoch = self.epoch, self.epoch + 1
        perm, b = torch.randperm(len(self.labels), generator=self.gen), self.batch_size
        for i in range(len(self)):
            idx = perm[i * b:(i + 1) * b]
            x = self.normalise(self.images[idx])
            if self.translate:
                x = random_translate(x, self.translate, self.gen)
            if self.flip != "none":
                mirror = (self.first_flip[idx] ^ bool(epoch % 2) if self.flip == "alternating"
                          else torch.rand(b, generator=self.gen) < 0.5)
                x = torch.where(mirror[:, None, None, None], x.flip(3), x)
            yield x.contiguous(memory_format=CHANNELS_LAST), self.labels[idx]


def eval_batches(data, normalise: Normalise, batch_size: int):
    """The test set in order, normalised a batch at a time (one pass)."""
    for i in range(0, len(data.test_y), batch_size):
        yield normalise(data.test_x[i:i + batch_size]).contiguous(memory_format=CHANNELS_LAST), \
            data.test_y[i:i + batch_size]


# --- The algorithm's numbers ---------------------------------------------------------------

def check_supported(recipe) -> None:
    """Refuse a recipe (or override) needing a trick the peers lack, rather than run something else."""
    r, a, n = recipe, recipe.augment, recipe.model.norm
    problems = [what for what, bad in [
        ("model.name must be speednet", r.model.name != "speednet"),
        ("optim.name must be sgd with optim.filters='same'", r.optim.name != "sgd" or r.optim.filters != "same"),
        ("optim.no_decay_bias_norm must be false", r.optim.no_decay_bias_norm),
        ("schedule.kind must be piecewise", r.schedule.kind != "piecewise"),
        ("averaging.kind must be lookahead or none", r.averaging.kind not in ("lookahead", "none")),
        ("augment: only translate crops and flips", a.crop != "translate" or a.cutout or a.color_jitter
         or a.lighting or a.mixup or a.cutmix),
        ("train.accumulate must be 1, no distillation", r.train.accumulate != 1 or r.distill.teacher),
        ("no progressive resizing, ghost or synchronised batch norm", r.data.progressive or n.ghost_batch
         or n.sync_ranks != 1),
        ("eval.tta_fraction must be 1", r.eval.tta_fraction != 1)] if bad]
    if problems:
        raise SystemExit("peers: error: the recipe asks for what the peers do not implement: " + "; ".join(problems))


@dataclass(frozen=True)
class Algorithm:
    """Everything the training algorithm needs, as plain numbers."""
    batch_size: int
    total_steps: int
    epochs: int                        # passes over the data (the last one may be partial)
    lr: float                          # SGD LR of the weights at schedule multiplier 1
    lr_mults: dict                     # group -> LR multiplier
    weight_decays: dict                # group -> torch SGD's (coupled) weight_decay
    momentum: float
    nesterov: bool
    schedule: tuple                    # LR multiplier of each step
    whiten_steps: int                  # steps the whitening bias trains for (LR 0 afterwards)
    whiten_samples: int
    label_smoothing: float
    translate: int
    flip: str
    lookahead: tuple | None            # (every, final decay, power), or None
    tta: str
    eval_batch: int
    monitor_every: int                 # epochs between monitoring evaluations (0: none)
    seed: int

    @classmethod
    def from_recipe(cls, recipe, n_train: int) -> Algorithm:
        """speedrun's LR is per ``ref_batch`` examples and momentum-normalised: SGD's is ``lr * (1 - momentum) *
        batch/ref_batch``; its decoupled decay is torch's coupled ``weight_decay = decay / (lr * multiplier)``."""
        check_supported(recipe)
        r, o, w, a = recipe, recipe.optim, recipe.model.whiten, recipe.averaging
        batch = r.data.batch_size
        spe = n_train // batch
        total = max(1, math.ceil(r.train.epochs * spe))
        ratio = batch / o.ref_batch
        scale = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[o.lr_scaling]
        mults = {"weights": 1.0, "norm_biases": o.norm_bias_lr_mult, "whiten_bias": o.whiten_bias_lr_mult}
        schedule = tuple(np.interp(np.arange(total) / total, r.schedule.knots, r.schedule.values).tolist())
        return cls(batch_size=batch, total_steps=total, epochs=math.ceil(total / spe),
                   lr=o.lr * (1 - o.momentum) * scale, lr_mults=mults, momentum=o.momentum,
                   weight_decays={k: (o.weight_decay / (o.lr * m) if m > 0 else 0.0) for k, m in mults.items()},
                   nesterov=o.nesterov and o.momentum > 0, schedule=schedule,
                   whiten_steps=round(w.train_bias_epochs * spe) if w.kernel else 0, whiten_samples=w.samples,
                   label_smoothing=r.train.label_smoothing, translate=r.augment.translate, flip=r.augment.flip,
                   lookahead=(a.every, a.decay, a.power) if a.kind == "lookahead" else None,
                   tta=r.eval.tta, eval_batch=r.eval.batch_size, monitor_every=r.eval.every, seed=r.train.seed)

    def monitors_after(self, epoch: int) -> bool:
        """Whether a monitoring evaluation follows epoch ``epoch`` (from 0): never after the last."""
        return bool(self.monitor_every) and (epoch + 1) % self.monitor_every == 0 and epoch + 1 < self.epochs

    def describe(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "schedule"} | {
            "schedule_first_peak_last": [self.schedule[0], max(self.schedule), self.schedule[-1]]}


# --- Optimizer, schedule, weight averaging, precision --------------------------------------

def parameter_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by role: batch-norm biases, the patch whitening's bias, everything else."""
    whiten, groups = getattr(model, "whiten", None), {"weights": [], "norm_biases": [], "whiten_bias": []}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:                    # (not the frozen batch-norm scales)
                groups["whiten_bias" if module is whiten else "norm_biases"
                       if isinstance(module, nn.BatchNorm2d) and name == "bias" else "weights"].append(p)
    return {k: v for k, v in groups.items() if v}


def make_optimizer(model: nn.Module, algo: Algorithm):
    """SGD with a group per role and a per-step ``LambdaLR``: the schedule (its last value held, as frameworks
    step it once more), 0 for the whitening bias from ``algo.whiten_steps`` on."""
    groups, last = parameter_groups(model), algo.total_steps - 1
    opt = torch.optim.SGD([dict(params=ps, lr=algo.lr * algo.lr_mults[k], weight_decay=algo.weight_decays[k])
                           for k, ps in groups.items()], lr=algo.lr, momentum=algo.momentum, nesterov=algo.nesterov)
    lambdas = [(lambda s: algo.schedule[min(s, last)] if s < algo.whiten_steps else 0.0) if k == "whiten_bias"
               else (lambda s: algo.schedule[min(s, last)]) for k in groups]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas)


class Lookahead:
    """Lookahead averaging (Zhang et al. 2019; airbench94): every ``every`` steps t each float state tensor's
    ``avg <- d*avg + (1-d)*live``, ``d = decay * (t/total)**power``, and live <- avg; at the end, the average.
    Without lookahead in the recipe it averages nothing."""

    def __init__(self, model: nn.Module, algo: Algorithm):
        (self.every, self.decay, self.power), self.total = algo.lookahead or (0, 0.0, 0.0), algo.total_steps
        self.live = [t for t in model.state_dict().values() if t.is_floating_point()] if self.every else []
        self.average = [t.detach().clone() for t in self.live]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step number ``step`` (counted from 1)."""
        if self.every and step % self.every == 0:
            d = self.decay * (step / self.total) ** self.power
            for avg, live in zip(self.average, self.live):
                avg.lerp_(live, 1.0 - d)
                live.copy_(avg)

    @torch.no_grad()
    def finalize(self) -> None:
        for avg, live in zip(self.average, self.live):
            live.copy_(avg)


def autocast_for(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


# --- Evaluation with test-time augmentation; the training clock ----------------------------

def tta_logits(model: nn.Module, x: torch.Tensor, tta: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(TTA logits, plain logits): "flip" averages the image and its mirror; "flip_translate" weighs those
    1/4 each and the views shifted one pixel down-right and up-left (reflect-filled), mirrored or not, 1/8."""
    def run(v):
        return model(v.contiguous(memory_format=CHANNELS_LAST)).float()
    plain = run(x)
    if tta == "none":
        return plain, plain
    mirrored = run(x.flip(3))
    if tta == "flip":
        return 0.5 * plain + 0.5 * mirrored, plain
    h, w = x.shape[2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
    down_right, up_left = padded[:, :, :h, :w], padded[:, :, 2:, 2:]
    total = 0.25 * plain + 0.25 * mirrored
    for view in (down_right, down_right.flip(3), up_left, up_left.flip(3)):
        total = total + 0.125 * run(view)
    return total, plain


def correct_counts(model: nn.Module, x, y, tta: str) -> torch.Tensor:
    """(correct with TTA, correct without) in a batch, as a tensor (no read-back)."""
    total, plain = tta_logits(model, x, tta)
    return torch.stack([(total.argmax(1) == y).sum(), (plain.argmax(1) == y).sum()])


@torch.no_grad()
def evaluate(model: nn.Module, batches, tta: str, autocast) -> tuple[float, float]:
    """(accuracy with TTA, without) over (x, y) batches under ``autocast()``; one read-back at the end."""
    was_training = model.training
    model.eval()
    correct, n = torch.zeros(2, dtype=torch.int64), 0
    with autocast():
        for x, y in batches:
            correct += correct_counts(model, x, y, tta)
            n += len(y)
    model.train(was_training)
    return tuple(c / n for c in correct.tolist())


class Clock:
    """Training seconds as speedrun counts them (from the first touch of the data, monitoring paused)."""

    def __init__(self):
        self.t0, self.paused, self.marks = time.perf_counter(), 0.0, []

    def seconds(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    def mark_epoch(self) -> None:
        self.marks.append(self.seconds())

    def epoch_seconds(self) -> list[float]:
        return [b - a for a, b in zip([0.0] + self.marks, self.marks)]


@contextmanager
def monitored(clock: Clock, lookahead: Lookahead):
    """A monitoring evaluation: paused out of the clock, with the averaged weights (the live ones after)."""
    start, saved = time.perf_counter(), [t.clone() for t in lookahead.live]
    lookahead.finalize()
    try:
        yield
    finally:
        with torch.no_grad():
            for t, kept in zip(lookahead.live, saved):
                t.copy_(kept)
        clock.paused += time.perf_counter() - start


# --- Either peer's start, and the plain peer's loop -----------------------------------------

def peer_model(recipe, seed: int) -> nn.Module:
    """speedrun's network for the recipe, initialised from ``seed`` as speedrun initialises it."""
    torch.manual_seed(seed)
    return build_model(recipe.model, 3, 10).to(memory_format=CHANNELS_LAST)


def first_touch(model: nn.Module, data, algo: Algorithm) -> tuple[Normalise, TrainBatches]:
    """The first touch of the data, as speedrun's clock counts it: statistics, whitening fit, batch maker."""
    normalise = Normalise(data.train_x)
    if getattr(model, "whiten", None) is not None:
        model.whiten.fit(normalise(data.train_x[:algo.whiten_samples]))
    return normalise, TrainBatches(data.train_x, data.train_y, normalise, algo.batch_size, algo.translate, algo.flip,
                                   algo.seed)


def train_plain(model: nn.Module, algo: Algorithm, optimizer, batches, precision: str = "fp32",
                clock: Clock | None = None, monitor_batches=None) -> list[float]:
    """The plain loop: ``algo.total_steps`` steps over ``batches`` (a pass per epoch), the averaged weights
    left in ``model``; after each epoch but the last, ``monitor_batches()``' accuracy (returned)."""
    (opt, schedule), clock = optimizer, clock or Clock()
    lookahead = Lookahead(model, algo)             # (the average starts from the fitted whitening)
    model.train()
    step, monitor_acc = 0, []
    for epoch in range(algo.epochs):
        for x, y in batches:
            with autocast_for(precision):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=algo.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            step += 1
            lookahead.update(step)
            if step == algo.total_steps:
                break
        clock.mark_epoch()
        if monitor_batches is not None and algo.monitors_after(epoch):
            with monitored(clock, lookahead):
                monitor_acc.append(evaluate(model, monitor_batches(), "none", lambda: autocast_for(precision))[1])
    lookahead.finalize()
    return monitor_acc


# --- The Lightning peer: the algorithm as a LightningModule, with the settings Lightning documents for
# raw speed on a CPU (bf16-mixed where native, else 32-true; barebones; batches from memory; max_steps) ---

def make_trainer(algo: Algorithm, precision: str):
    import lightning as L
    return L.Trainer(accelerator="cpu", devices=1, precision=LIGHTNING_PRECISION[precision], barebones=True,
                     max_epochs=algo.epochs, max_steps=algo.total_steps, inference_mode=True)


def lightning_module(model: nn.Module, algo: Algorithm, clock: Clock | None = None, monitor_batches=None):
    """``model`` (whitening fitted) trained with ``algo`` as a LightningModule: ``trainer.fit`` leaves the
    averaged weights in it; ``trainer.test`` counts (correct with TTA, without) in ``correct``."""
    import lightning as L
    clock = clock or Clock()

    class Cifar10Peer(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.lookahead, self.steps_done, self.monitor_acc = model, None, 0, []
            self.correct, self.seen = torch.zeros(2, dtype=torch.int64), 0

        def configure_optimizers(self):
            opt, schedule = make_optimizer(self.model, algo)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

        def on_train_start(self) -> None:
            self.lookahead, self.steps_done = Lookahead(self.model, algo), 0     # (from the fitted whitening)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.model(batch[0]).float(), batch[1], label_smoothing=algo.label_smoothing)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.steps_done += 1
            self.lookahead.update(self.steps_done)

        def on_train_epoch_end(self) -> None:
            clock.mark_epoch()
            if monitor_batches is not None and algo.monitors_after(self.current_epoch):
                with monitored(clock, self.lookahead):
                    forward_context = self.trainer.precision_plugin.forward_context
                    self.monitor_acc.append(evaluate(self.model, monitor_batches(), "none", forward_context)[1])

        def on_train_end(self) -> None:
            self.lookahead.finalize()

        def test_step(self, batch, batch_idx) -> None:
            self.correct += correct_counts(self.model, *batch, algo.tta)
            self.seen += len(batch[1])

    return Cifar10Peer()
