"""The training loop for device-resident datasets.

A :class:`Session` holds one recipe on one device: the dataset (already loaded from disk),
the model (built, compiled and warmed up once). :meth:`Session.run` re-initialises the
model from a seed and trains it; benchmarks call it many times.

The hot loop never waits for the device: no ``.item()``, no printing of tensors. Per-step
losses and correct counts stay on the device and are read back once per epoch.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..data.augment import BatchAugment
from ..data.resident import ResidentData
from ..data.sources import ArrayDataset
from ..models import build_model
from ..optim import build_averager, build_optimizer, lr_multipliers, momenta, set_step_hyperparams
from ..recipe import Recipe, steps_per_epoch, total_steps
from .evaluate import evaluate
from .runtime import Runtime

WHITEN_FROZEN = frozenset({"whiten_bias"})


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float
    train_acc: float
    test_acc: float | None
    lr: float
    seconds: float


@dataclass
class RunResult:
    seed: int
    test_acc: float
    test_acc_no_tta: float
    epochs: float
    steps: int
    train_seconds: float
    monitor_seconds: float
    history: list[EpochRecord] = field(default_factory=list)
    state_dict: dict | None = None


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; carries the last good weights."""

    def __init__(self, step: int, epoch: int, value: float, last_good: dict, last_good_step: int):
        self.step, self.epoch, self.value = step, epoch, value
        self.last_good, self.last_good_step = last_good, last_good_step
        super().__init__(f"loss became {value} at step {step} (epoch {epoch}); training stopped")


class NullProgress:
    def start(self, total_steps: int, epochs: int) -> None: ...
    def step(self) -> None: ...
    def epoch(self, record: EpochRecord) -> None: ...


def _snapshot(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Session:
    """``warm_up``: run the warm-up even without compilation (benchmarks do, so that
    one-time costs such as kernel selection stay out of the first timed run)."""

    def __init__(self, recipe: Recipe, dataset: ArrayDataset, runtime: Runtime, warm_up: bool = False):
        self.recipe, self.dataset, self.runtime = recipe, dataset, runtime
        self.steps_per_epoch = steps_per_epoch(len(dataset.train_y), recipe.data.batch_size)
        self.total_steps = total_steps(recipe, len(dataset.train_y))
        self.model = self._fresh_model(recipe.train.seed).to(runtime.device, memory_format=runtime.memory_format)
        self.forward = torch.compile(self.model, dynamic=False) if runtime.compile else self.model
        self.compile_seconds = self._warm_up() if (runtime.compile or warm_up) else 0.0
        self._reset_for: int | None = None

    def reset(self, seed: int) -> None:
        """Re-initialise the model from ``seed`` (construction, then a copy onto the device)."""
        self.model.load_state_dict(self._fresh_model(seed).state_dict())
        self._reset_for = seed

    def _fresh_model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(self.recipe.model, self.dataset.in_channels, self.dataset.num_classes)

    def _warm_up(self) -> float:
        """Compile every graph the run will use (train step, eval batch sizes) on random data,
        then restore the weights, so compilation stays out of the timed region."""
        rt, r, ds = self.runtime, self.recipe, self.dataset
        t0 = time.perf_counter()
        saved = _snapshot(self.model)
        shape = (ds.in_channels, *ds.image_size)
        rand = lambda n: torch.randn(n, *shape, device=rt.device, dtype=rt.dtype).contiguous(
            memory_format=rt.memory_format)
        y = torch.randint(0, ds.num_classes, (r.data.batch_size,), device=rt.device)
        self.model.train()
        for _ in range(3):
            with rt.autocast():
                logits = self.forward(rand(r.data.batch_size))
            F.cross_entropy(logits.float(), y).backward()
        self.model.zero_grad(set_to_none=True)
        n_test = len(ds.test_y)
        eval_sizes = {min(r.eval.batch_size, n_test), n_test % r.eval.batch_size} - {0}
        self.model.eval()
        with torch.no_grad(), rt.autocast():
            for n in sorted(eval_sizes):
                for _ in range(2):
                    self.forward(rand(n))
        self.model.train()
        rt.synchronize()
        self.model.load_state_dict(saved)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------
    def run(self, seed: int | None = None, progress=None, on_epoch=None) -> RunResult:
        """Train from a fresh initialisation; ``on_epoch(record)`` is called after each epoch."""
        r, rt = self.recipe, self.runtime
        seed = r.train.seed if seed is None else seed
        progress = progress or NullProgress()
        model, forward = self.model, self.forward
        if self._reset_for != seed:
            self.reset(seed)
        self._reset_for = None
        spe, total = self.steps_per_epoch, self.total_steps
        n_epochs = math.ceil(total / spe)
        progress.start(total, n_epochs)

        rt.synchronize()
        t0 = time.perf_counter()
        paused = 0.0
        # --- first touch of the training data: move, normalise, pad, whiten -------------
        data = ResidentData(self.dataset, rt.device, rt.dtype, rt.memory_format, r.augment.translate)
        whiten = getattr(model, "whiten", None)
        whiten_steps = 0
        if whiten is not None:
            whiten.fit(data.whitening_sample(r.model.whiten.samples))
            whiten_steps = round(r.model.whiten.train_bias_epochs * spe)
        opt = build_optimizer(model, r.optim, r.data.batch_size)
        lrs = lr_multipliers(r.schedule, total)
        moms = momenta(r.schedule, r.optim.momentum, total)
        averager = build_averager(model, r.averaging, total)
        gen = torch.Generator(device=rt.device)
        gen.manual_seed(seed)
        augment = BatchAugment(data.n_train, data.image_size, r.augment.translate, r.augment.flip,
                               r.augment.cutout, gen, rt.device)
        weight_group = next(g for g in opt.param_groups if g["name"] == "weight")
        last_good, last_good_step = _snapshot(model), 0

        step, history = 0, []
        for epoch in range(n_epochs):
            model.train()
            losses = torch.zeros(spe, device=rt.device)
            correct = torch.zeros((), dtype=torch.int64, device=rt.device)
            first = step
            for i, (x, y) in enumerate(data.epoch(epoch, r.data.batch_size, augment, gen)):
                if step == total:
                    break
                set_step_hyperparams(opt, lrs[step], moms[step] if moms else None,
                                     WHITEN_FROZEN if step >= whiten_steps else frozenset())
                with rt.autocast():
                    logits = forward(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=r.train.label_smoothing)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if averager is not None:
                    averager.update(step)
                losses[i] = loss.detach()
                correct += (logits.detach().argmax(1) == y).sum()
                progress.step()
            n = step - first
            # --- once per epoch: read the metrics back ---------------------------------
            host = torch.cat([losses[:n], correct.float()[None]]).tolist()
            step_losses, n_correct = host[:-1], host[-1]
            bad = next((j for j, v in enumerate(step_losses) if not math.isfinite(v)), None)
            if bad is not None:
                raise NonFiniteLoss(first + bad + 1, epoch + 1, step_losses[bad], last_good, last_good_step)
            last_good, last_good_step = _snapshot(model), step
            test_acc = None
            if r.eval.every and (epoch + 1) % r.eval.every == 0 and epoch + 1 < n_epochs:
                rt.synchronize()
                tp = time.perf_counter()
                with averager.applied() if averager is not None else nullcontext():
                    _, plain = evaluate(forward, data.test, data.test_y, "none", r.eval.batch_size, rt)
                test_acc = plain.item() / len(data.test_y)
                paused += time.perf_counter() - tp
            rec = EpochRecord(epoch + 1, sum(step_losses) / n, n_correct / (n * r.data.batch_size),
                              test_acc, weight_group["lr"], time.perf_counter() - t0 - paused)
            history.append(rec)
            if epoch + 1 < n_epochs:
                progress.epoch(rec)
                if on_epoch is not None:
                    on_epoch(rec)

        # --- final evaluation, with the recipe's TTA --------------------------------------
        if averager is not None:
            averager.finalize()
        c_tta, c_plain = evaluate(forward, data.test, data.test_y, r.eval.tta, r.eval.batch_size, rt)
        n_test = len(data.test_y)
        acc, acc_plain = (c / n_test for c in torch.stack([c_tta, c_plain]).tolist())
        rt.synchronize()
        train_seconds = time.perf_counter() - t0 - paused
        history[-1].test_acc, history[-1].seconds = acc_plain, train_seconds
        progress.epoch(history[-1])
        if on_epoch is not None:
            on_epoch(history[-1])
        return RunResult(seed=seed, test_acc=acc, test_acc_no_tta=acc_plain, epochs=step / spe,
                         steps=step, train_seconds=train_seconds, monitor_seconds=paused,
                         history=history, state_dict=_snapshot(model))

    def time_split(self, steps: int = 20, seed: int = 0) -> dict:
        """Seconds per step spent producing batches (data) and training on them (model),
        measured with a device sync between the two, on a throw-away copy of the run."""
        r, rt = self.recipe, self.runtime
        self.reset(seed)
        data = ResidentData(self.dataset, rt.device, rt.dtype, rt.memory_format, r.augment.translate)
        opt = build_optimizer(self.model, r.optim, r.data.batch_size)
        gen = torch.Generator(device=rt.device)
        gen.manual_seed(seed)
        augment = BatchAugment(data.n_train, data.image_size, r.augment.translate, r.augment.flip,
                               r.augment.cutout, gen, rt.device)
        data_s = model_s = 0.0
        done = 0
        self.model.train()
        while done < steps:
            batches = data.epoch(done // self.steps_per_epoch, r.data.batch_size, augment, gen)
            while done < steps:
                rt.synchronize()
                t0 = time.perf_counter()
                try:
                    x, y = next(batches)
                except StopIteration:
                    break
                rt.synchronize()
                t1 = time.perf_counter()
                with rt.autocast():
                    loss = F.cross_entropy(self.forward(x).float(), y, label_smoothing=r.train.label_smoothing)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                rt.synchronize()
                data_s += t1 - t0
                model_s += time.perf_counter() - t1
                done += 1
        self._reset_for = None
        return {"steps": done, "data_seconds_per_step": data_s / done, "model_seconds_per_step": model_s / done,
                "data_seconds_per_epoch": data_s / done * self.steps_per_epoch,
                "model_seconds_per_epoch": model_s / done * self.steps_per_epoch}
