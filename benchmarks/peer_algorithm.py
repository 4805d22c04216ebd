"""The cifar10-94 algorithm written the plain-PyTorch way, shared by the two peers of
``peers.py`` (the plain loop and the Lightning module), so that both run exactly what
speedrun's recipe runs and differ from it only in the engine around the step.

What is here, each from the recipe's numbers (read with ``speedrun.recipe.load_recipe``):

- :class:`Algorithm`: batch, steps, the per-step LR multipliers (piecewise linear in the
  fraction of training), momentum, weight decay, LR multipliers, the whitening-bias freeze,
  label smoothing, augmentation, lookahead and TTA settings.
- :func:`make_optimizer`: speedrun's momentum-normalised LR and decoupled weight decay turned
  into ``torch.optim.SGD`` parameter groups and a per-step ``LambdaLR``.
- :class:`Lookahead`: the lookahead weight averaging of ``optim.averaging.kind="lookahead"``.
- :class:`Normalise`, :class:`TrainBatches`, :class:`EvalBatches`: uint8 images in memory,
  normalised per batch; training batches shuffled and augmented a whole batch at a time.
- :func:`tta_logits` / :func:`evaluate`: the test accuracy with and without TTA.
- :class:`Clock`: seconds of training with monitoring evaluations paused, per epoch.
- :func:`train_lightning`: the Lightning peer, the algorithm as a LightningModule.

Only public torch API; no speedrun engine code (the model comes from ``speedrun.models``).
"""
from __future__ import annotations

import math
import pickle
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

CHANNELS_LAST = torch.channels_last


# ==========================================================================================
# Data
# ==========================================================================================

@dataclass
class Cifar10:
    train_x: torch.Tensor          # (N, 3, 32, 32) uint8
    train_y: torch.Tensor          # (N,) int64
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_cifar10(data_dir: str | Path, limit_train: int | None = None, limit_test: int | None = None) -> Cifar10:
    """CIFAR-10 from the official Python pickles in ``data_dir/cifar-10-batches-py``, as
    uint8 tensors; ``limit_*`` keep the first images of each split (smoke runs)."""
    folder = Path(data_dir) / "cifar-10-batches-py"

    def read(name):
        with open(folder / name, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        return np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(d[b"labels"])
    parts = [read(f"data_batch_{i}") for i in range(1, 6)]
    train_x, train_y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    test_x, test_y = read("test_batch")
    tensors = [torch.from_numpy(a) for a in (train_x[:limit_train], train_y[:limit_train].astype(np.int64),
                                             test_x[:limit_test], test_y[:limit_test].astype(np.int64))]
    return Cifar10(*tensors)


class Normalise:
    """(pixel - mean) / std per channel, in 0..255 units, with the mean and (N-1) standard
    deviation of the training images, as speedrun normalises."""

    def __init__(self, images_u8: torch.Tensor):
        total = torch.zeros(images_u8.shape[1], dtype=torch.float64)
        squares = torch.zeros_like(total)
        for chunk in images_u8.split(4096):           # float64 sums, without a float copy of the set
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
    """Reflect-pad a batch by ``pad`` pixels and cut each image back at its own random offset
    (0..2*pad in each direction), with one gather for the whole batch. The result is NCHW in
    channels_last memory (the gather runs on the NHWC view)."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad), mode="reflect").permute(0, 2, 3, 1)     # N, H+2p, W+2p, C
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=gen)
    rows = (dy[:, None] + torch.arange(h))[:, :, None]                               # N, H, 1
    cols = (dx[:, None] + torch.arange(w))[:, None, :]                               # N, 1, W
    return padded[torch.arange(n)[:, None, None], rows, cols].permute(0, 3, 1, 2)


class TrainBatches:
    """Training batches held in memory: each pass over this object is one epoch, a fresh
    permutation cut into full batches (the last partial batch is dropped, as speedrun does);
    each batch is normalised, translated and flipped whole. ``flip="alternating"`` mirrors
    each image on every other epoch from a random start (speedrun's ``augment.flip``);
    ``"random"`` flips each image with probability 1/2 every time."""

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
        # a generator: nothing is drawn (and the epoch does not advance) until the first batch
        # is asked for, so a framework that calls iter() only to check is harmless
        epoch, self.epoch = self.epoch, self.epoch + 1
        perm = torch.randperm(len(self.labels), generator=self.gen)
        b = self.batch_size
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


class EvalBatches:
    """The test set in order, normalised a batch at a time, in channels_last; each pass over
    this object is one pass over the set."""

    def __init__(self, data: Cifar10, normalise: Normalise, batch_size: int):
        self.data, self.normalise, self.batch_size = data, normalise, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.data.test_y) / self.batch_size)

    def __iter__(self):
        d, b = self.data, self.batch_size
        for i in range(0, len(d.test_y), b):
            yield self.normalise(d.test_x[i:i + b]).contiguous(memory_format=CHANNELS_LAST), d.test_y[i:i + b]


# ==========================================================================================
# The algorithm's numbers
# ==========================================================================================

def check_supported(recipe) -> None:
    """The peers implement the cifar10-94 algorithm and nothing else: refuse a recipe (or an
    override) that needs a trick they lack, rather than silently run something else."""
    r = recipe
    problems = [what for what, bad in [
        ("model.name must be speednet", r.model.name != "speednet"),
        ("optim.name must be sgd with optim.filters='same'", r.optim.name != "sgd" or r.optim.filters != "same"),
        ("optim.no_decay_bias_norm must be false", r.optim.no_decay_bias_norm),
        ("schedule.kind must be piecewise", r.schedule.kind != "piecewise"),
        ("averaging.kind must be lookahead or none", r.averaging.kind not in ("lookahead", "none")),
        ("augment: only translate crops and flips", r.augment.crop != "translate" or r.augment.cutout
         or r.augment.color_jitter or r.augment.lighting or r.augment.mixup or r.augment.cutmix),
        ("train.accumulate must be 1, no distillation", r.train.accumulate != 1 or r.distill.teacher),
        ("no progressive resizing, ghost or synchronised batch norm",
         r.data.progressive or r.model.norm.ghost_batch or r.model.norm.sync_ranks != 1),
        ("eval.tta_fraction must be 1", r.eval.tta_fraction != 1),
    ] if bad]
    if problems:
        raise SystemExit("peers: the recipe asks for what the peers do not implement: " + "; ".join(problems))


@dataclass(frozen=True)
class Algorithm:
    """Everything the training algorithm needs, as plain numbers."""
    batch_size: int
    steps_per_epoch: int
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
        """Convert the recipe's units. speedrun states the LR per ``ref_batch`` examples and
        momentum-normalised, so the per-step SGD LR is ``lr * (1 - momentum) * batch/ref_batch``;
        its weight decay is decoupled (a fraction of the weight per ``ref_batch`` examples at the
        schedule's peak, following the schedule), which torch's coupled decay reproduces with
        ``weight_decay = decay / (lr * group multiplier)`` (then LR x decay does not depend on
        the LR or the multiplier)."""
        check_supported(recipe)
        r, o = recipe, recipe.optim
        batch = r.data.batch_size
        spe = n_train // batch
        total = max(1, math.ceil(r.train.epochs * spe))
        ratio = batch / o.ref_batch
        scale = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[o.lr_scaling]
        mults = {"weights": 1.0, "norm_biases": o.norm_bias_lr_mult, "whiten_bias": o.whiten_bias_lr_mult}
        decays = {k: (o.weight_decay / (o.lr * m) if m > 0 else 0.0) for k, m in mults.items()}
        fraction = np.arange(total) / total
        schedule = tuple(np.interp(fraction, r.schedule.knots, r.schedule.values).tolist())
        w = r.model.whiten
        a = r.averaging
        return cls(batch_size=batch, steps_per_epoch=spe, total_steps=total, epochs=math.ceil(total / spe),
                   lr=o.lr * (1 - o.momentum) * scale, lr_mults=mults, weight_decays=decays, momentum=o.momentum,
                   nesterov=o.nesterov and o.momentum > 0, schedule=schedule,
                   whiten_steps=round(w.train_bias_epochs * spe) if w.kernel else 0, whiten_samples=w.samples,
                   label_smoothing=r.train.label_smoothing, translate=r.augment.translate, flip=r.augment.flip,
                   lookahead=(a.every, a.decay, a.power) if a.kind == "lookahead" else None,
                   tta=r.eval.tta, eval_batch=r.eval.batch_size, monitor_every=r.eval.every, seed=r.train.seed)

    def monitors_after(self, epoch: int) -> bool:
        """Whether a monitoring evaluation follows epoch ``epoch`` (from 0): every
        ``monitor_every`` epochs, never after the last (the final evaluation follows it)."""
        return bool(self.monitor_every) and (epoch + 1) % self.monitor_every == 0 and epoch + 1 < self.epochs

    def describe(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "schedule"} | {
            "schedule_first_peak_last": [self.schedule[0], max(self.schedule), self.schedule[-1]]}


# ==========================================================================================
# Optimizer, schedule, weight averaging
# ==========================================================================================

def parameter_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by role: batch-norm biases (a 64x LR in cifar10-94), the patch
    whitening's bias (frozen after a few epochs), and everything else."""
    whiten = getattr(model, "whiten", None)
    groups = {"weights": [], "norm_biases": [], "whiten_bias": []}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue                           # the frozen batch-norm scales
            if module is whiten:
                groups["whiten_bias"].append(p)
            elif isinstance(module, nn.BatchNorm2d) and name == "bias":
                groups["norm_biases"].append(p)
            else:
                groups["weights"].append(p)
    return {k: v for k, v in groups.items() if v}


def make_optimizer(model: nn.Module, algo: Algorithm):
    """``torch.optim.SGD`` with one group per role and a ``LambdaLR`` to be stepped after every
    optimizer step: the schedule's multiplier for every group, and 0 for the whitening bias
    from step ``algo.whiten_steps`` on."""
    groups = parameter_groups(model)
    opt = torch.optim.SGD([dict(params=ps, lr=algo.lr * algo.lr_mults[k], weight_decay=algo.weight_decays[k])
                           for k, ps in groups.items()],
                          lr=algo.lr, momentum=algo.momentum, nesterov=algo.nesterov)
    last = algo.total_steps - 1

    def multiplier(step):
        return algo.schedule[min(step, last)]      # (frameworks step the scheduler once more at the end)

    def whiten_multiplier(step):
        return multiplier(step) if step < algo.whiten_steps else 0.0
    lambdas = [whiten_multiplier if k == "whiten_bias" else multiplier for k in groups]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambdas)


class Lookahead:
    """Lookahead weight averaging (Zhang et al. 2019, as airbench94 uses it): after every
    ``every``-th optimizer step t, the average of every floating-point tensor of the model's
    state (weights, batch-norm running statistics) moves towards the live one,
    ``avg <- d*avg + (1-d)*live`` with ``d = decay * (t/total)**power``, and the live weights
    are put back onto the average. At the end the average becomes the model."""

    def __init__(self, model: nn.Module, every: int, decay: float, power: float, total_steps: int):
        self.every, self.decay, self.power, self.total = every, decay, power, total_steps
        self.live = [t for t in model.state_dict().values() if t.is_floating_point()]
        self.average = [t.detach().clone() for t in self.live]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step number ``step`` (counted from 1)."""
        if step % self.every:
            return
        d = self.decay * (step / self.total) ** self.power
        for avg, live in zip(self.average, self.live):
            avg.lerp_(live, 1.0 - d)
            live.copy_(avg)

    @torch.no_grad()
    def finalize(self) -> None:
        for avg, live in zip(self.average, self.live):
            live.copy_(avg)

    @contextmanager
    def applied(self):
        """The average in the model for a monitoring evaluation, the live weights after it."""
        saved = [t.clone() for t in self.live]
        self.finalize()
        try:
            yield
        finally:
            with torch.no_grad():
                for live, s in zip(self.live, saved):
                    live.copy_(s)


def make_lookahead(model: nn.Module, algo: Algorithm) -> Lookahead | None:
    return Lookahead(model, *algo.lookahead, algo.total_steps) if algo.lookahead else None


def autocast_for(precision: str):
    """bf16 autocast on the CPU, or nothing for fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


# ==========================================================================================
# Evaluation with test-time augmentation
# ==========================================================================================

def tta_logits(model: nn.Module, x: torch.Tensor, tta: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(TTA logits, plain logits) of a batch. "flip" averages the image and its mirror;
    "flip_translate" weighs those 1/4 each and the four views shifted one pixel down-right and
    up-left (reflect-filled), each with and without the mirror, 1/8 each."""
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


@torch.no_grad()
def evaluate(model: nn.Module, batches, tta: str, autocast) -> tuple[float, float]:
    """(accuracy with TTA, accuracy without) over (x, y) batches; ``autocast()`` gives the
    precision context. The counts stay tensors until the end (one read-back)."""
    was_training = model.training
    model.eval()
    correct, n = torch.zeros(2, dtype=torch.int64), 0
    with autocast():
        for x, y in batches:
            total, plain = tta_logits(model, x, tta)
            correct += torch.stack([(total.argmax(1) == y).sum(), (plain.argmax(1) == y).sum()])
            n += len(y)
    model.train(was_training)
    c_tta, c_plain = correct.tolist()
    return c_tta / n, c_plain / n


# ==========================================================================================
# Timing
# ==========================================================================================

class Clock:
    """Training seconds as speedrun counts them: wall time from the first touch of the
    training data, with monitoring evaluations paused; a mark at the end of each epoch."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.paused = 0.0
        self.marks: list[float] = []

    def seconds(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    @contextmanager
    def pause(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - t

    def mark_epoch(self) -> None:
        self.marks.append(self.seconds())

    def epoch_seconds(self) -> list[float]:
        return [b - a for a, b in zip([0.0] + self.marks, self.marks)]


# ==========================================================================================
# The Lightning peer: the same algorithm as a LightningModule under lightning.Trainer
# ==========================================================================================
# With the settings Lightning documents for raw speed on a CPU: precision "bf16-mixed" where the
# CPU computes bf16 natively (else "32-true"), barebones=True (no logger, checkpointing,
# progress bar, model summary or sanity validation), batches from memory as a plain iterable,
# max_steps for fractional epochs. The optimizer and its per-step schedule come from
# configure_optimizers, the lookahead averaging runs after each optimizer step, the monitoring
# evaluation after each epoch but the last (kept out of the training clock), the final TTA
# accuracy from Trainer.test. Lightning is imported on first use, so the plain peer's process
# never loads it.

def lightning_precision(precision: str) -> str:
    """Lightning's name for a precision of the peers ("bf16" or "fp32")."""
    return {"bf16": "bf16-mixed", "fp32": "32-true"}[precision]


def lightning_module(model: nn.Module, algo: Algorithm, clock: Clock | None = None, monitor_batches=None):
    """``model`` trained with ``algo`` as a LightningModule (its class defined here, so that
    Lightning is imported only where it is wanted)."""
    import lightning as L

    class Cifar10Peer(L.LightningModule):
        """``model`` trained with ``algo``. ``clock`` (optional) gets a mark at the end of each
        epoch; ``monitor_batches()`` (optional) gives the test batches for the per-epoch
        monitoring accuracy, collected in :attr:`monitor_acc`."""

        def __init__(self, model: nn.Module, algo: Algorithm, clock: Clock | None = None, monitor_batches=None):
            super().__init__()
            self.model, self.algo, self.clock, self.monitor_batches = model, algo, clock, monitor_batches
            self.lookahead = None
            self.steps_done = 0
            self.monitor_acc: list[float] = []
            self.correct = torch.zeros(2, dtype=torch.int64)
            self.seen = 0

        # -- training ----------------------------------------------------------------------------
        def configure_optimizers(self):
            opt, schedule = make_optimizer(self.model, self.algo)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

        def on_train_start(self) -> None:
            # the average starts from the weights as training starts (whitening already fitted)
            self.lookahead = make_lookahead(self.model, self.algo)
            self.steps_done = 0

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.float(), y, label_smoothing=self.algo.label_smoothing)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.steps_done += 1
            if self.lookahead is not None:
                self.lookahead.update(self.steps_done)

        def on_train_epoch_end(self) -> None:
            if self.clock is not None:
                self.clock.mark_epoch()
            if self.monitor_batches is None or not self.algo.monitors_after(self.current_epoch):
                return
            averaged = self.lookahead.applied() if self.lookahead is not None else nullcontext()
            with self.clock.pause() if self.clock is not None else nullcontext(), averaged:
                _, acc = evaluate(self.model, self.monitor_batches(), "none",
                                  self.trainer.precision_plugin.forward_context)
            self.monitor_acc.append(acc)

        def on_train_end(self) -> None:
            if self.lookahead is not None:
                self.lookahead.finalize()

        # -- the final evaluation (Trainer.test) -------------------------------------------------
        def on_test_epoch_start(self) -> None:
            self.correct.zero_()
            self.seen = 0

        def test_step(self, batch, batch_idx) -> None:
            x, y = batch
            total, plain = tta_logits(self.model, x, self.algo.tta)
            self.correct += torch.stack([(total.argmax(1) == y).sum(), (plain.argmax(1) == y).sum()])
            self.seen += len(y)

    return Cifar10Peer(model, algo, clock, monitor_batches)


def make_trainer(algo: Algorithm, precision: str):
    import lightning as L
    return L.Trainer(accelerator="cpu", devices=1, precision=lightning_precision(precision), barebones=True,
                     max_epochs=algo.epochs, max_steps=algo.total_steps, inference_mode=True)


def train_lightning(model: nn.Module, algo: Algorithm, batches, precision: str, clock: Clock | None = None,
                    monitor_batches=None, trainer=None):
    """Train ``model`` (whitening already fitted) on ``batches`` (an iterable, one pass per
    epoch) for ``algo.total_steps`` steps; the averaged weights end up in ``model``; (trainer,
    module). ``trainer``: one from :func:`make_trainer` (the benchmark makes it before its
    clock, as speedrun builds its session before its clock), else made here."""
    trainer = trainer or make_trainer(algo, precision)
    module = lightning_module(model, algo, clock, monitor_batches)
    trainer.fit(module, train_dataloaders=batches)
    return trainer, module


def final_accuracy(trainer, module, batches) -> tuple[float, float]:
    """(accuracy with the recipe's TTA, without) from ``Trainer.test``."""
    trainer.test(module, dataloaders=batches, verbose=False)
    c_tta, c_plain = module.correct.tolist()
    return c_tta / module.seen, c_plain / module.seen
