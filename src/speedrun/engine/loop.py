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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.augment import BatchAugment
from ..data.choices import nearest_multiple
from ..data.dataset import open_pipeline, place_source
from ..data.pruning import LossPruner
from ..data.shard import Shard
from ..errors import DataError, RecipeError
from ..models import build_model
from ..recipe import Recipe, steps_per_epoch, total_steps
from ..models.norm import BatchNorm
from . import checkpoint as ckpt
from . import distributed
from . import flops
from .batch_finder import check_model_memory, fit_batch
from .distributed import World
from .evaluate import evaluate
from .records import EpochRecord, EpochSteps, RunResult
from .runtime import Runtime, compiled_graphs, compiled_model
from .step import TrainStep, load_teacher, resized_in_step
from .warmup import warm_up as run_warm_up

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


class DataFailure(RuntimeError):
    """A data error in the middle of a run; carries the last good weights."""

    def __init__(self, error: Exception, last_good: dict, last_good_step: int):
        self.error, self.last_good, self.last_good_step = error, last_good, last_good_step
        super().__init__(str(error))


class NullProgress:
    def start(self, total_steps: int, epochs: float, batch_size: int) -> None: ...
    def step(self) -> None: ...
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
class RunState:
    """What a run changes as it trains besides the model and the step's own state (see
    :class:`~speedrun.engine.step.TrainStep`); with that, what a checkpoint saves."""
    gen: torch.Generator
    augment: BatchAugment
    step: int = 0
    epoch: int = 0
    skip: int = 0                         # batches of ``epoch`` already trained (resume)
    epoch_gen_state: torch.Tensor | None = None
    history: list[EpochRecord] = field(default_factory=list)
    nonfinite_run: int = 0


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


def epoch_image_side(recipe: Recipe, epoch: int, full: int) -> int:
    """Training image side in px for ``epoch`` under progressive resizing (``full``, the full
    side, without it): a multiple of 8 px, or of 4 px for images under 64 px, where steps of 8
    are too coarse (a 32 px image trains at 24 and 28 px, as in the 2026 CIFAR-10 record)."""
    if not recipe.data.progressive:
        return full
    frac = epoch / recipe.train.epochs
    scale = [s for f, s in recipe.data.progressive if f <= frac][-1]
    return full if scale == 1 else nearest_multiple(full * scale, 4 if full < 64 else 8)


def settle(recipe: Recipe, source, runtime: Runtime, say=print) -> Recipe:
    """The recipe as the engine will run it, settled before a :class:`Session` is made: with
    ``runtime.find_batch``, the largest ``data.batch_size`` whose real training step fits (a
    model-only session probes it; the run's session then gets the same compiled model back).
    The data-derived values were settled when the data was opened (``open_source``)."""
    if not recipe.runtime.find_batch:
        return recipe
    probe = Session(recipe, source, runtime, probe_only=True)
    return fit_batch(recipe, probe._probe, runtime, say)


class Session:
    """One recipe on one device, in one process of ``world`` (default: the only one). Its
    three jobs: build the model and its training step for the runtime (once per process,
    compiled and warmed up where the runtime compiles); train from a seed (:meth:`run`);
    continue a run from a checkpoint (:meth:`run` with ``resume``).

    ``warm_up``: run the warm-up even without compilation (benchmarks do, so that one-time
    costs such as kernel selection stay out of the first timed run)."""

    def __init__(self, recipe: Recipe, source, runtime: Runtime, warm_up: bool = False,
                 world: World = World(), probe_only: bool = False):
        runtime = runtime.activate(hold_memory=not probe_only)
        self.recipe, self.source, self.runtime, self.world = recipe, source, runtime, world
        self.model, self.forward = self._build(recipe.train.seed)
        self.teacher = load_teacher(recipe.distill.teacher, runtime, source.in_channels,
                                    source.num_classes) if recipe.distill.teacher else None
        if probe_only:                                  # the model, for settle()'s probes: nothing to train
            return
        self.local_batch = local_batch(recipe, world)
        if recipe.data.prune and world.size > 1:
            raise RecipeError(f"data.prune={recipe.data.prune} keeps each image's loss in one process; it does not "
                              f"run data-parallel ({world.size} processes): set data.prune=0")
        self.shard = Shard(world.rank, world.size, recipe.train.accumulate)
        self.steps_per_epoch = steps_per_epoch(len(source.train_y), recipe.data.batch_size)
        self.total_steps = total_steps(recipe, len(source.train_y))
        self.n_epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.step = self._train_step(recipe)
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

    # ------------------------------------------------------------------------------------
    # Building
    # ------------------------------------------------------------------------------------
    def _fresh_model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_model(self.recipe.model, self.source.in_channels, self.source.num_classes)

    def _build(self, seed: int):
        """(model on the device, forward for evaluation): batch norm joined to its process
        group, the start checked identical on every rank, wrapped for data parallelism, and
        compiled once per process for a given model. The training step calls the wrapped
        model (``self.module``) inside its own compiled program."""
        rt, world = self.runtime, self.world
        # a model that cannot fit is refused naming its fields, before any of it is allocated
        check_model_memory(self.recipe.model, self.source.in_channels, self.source.num_classes, rt.device)

        def build():
            model = rt.place(self._fresh_model(seed))
            group = distributed.norm_group(self.recipe.model.norm.sync_ranks, world)
            for m in model.modules():
                if isinstance(m, BatchNorm):
                    m.group = group
            distributed.check_same_start(model, world, rt.device)
            return model
        distributed.check_compiled_buckets(self.recipe.distributed.bucket_mb, world, rt.compile)
        wrap = lambda model: distributed.wrap(model, self.recipe.distributed, world, rt.device)
        if not rt.compile:
            model = build()
            self.module = wrap(model)
            return model, self.module
        key = (self.recipe.model.model_dump_json(), self.source.in_channels, self.source.num_classes,
               str(rt.device), rt.precision, rt.cast, rt.channels_last, rt.compile_mode, rt.compile_backend, world.size)
        model, forward, reused = compiled_model(key, build, rt, wrap)
        self.module = getattr(forward, "_orig_mod", forward)
        if reused:                                      # as built from the seed, but in the same tensors
            model.load_state_dict(self._fresh_model(seed).state_dict())
            model.zero_grad(set_to_none=True)
        return model, forward

    def step_image_shapes(self, recipe: Recipe, total: int, spe: int) -> list[tuple[int, int]]:
        """The (height, width) of the training batches at each step (progressive resizing)."""
        full = self.source.image_size
        sizes = []
        for e in range(math.ceil(total / spe)):
            s = epoch_image_side(recipe, e, full[0])
            sizes += [full if s == full[0] else (s, s)] * spe
        return sizes[:total]

    def run_flops(self, steps: int) -> dict:
        """FLOPs of a run of ``steps`` training steps (each at its own size) and the final
        evaluation: :func:`speedrun.engine.flops.run_flops` for this session."""
        src = self.source
        sizes = self.step_image_shapes(self.recipe, steps, self.steps_per_epoch)
        frozen_from = self.step.whiten_steps if self.step.freezable else None
        return flops.run_flops(self.recipe, src.in_channels, src.num_classes, src.image_size, sizes, len(src.test_y),
                               eval_size=src.eval_size, frozen_from=frozen_from)

    def _train_step(self, recipe: Recipe) -> TrainStep:
        total = total_steps(recipe, len(self.source.train_y))
        spe = steps_per_epoch(len(self.source.train_y), recipe.data.batch_size)
        return TrainStep(recipe, self.runtime, self.model, self.module, total, spe,
                         self.step_image_shapes(recipe, total, spe), self.teacher,
                         no_sync=lambda: distributed.no_sync(self.module))

    def _probe(self, recipe: Recipe) -> None:
        """One training step of ``recipe`` on random data (the batch finder's test of fit)."""
        rt, src = self.runtime, self.source
        step = self._train_step(recipe)
        step.idle()
        batch = recipe.data.batch_size
        x = torch.randn(batch, src.in_channels, *src.image_size, device=rt.device, dtype=rt.dtype)
        y = torch.randint(0, src.num_classes, (batch,), device=rt.device)
        saved = _snapshot(self.model)
        try:
            step(x.contiguous(memory_format=rt.memory_format), y)
            rt.synchronize()
        finally:
            self.model.load_state_dict(saved)
            for p in self.model.parameters():
                p.grad = None

    def reset(self, seed: int) -> None:
        """Re-initialise the model from ``seed`` (construction, then a copy onto the device)."""
        self.model.load_state_dict(self._fresh_model(seed).state_dict())
        self.model.zero_grad(set_to_none=True)
        self._reset_for = seed

    def image_sizes(self) -> list[int]:
        full = self.source.image_size[0]
        return sorted({epoch_image_side(self.recipe, e, full) for e in range(self.n_epochs)})

    def _run_state(self, data, seed: int) -> RunState:
        gen = torch.Generator(device=self.runtime.device)
        gen.manual_seed(seed)
        return RunState(gen=gen, augment=BatchAugment(self.recipe.augment, data.n_train, data.image_size, gen,
                                                      self.runtime.device, data.mean, data.std,
                                                      resized_crop=not data.crops_in_workers,
                                                      input_size=getattr(data, "stored_size", None)))

    # ------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------
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
        # the epochs the run trains, a fraction where its last epoch is partial (as the summary says)
        progress.start(self.total_steps, self.total_steps / self.steps_per_epoch, r.data.batch_size)

        source = place_source(self.source, rt)          # (the move to the device: before the clock)
        clock = Clock(rt)
        # --- first touch of the training data: measure, whiten ---------------------------
        data = open_pipeline(source, r, rt, seed, self.shard)
        whiten = getattr(model, "whiten", None)
        if whiten is not None and resume is None:
            whiten.fit(data.whitening_sample(r.model.whiten.samples))
        self.step.reset(seed)                           # (the average starts from the fitted whitening)
        st = self._run_state(data, seed)
        self.step.pruner = self._pruner(data)
        if resume is not None:
            clock = Clock(rt, *ckpt.restore_run(resume, self.recipe, model, self.step, st))
            if self.step.pruner is not None:          # its passes span epochs: the generator as it was
                self.step.pruner.load_state_dict(resume["pruner"])
                st.gen.set_state(resume["pruner"]["generator"])
        base_lr = next(g for g in self.step.opt.param_groups if g["name"] in ("weight", "filters"))["base_lr"]
        with clock.pause("bookkeeping"):
            last_good = LastGood(model, st.step)

        try:
            for epoch in range(st.epoch, self.n_epochs):
                st.epoch = epoch
                first = self._train_epoch(data, st, progress, clock, seed, checkpoint_dir)
                with clock.pause("bookkeeping"):
                    rec, step_losses = self._check_epoch(st, first, last_good, base_lr * self.step.lrs[st.step - 1])
                    last_good.take(model, st.step)
                    if on_steps is not None:
                        on_steps(EpochSteps(epoch + 1, first + 1, step_losses,
                                            [base_lr * m for m in self.step.lrs[first:st.step]],
                                            self.step.moms[first:st.step] if self.step.moms else None))
                if r.eval.every and (epoch + 1) % r.eval.every == 0 and epoch + 1 < self.n_epochs:
                    averager = self.step.averager
                    with clock.pause("monitor"), (averager.applied() if averager else nullcontext()):
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
            if self.step.averager is not None:
                self.step.averager.finalize()
            eval_start = clock.seconds()
            c_tta, c_plain, n_test = self._evaluate(data, r.eval.tta, r.eval.tta_fraction).tolist()
        except DataError as err:
            if st.step == 0:
                raise
            raise DataFailure(err, last_good.state, last_good.step) from None
        acc, acc_plain = c_tta / n_test, c_plain / n_test
        train_seconds = clock.seconds()
        final_eval_seconds = train_seconds - eval_start
        st.history[-1].test_acc, st.history[-1].seconds = acc_plain, train_seconds
        progress.epoch(st.history[-1])
        if on_epoch is not None:
            on_epoch(st.history[-1])
        return RunResult(seed=seed, test_acc=acc, test_acc_no_tta=acc_plain, epochs=st.step / self.steps_per_epoch,
                         steps=st.step, train_seconds=train_seconds, final_eval_seconds=final_eval_seconds,
                         monitor_seconds=clock.paused["monitor"],
                         bookkeeping_seconds=clock.paused["bookkeeping"],
                         recompiles=compiled_graphs() - graphs_before if rt.compile else 0,
                         history=st.history, state_dict=_snapshot(model), skipped_images=data.skipped,
                         skipped_files=dict(data.skipped_files),
                         resumed_from_step=resume["step"] if resume else None,
                         normalisation=(data.mean.tolist(), data.std.tolist()), test_images=int(n_test),
                         pass_images=list(self.step.pruner.kept) if self.step.pruner is not None else [])

    def _pruner(self, data) -> LossPruner | None:
        """The run's loss-based pruning of easy images (``data.prune``), attached to the data."""
        d = self.recipe.data
        if not d.prune:
            return None
        if not hasattr(data, "pruner"):             # (the recipe refuses folders; other pipelines alike)
            raise RecipeError(f"data.prune={d.prune} needs device-resident data (a built-in or .npz data set)")
        full_from = round((1 - d.prune_full) * self.total_steps)
        data.pruner = LossPruner(data.n_train, d.prune, full_from, self.runtime.device)
        return data.pruner

    def _evaluate(self, data, tta: str, fraction: float) -> torch.Tensor:
        """(correct with TTA, correct without, images) over the whole test set: each rank
        evaluates its share with the batch-norm statistics averaged over ranks, and the counts
        are summed."""
        distributed.average_norm_statistics(self.model, self.world)
        c_tta, c_plain, n = evaluate(self.forward, data.test_batches(self.recipe.eval.batch_size), tta, self.runtime,
                                     fraction)
        counts = torch.stack([c_tta, c_plain, torch.tensor(n, device=c_tta.device)]).to(torch.float64)
        return distributed.all_reduce_sum(counts, self.world)

    def _train_epoch(self, data, st: RunState, progress, clock: Clock, seed: int, checkpoint_dir) -> int:
        """One epoch of training steps (their losses and correct counts land in the step's
        metrics table, on the device); returns the step number the epoch started at."""
        r, rt, spe = self.recipe, self.runtime, self.steps_per_epoch
        every = r.checkpoint.every_steps or (round(r.checkpoint.every_epochs * spe) if r.checkpoint.every_epochs else 0)
        skip = st.skip
        if not skip:
            st.epoch_gen_state = st.gen.get_state()
        st.skip = 0
        first = st.step - skip
        size = epoch_image_side(r, st.epoch, data.image_size[0])
        in_step = resized_in_step(r)                  # the step shrinks the full-size batch itself
        batches = data.epoch(st.epoch, r.data.batch_size, st.augment, st.gen, size=None if in_step else size,
                             skip=skip)
        for i, (x, y) in enumerate(batches, start=skip):
            if st.step == self.total_steps:
                break
            rt.mark_step()
            self.step(x, y, size if in_step else None)
            st.step += 1
            progress.step()
            if checkpoint_dir is not None and every and st.step % every == 0 and st.step < self.total_steps:
                with clock.pause("bookkeeping"):
                    ckpt.save_run(checkpoint_dir, self.recipe, seed, self.model, self.step, st, i + 1, clock)
        return first

    def _check_epoch(self, st: RunState, first: int, last_good: LastGood, lr: float) -> tuple[EpochRecord, list[float]]:
        """Read the epoch's metrics back (the record and the per-step losses, averaged over
        ranks); stop on a non-finite loss or a collapsed loss scale (see :func:`first_bad_step`)."""
        w = self.world
        rows = self.step.metrics[first:st.step]                    # loss, correct, overflowed per step
        n = len(rows)
        summed = distributed.all_reduce_sum(rows.clone(), w).tolist()   # ranks' losses, counts, flags; one read
        losses = [row[0] / w.size for row in summed]
        correct = sum(row[1] for row in summed)
        overflowed = [row[2] for row in summed]
        scaling = self.step.scaler is not None
        bad, skipped, st.nonfinite_run = first_bad_step(losses, scaling, st.nonfinite_run, overflowed)
        if bad is not None:
            raise NonFiniteLoss(first + bad + 1, st.epoch + 1, losses[bad], last_good.state, last_good.step)
        finite = [v for v, o in zip(losses, overflowed) if math.isfinite(v) and not o]
        mean_loss = sum(finite) / len(finite) if finite else math.nan
        return EpochRecord(st.epoch + 1, mean_loss, correct / (n * self.recipe.data.batch_size), None, lr, 0.0,
                           skipped), losses
