"""The training loop.

A :class:`Session` holds one recipe on one device: the dataset (opened from disk), the
model (built, compiled and warmed up once) and, for distillation, the teacher.
:meth:`Session.run` re-initialises the model from a seed and trains it; benchmarks call it
many times. It can also continue from a checkpoint.

The hot loop never waits for the device: no ``.item()``, no printing of tensors. Per-step
losses and correct counts stay on the device and are read back once per epoch.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..data.augment import BatchAugment
from ..data.resident import ResidentData
from ..data.source import FolderSource, round_to_multiple
from ..data.stream import StreamedData
from ..models import build_model
from ..optim import build_averager, build_optimizer, lr_multipliers, momenta, set_step_hyperparams
from ..recipe import Recipe, steps_per_epoch, total_steps
from . import checkpoint as ckpt
from .batch_finder import fit_batch
from .evaluate import evaluate
from .runtime import Runtime
from .step import Objective, load_teacher

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
    skipped_images: int = 0
    resumed_from_step: int | None = None


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


def epoch_size(recipe: Recipe, epoch: int, full: int) -> int:
    """Training image size for ``epoch`` under progressive resizing (full size without it)."""
    if not recipe.data.progressive:
        return full
    frac = epoch / recipe.train.epochs
    scale = [s for f, s in recipe.data.progressive if f <= frac][-1]
    return full if scale == 1 else round_to_multiple(full * scale, 8)


class Session:
    """``warm_up``: run the warm-up even without compilation (benchmarks do, so that
    one-time costs such as kernel selection stay out of the first timed run)."""

    def __init__(self, recipe: Recipe, source, runtime: Runtime, warm_up: bool = False, say=print):
        self.recipe, self.source, self.runtime = recipe, source, runtime
        self.model = self._fresh_model(recipe.train.seed).to(runtime.device, memory_format=runtime.memory_format)
        self.forward = torch.compile(self.model, dynamic=False) if runtime.compile else self.model
        if recipe.runtime.find_batch:
            self.recipe = recipe = fit_batch(recipe, self.model, self.forward, runtime, source.in_channels,
                                             source.image_size[0], source.num_classes, say)
        self.steps_per_epoch = steps_per_epoch(len(source.train_y), recipe.data.batch_size)
        self.total_steps = total_steps(recipe, len(source.train_y))
        self.n_epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.teacher = load_teacher(recipe.distill.teacher, runtime.device) if recipe.distill.teacher else None
        self.compile_seconds = self._warm_up() if (runtime.compile or warm_up) else 0.0
        self._reset_for: int | None = None

    # kept for callers that replace the dataset between runs (bench's end_to_end region)
    @property
    def dataset(self):
        return self.source

    @dataset.setter
    def dataset(self, source) -> None:
        self.source = source

    def _fresh_model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(self.recipe.model, self.source.in_channels, self.source.num_classes)

    def reset(self, seed: int) -> None:
        """Re-initialise the model from ``seed`` (construction, then a copy onto the device)."""
        self.model.load_state_dict(self._fresh_model(seed).state_dict())
        self._reset_for = seed

    def _sizes(self) -> list[int]:
        full = self.source.image_size[0]
        return sorted({epoch_size(self.recipe, e, full) for e in range(self.n_epochs)})

    def _warm_up(self) -> float:
        """Compile every graph the run will use (train step at each image size, eval batch
        sizes) on random data, then restore the weights, so compilation stays out of the
        timed region."""
        rt, r, src = self.runtime, self.recipe, self.source
        t0 = time.perf_counter()
        saved = _snapshot(self.model)
        rand = lambda n, s: torch.randn(n, src.in_channels, s, s, device=rt.device, dtype=rt.dtype).contiguous(
            memory_format=rt.memory_format)
        micro = math.ceil(r.data.batch_size / r.train.accumulate)
        self.model.train()
        for size in self._sizes():
            y = torch.randint(0, src.num_classes, (micro,), device=rt.device)
            for _ in range(3):
                with rt.autocast():
                    logits = self.forward(rand(micro, size))
                F.cross_entropy(logits.float(), y).backward()
        self.model.zero_grad(set_to_none=True)
        n_test = len(src.test_y)
        eval_sizes = {min(r.eval.batch_size, n_test), n_test % r.eval.batch_size} - {0}
        if r.eval.tta_fraction < 1:                  # the least-confident subsets get their own graphs
            eval_sizes |= {max(1, math.ceil(r.eval.tta_fraction * n)) for n in eval_sizes}
        self.model.eval()
        with torch.no_grad(), rt.autocast():
            for n in sorted(eval_sizes):
                for _ in range(2):
                    self.forward(rand(n, src.image_size[0]))
        self.model.train()
        rt.synchronize()
        self.model.load_state_dict(saved)
        return time.perf_counter() - t0

    def _data(self, seed: int):
        r, rt, src = self.recipe, self.runtime, self.source
        if isinstance(src, FolderSource):
            return StreamedData(src.train, src.val, src.channels, src.size, r.data, r.augment, rt, seed,
                                src.mean, src.std, r.data.batch_size, r.eval.batch_size)
        translate = r.augment.translate if r.augment.crop == "translate" else 0
        return ResidentData(src, rt.device, rt.dtype, rt.memory_format, translate)

    # ------------------------------------------------------------------------------------
    def run(self, seed: int | None = None, progress=None, on_epoch=None, checkpoint_dir: Path | None = None,
            resume: dict | None = None) -> RunResult:
        """Train from a fresh initialisation (or from the checkpoint ``resume``);
        ``on_epoch(record)`` is called after each epoch."""
        r, rt = self.recipe, self.runtime
        seed = (resume["seed"] if resume else r.train.seed) if seed is None else seed
        progress = progress or NullProgress()
        model, forward = self.model, self.forward
        if self._reset_for != seed:
            self.reset(seed)
        self._reset_for = None
        spe, total, n_epochs = self.steps_per_epoch, self.total_steps, self.n_epochs
        every_steps = r.checkpoint.every_steps or (round(r.checkpoint.every_epochs * spe)
                                                   if r.checkpoint.every_epochs else 0)
        progress.start(total, n_epochs)

        rt.synchronize()
        t0 = time.perf_counter()
        paused = 0.0
        # --- first touch of the training data: move, normalise, pad, whiten -------------
        data = self._data(seed)
        whiten = getattr(model, "whiten", None)
        whiten_steps = 0
        if whiten is not None:
            if resume is None:
                whiten.fit(data.whitening_sample(r.model.whiten.samples))
            whiten_steps = round(r.model.whiten.train_bias_epochs * spe)
        opt = build_optimizer(model, r.optim, r.data.batch_size)
        lrs = lr_multipliers(r.schedule, total, spe)
        moms = momenta(r.schedule, r.optim.momentum, total)
        averager = build_averager(model, r.averaging, total)
        objective = Objective(r, rt, forward, self.teacher)
        gen = torch.Generator(device=rt.device)
        gen.manual_seed(seed)
        augment = BatchAugment(r.augment, data.n_train, data.image_size, gen, rt.device, data.mean, data.std,
                               resized_crop=not isinstance(data, StreamedData))
        host_rng = np.random.default_rng(seed)

        step, history, start_epoch, skip = 0, [], 0, 0
        partial = None
        if resume is not None:
            step, history, start_epoch, skip, partial = self._restore(resume, opt, objective, averager, gen,
                                                                      host_rng, data)
            t0 -= resume["elapsed"]
            paused = resume["paused"]
        # looked up after any restore: load_state_dict replaces the optimizer's group dicts
        weight_group = next(g for g in opt.param_groups if g["name"] in ("weight", "filters"))
        last_good, last_good_step = _snapshot(model), step

        for epoch in range(start_epoch, n_epochs):
            model.train()
            losses = torch.zeros(spe, device=rt.device)
            correct = torch.zeros((), dtype=torch.int64, device=rt.device)
            if partial is not None:
                losses[:skip], correct = partial[0].to(rt.device), partial[1].to(rt.device)
            epoch_gen_state = gen.get_state() if partial is None else resume["epoch_gen_state"]
            partial = None
            first = step - skip
            size = epoch_size(r, epoch, data.image_size[0])
            batches = data.epoch(epoch, r.data.batch_size, augment, gen, size=size, skip=skip)
            for i, (x, y) in enumerate(batches, start=skip):
                if step == total:
                    break
                set_step_hyperparams(opt, lrs[step], moms[step] if moms else None,
                                     WHITEN_FROZEN if step >= whiten_steps else frozenset())
                loss, n_correct = objective.step(opt, x, y, host_rng)
                step += 1
                if averager is not None:
                    averager.update(step)
                losses[i] = loss
                correct += n_correct
                progress.step()
                if checkpoint_dir is not None and every_steps and step % every_steps == 0 and step < total:
                    tp = time.perf_counter()
                    self._save(checkpoint_dir, seed, step, epoch, i + 1, opt, objective, averager, epoch_gen_state,
                               host_rng, losses[:i + 1], correct, history, t0, paused)
                    paused += time.perf_counter() - tp
            skip = 0
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
                    _, plain, n_test = evaluate(forward, data.test_batches(r.eval.batch_size), "none", rt)
                test_acc = plain.item() / n_test
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
        c_tta, c_plain, n_test = evaluate(forward, data.test_batches(r.eval.batch_size), r.eval.tta, rt,
                                          r.eval.tta_fraction)
        acc, acc_plain = (c / n_test for c in torch.stack([c_tta, c_plain]).tolist())
        rt.synchronize()
        train_seconds = time.perf_counter() - t0 - paused
        history[-1].test_acc, history[-1].seconds = acc_plain, train_seconds
        progress.epoch(history[-1])
        if on_epoch is not None:
            on_epoch(history[-1])
        return RunResult(seed=seed, test_acc=acc, test_acc_no_tta=acc_plain, epochs=step / spe,
                         steps=step, train_seconds=train_seconds, monitor_seconds=paused,
                         history=history, state_dict=_snapshot(model), skipped_images=data.skipped,
                         resumed_from_step=resume["step"] if resume else None)

    # ------------------------------------------------------------------------------------
    def _save(self, folder, seed, step, epoch, batch_in_epoch, opt, objective, averager, epoch_gen_state,
              host_rng, losses, correct, history, t0, paused) -> None:
        self.runtime.synchronize()
        ckpt.save(folder, {
            "recipe": self.recipe.to_dict(), "recipe_hash": self.recipe.digest(), "seed": seed,
            "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "model": self.model.state_dict(), "optimizer": opt.state_dict(),
            "scaler": objective.scaler.state_dict(),
            "averager": averager.shadow if averager is not None else None,
            "epoch_gen_state": epoch_gen_state.cpu(), "host_rng": host_rng.bit_generator.state,
            "cpu_rng": torch.get_rng_state(),
            "losses": losses.detach().cpu(), "correct": correct.detach().cpu(),
            "history": [asdict(h) for h in history],
            "elapsed": time.perf_counter() - t0, "paused": paused,
        })

    def _restore(self, state: dict, opt, objective, averager, gen, host_rng, data):
        if state["recipe_hash"] != self.recipe.digest():
            from ..recipe import RecipeError
            raise RecipeError("the checkpoint was written by a different recipe; resume with the run's own "
                              "config.toml (speedrun train --resume RUN_DIR)")
        self.model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        objective.scaler.load_state_dict(state["scaler"])
        if averager is not None and state["averager"] is not None:
            torch._foreach_copy_(averager.shadow, [t.to(self.runtime.device) for t in state["averager"]])
        gen.set_state(state["epoch_gen_state"].to(gen.device) if gen.device.type != "cpu" else state["epoch_gen_state"])
        host_rng.bit_generator.state = state["host_rng"]
        torch.set_rng_state(state["cpu_rng"])
        history = [EpochRecord(**h) for h in state["history"]]
        return (state["step"], history, state["epoch"], state["batch_in_epoch"],
                (state["losses"], state["correct"]))

    def time_split(self, steps: int = 20, seed: int = 0) -> dict:
        """Seconds per step spent producing batches (data) and training on them (model),
        measured with a device sync between the two, on a throw-away copy of the run."""
        r, rt = self.recipe, self.runtime
        self.reset(seed)
        data = self._data(seed)
        opt = build_optimizer(self.model, r.optim, r.data.batch_size)
        objective = Objective(r, rt, self.forward, self.teacher)
        gen = torch.Generator(device=rt.device)
        gen.manual_seed(seed)
        augment = BatchAugment(r.augment, data.n_train, data.image_size, gen, rt.device, data.mean, data.std,
                               resized_crop=not isinstance(data, StreamedData))
        rng = np.random.default_rng(seed)
        data_s = model_s = 0.0
        done = 0
        self.model.train()
        epoch = 0
        while done < steps:
            batches = data.epoch(epoch, r.data.batch_size, augment, gen)
            while done < steps:
                rt.synchronize()
                t0 = time.perf_counter()
                try:
                    x, y = next(batches)
                except StopIteration:
                    break
                rt.synchronize()
                t1 = time.perf_counter()
                objective.step(opt, x, y, rng)
                rt.synchronize()
                data_s += t1 - t0
                model_s += time.perf_counter() - t1
                done += 1
            epoch += 1
        self._reset_for = None
        return {"steps": done, "data_seconds_per_step": data_s / done, "model_seconds_per_step": model_s / done,
                "data_seconds_per_epoch": data_s / done * self.steps_per_epoch,
                "model_seconds_per_epoch": model_s / done * self.steps_per_epoch}
