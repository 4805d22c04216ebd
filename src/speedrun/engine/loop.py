"""The training loop.

A :class:`Session` holds one recipe on one device: the dataset (opened from disk), the
model (built, compiled and warmed up once per process) and, for distillation, the teacher.
:meth:`Session.run` re-initialises the model from a seed and trains it; benchmarks call it
many times. It can also continue from a checkpoint.

The hot loop never waits for the device: no ``.item()``, no printing of tensors. Per-step
losses and correct counts stay on the device and are read back once per epoch. The clock
(``train_seconds``) runs from the first touch of the training data to the final accuracy;
everything else a run does (snapshots of the last good weights, checkpoints, metrics
files, progress, monitoring evaluations) happens with the clock paused, in ``train`` and
``bench`` alike.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..data.augment import BatchAugment
from ..data.dataset import open_pipeline, nearest_multiple
from ..data.shard import Shard
from ..errors import DataError, RecipeError
from ..models import build_model
from ..optim import build_averager, build_optimizer, lr_multipliers, momenta, set_step_hyperparams
from ..recipe import Recipe, steps_per_epoch, total_steps
from ..models.norm import BatchNorm
from . import checkpoint as ckpt
from . import distributed
from .batch_finder import fit_batch
from .distributed import World
from .evaluate import evaluate
from .runtime import Runtime, compiled_graphs, compiled_model
from .step import Objective, load_teacher
from .warmup import warm_up as run_warm_up

WHITEN_FROZEN = frozenset({"whiten_bias"})

NONFINITE_PATIENCE = 20
"""With fp16 loss scaling a step whose loss or gradients overflow is skipped by the scaler
(which lowers the scale); the run stops only after this many such steps in a row."""


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float
    train_acc: float
    test_acc: float | None
    lr: float
    seconds: float
    skipped_steps: int = 0


@dataclass
class EpochSteps:
    """One epoch's training steps as host values, for metric logs: the losses from the
    epoch's one read-back, the weight group's learning rate and the momentum (when the
    schedule sets it) from the precomputed schedule. Steps are numbered from 1."""
    epoch: int
    first_step: int
    loss: list[float]
    lr: list[float]
    momentum: list[float] | None


@dataclass
class RunResult:
    seed: int
    test_acc: float
    test_acc_no_tta: float
    epochs: float
    steps: int
    train_seconds: float
    monitor_seconds: float
    bookkeeping_seconds: float = 0.0
    recompiles: int = 0
    history: list[EpochRecord] = field(default_factory=list)
    state_dict: dict | None = None
    skipped_images: int = 0
    resumed_from_step: int | None = None
    normalisation: tuple[list[float], list[float]] = ((), ())   # per-channel mean, std (0..255)


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; carries the last good weights."""

    def __init__(self, step: int, epoch: int, value: float, last_good: dict, last_good_step: int):
        self.step, self.epoch, self.value = step, epoch, value
        self.last_good, self.last_good_step = last_good, last_good_step
        super().__init__(f"loss became {value} at step {step} (epoch {epoch}); training stopped")


class DataFailure(RuntimeError):
    """A data error in the middle of a run; carries the last good weights."""

    def __init__(self, error: Exception, last_good: dict, last_good_step: int):
        self.error, self.last_good, self.last_good_step = error, last_good, last_good_step
        super().__init__(str(error))


class NullProgress:
    def start(self, total_steps: int, epochs: int, batch_size: int) -> None: ...
    def step(self, loss: torch.Tensor) -> None: ...
    def epoch(self, record: EpochRecord) -> None: ...


def _snapshot(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class LastGood:
    """The weights after the last epoch whose losses were all finite, in buffers allocated
    once and refreshed with one foreach copy (the clock is paused around it)."""

    def __init__(self, model: torch.nn.Module, step: int):
        self.state = _snapshot(model)
        self.step = step

    def take(self, model: torch.nn.Module, step: int) -> None:
        live = model.state_dict()
        torch._foreach_copy_([self.state[k] for k in live], list(live.values()))
        self.step = step


class Clock:
    """Seconds of training: wall time with the device synchronised at each reading, minus
    the stretches spent in :meth:`paused` (per kind: monitoring evaluations, bookkeeping)."""

    def __init__(self, runtime: Runtime, elapsed: float = 0.0, paused: dict | None = None):
        self.rt = runtime
        runtime.synchronize()
        self.t0 = time.perf_counter() - elapsed
        self.paused = {"monitor": 0.0, "bookkeeping": 0.0, **(paused or {})}

    @contextmanager
    def pause(self, kind: str):
        self.rt.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.rt.synchronize()
            self.paused[kind] += time.perf_counter() - t

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def seconds(self) -> float:
        self.rt.synchronize()
        return self.elapsed() - sum(self.paused.values())


@dataclass
class TrainState:
    """Everything a run changes as it trains, besides the model; what a checkpoint saves."""
    opt: torch.optim.Optimizer
    lrs: list[float]
    moms: list[float] | None
    averager: object
    objective: Objective
    gen: torch.Generator
    augment: BatchAugment
    host_rng: np.random.Generator
    whiten_steps: int
    step: int = 0
    epoch: int = 0
    skip: int = 0                         # batches of ``epoch`` already trained (resume)
    partial: tuple | None = None          # losses and correct count of those batches
    epoch_gen_state: torch.Tensor | None = None
    history: list[EpochRecord] = field(default_factory=list)
    nonfinite_run: int = 0


def first_bad_step(losses: list[float], loss_scaling: bool, run_before: int = 0) -> tuple[int | None, int, int]:
    """(index of the step that stops the run or None, steps skipped as overflows, the run of
    non-finite losses at the end). Without loss scaling the first non-finite loss stops the
    run; with it, only ``NONFINITE_PATIENCE`` in a row (counting ``run_before`` from the
    previous epoch) do."""
    run = run_before
    for j, v in enumerate(losses):
        if math.isfinite(v):
            run = 0
            continue
        if not loss_scaling:
            return j, 0, 0
        run += 1
        if run >= NONFINITE_PATIENCE:
            return j, 0, run
    return None, sum(not math.isfinite(v) for v in losses), run


def local_batch(recipe: Recipe, world: World) -> int:
    """This process's share of the global batch (``data.batch_size`` is over all processes):
    its share of each of the ``train.accumulate`` micro-batches the batch is cut into."""
    b, k = recipe.data.batch_size, recipe.train.accumulate
    micro = b // k
    if micro % world.size:
        what = f"data.batch_size={b}" + (f" / train.accumulate={k} = {micro} images per micro-batch" if k > 1 else "")
        raise RecipeError(f"{what} does not split evenly over {world.size} processes; use a multiple of "
                          f"{world.size * k} (or data.per_device_batch)")
    ghost = recipe.model.norm.ghost_batch
    if ghost and (micro // world.size) % ghost:
        raise RecipeError(f"each of the {world.size} processes normalises micro-batches of {micro // world.size} "
                          f"images, which model.norm.ghost_batch={ghost} must divide")
    return b // world.size


def epoch_size(recipe: Recipe, epoch: int, full: int) -> int:
    """Training image size for ``epoch`` under progressive resizing (full size without it)."""
    if not recipe.data.progressive:
        return full
    frac = epoch / recipe.train.epochs
    scale = [s for f, s in recipe.data.progressive if f <= frac][-1]
    return full if scale == 1 else nearest_multiple(full * scale, 8)


class Session:
    """One recipe on one device, in one process of ``world`` (default: the only one).

    ``warm_up``: run the warm-up even without compilation (benchmarks do, so that one-time
    costs such as kernel selection stay out of the first timed run)."""

    def __init__(self, recipe: Recipe, source, runtime: Runtime, warm_up: bool = False, say=print,
                 world: World = World()):
        self.recipe, self.source, self.runtime, self.world = recipe, source, runtime, world
        runtime.activate()
        self.model, self.forward = self._build(recipe.train.seed)
        if recipe.runtime.find_batch:
            self.recipe = recipe = fit_batch(recipe, self.model, self.forward, runtime, source.in_channels,
                                             source.image_size[0], source.num_classes, say)
        self.local_batch = local_batch(recipe, world)
        self.shard = Shard(world.rank, world.size, recipe.train.accumulate)
        self.steps_per_epoch = steps_per_epoch(len(source.train_y), recipe.data.batch_size)
        self.total_steps = total_steps(recipe, len(source.train_y))
        self.n_epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.teacher = load_teacher(recipe.distill.teacher, runtime.device, source.in_channels,
                                    source.num_classes) if recipe.distill.teacher else None
        self.compile_seconds = 0.0
        if runtime.compile or warm_up:
            self.compile_seconds = run_warm_up(self)
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

    def _build(self, seed: int):
        """(model on the device, forward): batch norm joined to its process group, the start
        checked identical on every rank, wrapped for data parallelism, and compiled once per
        process for a given model."""
        rt, world = self.runtime, self.world

        def build():
            model = self._fresh_model(seed).to(rt.device, memory_format=rt.memory_format)
            group = distributed.norm_group(self.recipe.model.norm.sync_ranks, world)
            for m in model.modules():
                if isinstance(m, BatchNorm):
                    m.group = group
            distributed.check_same_start(model, world, rt.device)
            return model
        wrap = lambda model: distributed.wrap(model, self.recipe.distributed, world, rt.device)
        if not rt.compile:
            model = build()
            return model, wrap(model)
        key = (self.recipe.model.model_dump_json(), self.source.in_channels, self.source.num_classes,
               str(rt.device), rt.precision, rt.channels_last, rt.compile_mode, rt.compile_backend, world.size)
        model, forward, reused = compiled_model(key, build, rt, wrap)
        if reused:                                      # as built from the seed, but in the same tensors
            model.load_state_dict(self._fresh_model(seed).state_dict())
            model.zero_grad(set_to_none=True)
        return model, forward

    def reset(self, seed: int) -> None:
        """Re-initialise the model from ``seed`` (construction, then a copy onto the device)."""
        self.model.load_state_dict(self._fresh_model(seed).state_dict())
        self.model.zero_grad(set_to_none=True)
        self._reset_for = seed

    def image_sizes(self) -> list[int]:
        full = self.source.image_size[0]
        return sorted({epoch_size(self.recipe, e, full) for e in range(self.n_epochs)})

    # ------------------------------------------------------------------------------------
    def _train_state(self, data, seed: int) -> TrainState:
        r, rt, spe, total = self.recipe, self.runtime, self.steps_per_epoch, self.total_steps
        gen = torch.Generator(device=rt.device)
        gen.manual_seed(seed)
        return TrainState(
            opt=build_optimizer(self.model, r.optim, r.data.batch_size),
            lrs=lr_multipliers(r.schedule, total, spe), moms=momenta(r.schedule, r.optim.momentum, total),
            averager=build_averager(self.model, r.averaging, total),
            objective=Objective(r, rt, self.forward, self.teacher, no_sync=lambda: distributed.no_sync(self.forward)),
            gen=gen,
            augment=BatchAugment(r.augment, data.n_train, data.image_size, gen, rt.device, data.mean, data.std,
                                 resized_crop=not data.crops_in_workers),
            host_rng=np.random.default_rng(seed),
            whiten_steps=round(r.model.whiten.train_bias_epochs * spe) if getattr(self.model, "whiten", None) else 0)

    def run(self, seed: int | None = None, progress=None, on_epoch=None, checkpoint_dir: Path | None = None,
            resume: dict | None = None, on_steps=None) -> RunResult:
        """Train from a fresh initialisation (or from the checkpoint ``resume``);
        ``on_epoch(record)`` is called after each epoch, ``on_steps(EpochSteps)`` after each
        epoch's losses are read back (with the clock paused)."""
        r, rt, model = self.recipe, self.runtime, self.model
        seed = (resume["seed"] if resume else r.train.seed) if seed is None else seed
        progress = progress or NullProgress()
        if self._reset_for != seed:
            self.reset(seed)
        self._reset_for = None
        graphs_before = compiled_graphs() if rt.compile else 0
        progress.start(self.total_steps, self.n_epochs, r.data.batch_size)

        clock = Clock(rt)
        # --- first touch of the training data: move, measure, whiten --------------------
        data = open_pipeline(self.source, r, rt, seed, self.shard)
        whiten = getattr(model, "whiten", None)
        if whiten is not None and resume is None:
            whiten.fit(data.whitening_sample(r.model.whiten.samples))
        st = self._train_state(data, seed)
        if resume is not None:
            clock = self._restore(resume, st)
        # looked up after any restore: load_state_dict replaces the optimizer's group dicts
        weight_group = next(g for g in st.opt.param_groups if g["name"] in ("weight", "filters"))
        with clock.pause("bookkeeping"):
            last_good = LastGood(model, st.step)

        try:
            for epoch in range(st.epoch, self.n_epochs):
                st.epoch = epoch
                losses, correct, first = self._train_epoch(data, st, progress, clock, seed, checkpoint_dir)
                with clock.pause("bookkeeping"):
                    rec, step_losses = self._check_epoch(st, losses, correct, first, last_good, weight_group["lr"])
                    last_good.take(model, st.step)
                    if on_steps is not None:
                        base_lr = weight_group["base_lr"]
                        on_steps(EpochSteps(epoch + 1, first + 1, step_losses,
                                            [base_lr * m for m in st.lrs[first:st.step]],
                                            st.moms[first:st.step] if st.moms else None))
                if r.eval.every and (epoch + 1) % r.eval.every == 0 and epoch + 1 < self.n_epochs:
                    with clock.pause("monitor"), (st.averager.applied() if st.averager else nullcontext()):
                        _, plain, n_test = self._evaluate(data, "none", 1.0).tolist()
                        rec.test_acc = plain / n_test
                rec.seconds = clock.seconds()
                st.history.append(rec)
                if epoch + 1 < self.n_epochs:
                    with clock.pause("bookkeeping"):
                        progress.epoch(rec)
                        if on_epoch is not None:
                            on_epoch(rec)

            # --- final evaluation, with the recipe's TTA --------------------------------------
            if st.averager is not None:
                st.averager.finalize()
            c_tta, c_plain, n_test = self._evaluate(data, r.eval.tta, r.eval.tta_fraction).tolist()
        except DataError as err:
            if st.step == 0:
                raise
            raise DataFailure(err, last_good.state, last_good.step) from None
        acc, acc_plain = c_tta / n_test, c_plain / n_test
        train_seconds = clock.seconds()
        st.history[-1].test_acc, st.history[-1].seconds = acc_plain, train_seconds
        progress.epoch(st.history[-1])
        if on_epoch is not None:
            on_epoch(st.history[-1])
        return RunResult(seed=seed, test_acc=acc, test_acc_no_tta=acc_plain, epochs=st.step / self.steps_per_epoch,
                         steps=st.step, train_seconds=train_seconds, monitor_seconds=clock.paused["monitor"],
                         bookkeeping_seconds=clock.paused["bookkeeping"],
                         recompiles=compiled_graphs() - graphs_before if rt.compile else 0,
                         history=st.history, state_dict=_snapshot(model), skipped_images=data.skipped,
                         resumed_from_step=resume["step"] if resume else None,
                         normalisation=(data.mean.tolist(), data.std.tolist()))

    def _evaluate(self, data, tta: str, fraction: float) -> torch.Tensor:
        """(correct with TTA, correct without, images) over the whole test set: each rank
        evaluates its share with the batch-norm statistics averaged over ranks, and the counts
        are summed."""
        distributed.average_norm_statistics(self.model, self.world)
        c_tta, c_plain, n = evaluate(self.forward, data.test_batches(self.recipe.eval.batch_size), tta, self.runtime,
                                     fraction)
        counts = torch.stack([c_tta, c_plain, torch.tensor(n, device=c_tta.device)]).to(torch.float64)
        return distributed.all_reduce_sum(counts, self.world)

    def _train_epoch(self, data, st: TrainState, progress, clock: Clock, seed: int, checkpoint_dir):
        """One epoch of training steps; returns the per-step losses and the correct count (on
        the device) and the step number the epoch started at."""
        r, rt, spe = self.recipe, self.runtime, self.steps_per_epoch
        every = r.checkpoint.every_steps or (round(r.checkpoint.every_epochs * spe) if r.checkpoint.every_epochs else 0)
        losses = torch.zeros(spe, device=rt.device)
        correct = torch.zeros((), dtype=torch.int64, device=rt.device)
        skip = st.skip
        if st.partial is not None:
            losses[:skip], correct = st.partial[0].to(rt.device), st.partial[1].to(rt.device)
        else:
            st.epoch_gen_state = st.gen.get_state()
        st.partial, st.skip = None, 0
        first = st.step - skip
        size = epoch_size(r, st.epoch, data.image_size[0])
        for i, (x, y) in enumerate(data.epoch(st.epoch, r.data.batch_size, st.augment, st.gen, size=size, skip=skip),
                                   start=skip):
            if st.step == self.total_steps:
                break
            set_step_hyperparams(st.opt, st.lrs[st.step], st.moms[st.step] if st.moms else None,
                                 WHITEN_FROZEN if st.step >= st.whiten_steps else frozenset())
            rt.mark_step()
            loss, n_correct = st.objective.step(st.opt, x, y, st.host_rng)
            st.step += 1
            if st.averager is not None:
                st.averager.update(st.step)
            losses[i] = loss
            correct += n_correct
            progress.step(loss)
            if checkpoint_dir is not None and every and st.step % every == 0 and st.step < self.total_steps:
                with clock.pause("bookkeeping"):
                    self._save(checkpoint_dir, seed, st, i + 1, losses[:i + 1], correct, clock)
        return losses[:st.step - first], correct, first

    def _check_epoch(self, st: TrainState, losses, correct, first: int, last_good: LastGood,
                     lr: float) -> tuple[EpochRecord, list[float]]:
        """Read the epoch's metrics back (the record and the per-step losses, averaged over
        ranks); stop on a non-finite loss (see :func:`first_bad_step`)."""
        n = len(losses)
        w = self.world
        summed = distributed.all_reduce_sum(torch.cat([losses, correct.float()[None]]), w)   # ranks' means, counts
        host = torch.cat([summed[:-1] / w.size, summed[-1:]]).tolist()
        step_losses, n_correct = host[:-1], host[-1]
        scaling = st.objective.scaler.is_enabled()
        bad, skipped, st.nonfinite_run = first_bad_step(step_losses, scaling, st.nonfinite_run)
        if bad is not None:
            raise NonFiniteLoss(first + bad + 1, st.epoch + 1, step_losses[bad], last_good.state, last_good.step)
        finite = [v for v in step_losses if math.isfinite(v)]
        mean_loss = sum(finite) / len(finite) if finite else math.nan
        return EpochRecord(st.epoch + 1, mean_loss, n_correct / (n * self.recipe.data.batch_size), None, lr, 0.0,
                           skipped), step_losses

    # ------------------------------------------------------------------------------------
    def _save(self, folder, seed: int, st: TrainState, batch_in_epoch: int, losses, correct, clock: Clock) -> None:
        ckpt.save(folder, {
            "recipe": self.recipe.to_dict(), "recipe_hash": self.recipe.digest(), "seed": seed,
            "step": st.step, "epoch": st.epoch, "batch_in_epoch": batch_in_epoch,
            "model": self.model.state_dict(), "optimizer": st.opt.state_dict(),
            "scaler": st.objective.scaler.state_dict(),
            "averager": st.averager.shadow if st.averager is not None else None,
            "epoch_gen_state": st.epoch_gen_state.cpu(), "host_rng": st.host_rng.bit_generator.state,
            "cpu_rng": torch.get_rng_state(),
            "losses": losses.detach().cpu(), "correct": correct.detach().cpu(),
            "history": [asdict(h) for h in st.history], "nonfinite_run": st.nonfinite_run,
            "elapsed": clock.elapsed(), "paused": dict(clock.paused),
        })

    def _restore(self, state: dict, st: TrainState) -> Clock:
        if state["recipe_hash"] != self.recipe.digest():
            raise RecipeError("the checkpoint was written by a different recipe; resume with the run's own "
                              "config.toml (speedrun train --resume RUN_DIR)")
        self.model.load_state_dict(state["model"])
        st.opt.load_state_dict(state["optimizer"])
        st.objective.scaler.load_state_dict(state["scaler"])
        if st.averager is not None and state["averager"] is not None:
            torch._foreach_copy_(st.averager.shadow, [t.to(self.runtime.device) for t in state["averager"]])
        # Generator.set_state takes a CPU byte tensor, for CUDA generators too
        st.epoch_gen_state = state["epoch_gen_state"].cpu()
        st.gen.set_state(st.epoch_gen_state)
        st.host_rng.bit_generator.state = state["host_rng"]
        torch.set_rng_state(state["cpu_rng"])
        st.history = [EpochRecord(**h) for h in state["history"]]
        st.step, st.epoch, st.skip = state["step"], state["epoch"], state["batch_in_epoch"]
        st.partial = (state["losses"], state["correct"])
        st.nonfinite_run = state.get("nonfinite_run", 0)
        return Clock(self.runtime, state["elapsed"], state["paused"])

    def time_split(self, steps: int = 20, seed: int = 0) -> dict:
        """Seconds per step spent producing batches (data) and training on them (model),
        measured with a device sync between the two, on a throw-away copy of the run."""
        rt = self.runtime
        self.reset(seed)
        data = open_pipeline(self.source, self.recipe, rt, seed)
        st = self._train_state(data, seed)
        data_s = model_s = 0.0
        done = 0
        self.model.train()
        epoch = 0
        while done < steps:
            batches = data.epoch(epoch, self.recipe.data.batch_size, st.augment, st.gen)
            while done < steps:
                rt.synchronize()
                t0 = time.perf_counter()
                try:
                    x, y = next(batches)
                except StopIteration:
                    break
                rt.synchronize()
                t1 = time.perf_counter()
                rt.mark_step()
                st.objective.step(st.opt, x, y, st.host_rng)
                rt.synchronize()
                data_s += t1 - t0
                model_s += time.perf_counter() - t1
                done += 1
            epoch += 1
        self._reset_for = None
        return {"steps": done, "data_seconds_per_step": data_s / done, "model_seconds_per_step": model_s / done,
                "data_seconds_per_epoch": data_s / done * self.steps_per_epoch,
                "model_seconds_per_epoch": model_s / done * self.steps_per_epoch}
