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
``bench`` alike; the checks of ``train.stop_at_target`` on the validation split held out of
the training images are not paused: they are part of the time to the target.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..data.augment.batch import BatchAugment
from ..data.pipeline.dataset import open_pipeline, place_source
from ..data.pipeline.pruning import LossPruner
from ..data.pipeline.shard import Shard
from ..data.sources.holdout import holdout_images
from ..errors import DataError, RecipeError
from ..recipe import Recipe, init_is_weights, steps_per_epoch, total_steps
from . import checkpoint as ckpt
from . import distributed
from .build import build_for_run, fresh_model, snapshot, teacher_for, train_step_for
from .distributed import World
from .evaluate import TTA_VIEWS, EvaluationStopped, evaluate
from .flops import eval_chunk
from .precision import NonFiniteLoss, first_bad_step
from .records import EpochRecord, EpochSteps, RunResult, TargetStop
from .compiling import cache_counts
from .runtime import Runtime, compiled_graphs
from .sizes import epoch_image_side, resized_in_step, run_image_sides
from .warmup import eval_pad, warm_up as run_warm_up


class DataFailure(RuntimeError):
    """A data error in the middle of a run; carries the last good weights and, where one was
    written, the checkpoint of the last finished step (``checkpoint``, after ``step`` steps)."""

    def __init__(self, error: Exception, last_good: dict, last_good_step: int, checkpoint: Path | None = None,
                 step: int = 0):
        self.error, self.last_good, self.last_good_step = error, last_good, last_good_step
        self.checkpoint, self.step = checkpoint, step
        super().__init__(str(error))


class RunStopped(Exception):
    """A stop signal ended the run at a step boundary, or in an evaluation (``during``: which
    one, as the stop's line names it); rank 0 wrote ``checkpoint`` (None where the run had no
    folder to write it to). ``weights``: after the final evaluation was stopped, the trained
    weights it was evaluating (rank 0), for model.pt."""

    def __init__(self, signum: int, step: int, total_steps: int, checkpoint: Path | None,
                 during: str | None = None, weights: dict | None = None):
        self.signum, self.step, self.total_steps, self.checkpoint = signum, step, total_steps, checkpoint
        self.during, self.weights = during, weights
        super().__init__(f"stopped by signal {signum} after step {step}")


class NullProgress:
    def start(self, total_steps: int, epochs: float, batch_size: int, eval_images: int = 0, done: int = 0) -> None: ...
    def step(self) -> None: ...
    def epoch(self, record: EpochRecord) -> None: ...
    def final_evaluation(self, images: int, tta: str) -> None: ...
    def final_evaluation_done(self, seconds: float) -> None: ...
    def target_reached(self, target: TargetStop) -> None: ...


class LastGood:
    """The weights after the last epoch whose losses were all finite, in buffers allocated
    once and refreshed with one foreach copy (the clock is paused around it)."""

    def __init__(self, model: torch.nn.Module, step: int):
        self.state = snapshot(model)
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

    def state(self) -> tuple[float, dict]:
        """(elapsed, paused) as a checkpoint keeps them (read without a synchronisation)."""
        return self.elapsed(), dict(self.paused)


FINAL = "the final evaluation"


@dataclass(frozen=True)
class EpochEnd:
    """The run as it stood after an epoch's last step, before the epoch's end (its losses read
    back, the target check, the monitoring or the final evaluation): what a stop signal during
    one of those evaluations checkpoints, so that ``--resume`` does the epoch's end again from
    its start, as an uninterrupted run did it. The interrupted evaluation's seconds count
    nowhere (the clock is put back to this point)."""
    batches: int                          # of the epoch, trained
    history: int                          # epoch records before this epoch's
    nonfinite_run: int
    target_checks: tuple[int, float] | None
    clock: tuple[float, dict]

    @classmethod
    def of(cls, st: "RunState", step_count: int, first: int, clock: Clock) -> "EpochEnd":
        t = st.target
        return cls(step_count - first, len(st.history), st.nonfinite_run,
                   (t.checks, t.seconds) if t is not None else None, clock.state())

    def run_state(self, st: "RunState") -> "RunState":
        """``st`` as it was at this point."""
        target = st.target if self.target_checks is None else replace(
            st.target, checks=self.target_checks[0], seconds=self.target_checks[1], reached=None)
        return replace(st, history=st.history[:self.history], nonfinite_run=self.nonfinite_run, target=target)


@dataclass
class RunState:
    """What a run changes as it trains besides the model and the training step's own state
    (the step counts the steps: :attr:`~speedrun.engine.step.TrainStep.steps_done`); with
    that, what a checkpoint saves."""
    gen: torch.Generator
    augment: BatchAugment
    epoch: int = 0
    skip: int = 0                         # batches of ``epoch`` already trained (resume)
    epoch_gen_state: torch.Tensor | None = None
    history: list[EpochRecord] = field(default_factory=list)
    nonfinite_run: int = 0
    target: TargetStop | None = None      # train.stop_at_target: its checks so far


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


class Session:
    """One recipe on one device, in one process of ``world`` (default: the only one). Its
    three jobs: build the model and its training step for the runtime (once per process,
    compiled and warmed up where the runtime compiles; see :mod:`speedrun.engine.build`);
    train from a seed (:meth:`run`); continue a run from a checkpoint (:meth:`run` with
    ``resume``). ``source`` is the opened data; a benchmark may put a freshly opened one in
    its place between runs.

    ``warm_up``: run the warm-up even without compilation (benchmarks do, so that one-time
    costs such as kernel selection stay out of the first timed run)."""

    def __init__(self, recipe: Recipe, source, runtime: Runtime, warm_up: bool = False, world: World = World()):
        runtime = runtime.activate()
        self.recipe, self.source, self.runtime, self.world = recipe, source, runtime, world
        built = build_for_run(recipe, source, runtime, world, recipe.train.seed)
        self.model, self.forward = built.model, built.forward
        teacher = teacher_for(recipe, source, runtime)
        self.local_batch = local_batch(recipe, world)
        if recipe.data.prune and world.size > 1:
            raise RecipeError(f"data.prune={recipe.data.prune} keeps each image's loss in one process; it does not "
                              f"run data-parallel ({world.size} processes): set data.prune=0")
        self.shard = Shard(world.rank, world.size, recipe.train.accumulate)
        self.holdout_images = holdout_images(source)
        # compiled: evaluation batches padded to one size, so the evaluation is one compiled shape
        self.eval_pad = eval_pad([len(source.test_y), self.holdout_images], recipe.eval.batch_size,
                                 self.shard) if runtime.compile else None
        self.eval_chunk = eval_chunk(recipe, source.in_channels, source.num_classes, source.eval_size,
                                     runtime.device.type)
        if recipe.train.stop_at_target and not self.holdout_images:
            raise RecipeError("train.stop_at_target checks the target on a validation split held out of the "
                              "training images, and the data given to this run holds none out: open the data with "
                              "train.stop_at_target on in its recipe, which holds out data.holdout of each class")
        self.steps_per_epoch = steps_per_epoch(len(source.train_y), recipe.data.batch_size)
        self.total_steps = total_steps(recipe, len(source.train_y))
        self.n_epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.image_sides = run_image_sides(recipe, source.image_size[0], self.n_epochs)
        self.step = train_step_for(recipe, source, runtime, built, teacher,
                                   no_sync=lambda: distributed.no_sync(built.module))
        self.compile_seconds = 0.0
        before = cache_counts()
        if runtime.compile or warm_up:
            self.compile_seconds = run_warm_up(self)
        # inductor's persistent cache: graphs this warm-up found compiled by an earlier process
        self.compile_cache = {k: v - before[k] for k, v in cache_counts().items()}
        self._reset_for: int | None = None
        self._stop = None                             # (StopSignals, StopAgreement) while a run listens
        self._in_epoch: int | None = None             # batches of the running epoch behind the steps done

    def reset(self, seed: int) -> None:
        """Re-initialise the model from ``seed`` (construction, then a copy onto the device)."""
        self.model.load_state_dict(fresh_model(self.recipe, self.source, seed).state_dict())
        self.model.zero_grad(set_to_none=True)
        self._reset_for = seed

    def _run_state(self, data, seed: int) -> RunState:
        gen = torch.Generator(device=self.runtime.device)
        gen.manual_seed(seed)
        t = self.recipe.train
        target = TargetStop(self.recipe.target, self.holdout_images, t.stop_check_every) if t.stop_at_target else None
        return RunState(gen=gen, augment=BatchAugment(self.recipe.augment, data.n_train, data.image_size, gen,
                                                      self.runtime.device, data.mean, data.std,
                                                      resized_crop=not data.crops_in_workers,
                                                      input_size=getattr(data, "stored_size", None)),
                        target=target)

    # ------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------
    def run(self, seed: int | None = None, progress=None, on_epoch=None, checkpoint_dir: Path | None = None,
            resume: dict | None = None, on_steps=None, stop=None) -> RunResult:
        """Train from a fresh initialisation (or from the checkpoint ``resume``);
        ``on_epoch(record)`` is called after each epoch, ``on_steps(EpochSteps)`` after each
        epoch's losses are read back (with the clock paused). ``stop``: the process's
        :class:`~speedrun.stop_signals.StopSignals`; a signal it records ends the run at the
        next step boundary, or between two batches of an evaluation, with a checkpoint in
        ``checkpoint_dir`` (:class:`RunStopped`)."""
        r, rt, model, step = self.recipe, self.runtime, self.model, self.step
        seed = (resume["seed"] if resume else r.train.seed) if seed is None else seed
        progress = progress or NullProgress()
        if self._reset_for != seed:
            self.reset(seed)
        self._reset_for = None
        graphs_before = compiled_graphs() if rt.compile else 0
        # the epochs the run trains, a fraction where its last epoch is partial (as the summary says)
        views = len(TTA_VIEWS[r.eval.tta]) * r.eval.tta_fraction + (1 - r.eval.tta_fraction)
        progress.start(self.total_steps, self.total_steps / self.steps_per_epoch, r.data.batch_size,
                       round(len(self.source.test_y) * views), done=resume["step"] if resume else 0)

        source = place_source(self.source, rt)          # (the move to the device: before the clock)
        clock = Clock(rt)
        clock_started = clock.t0                        # (a resumed run's clock below starts earlier)
        # --- first touch of the training data: measure, whiten ---------------------------
        data = open_pipeline(source, r, rt, seed, self.shard)
        whiten = getattr(model, "whiten", None)
        if whiten is not None and resume is None and not init_is_weights(r.model.init):    # (loaded with the weights)
            whiten.fit(data.whitening_sample(r.model.whiten.samples))
        step.reset(seed)                                # (the average starts from the fitted whitening)
        st = self._run_state(data, seed)
        pruner = step.loss.pruner = self._pruner(data)
        if resume is not None:
            clock = Clock(rt, *ckpt.restore_run(resume, self.recipe, model, step, st))
            ckpt.restore_rank_state(resume, self.world.rank, model, step)
            if pruner is not None:                      # its passes span epochs: the generator as it was
                pruner.load_state_dict(resume["pruner"])
                st.gen.set_state(resume["pruner"]["generator"])
        base_lr, lrs, moms = step.base_lr(), step.schedule.lrs, step.schedule.moms
        with clock.pause("bookkeeping"):
            last_good = LastGood(model, step.steps_done)
        self._stop = None
        if stop is not None:
            self._stop = (stop, distributed.StopAgreement(self.world))
            stop.listening = True

        end = None                                      # the last epoch's end (a stop in its evaluations)
        try:
            for epoch in range(st.epoch, self.n_epochs):
                st.epoch = epoch
                first = self._train_epoch(data, st, progress, clock, seed, checkpoint_dir)
                with clock.pause("bookkeeping"):
                    end = EpochEnd.of(st, step.steps_done, first, clock)
                    done = step.steps_done
                    rec, step_losses = self._check_epoch(st, first, last_good, base_lr * lrs[done - 1])
                    last_good.take(model, done)
                    if on_steps is not None:
                        on_steps(EpochSteps(epoch + 1, first + 1, step_losses, [base_lr * m for m in lrs[first:done]],
                                            moms[first:done] if moms else None))
                last = epoch + 1 == self.n_epochs or self._target_reached(data, st, rec, clock)
                if r.eval.every and (epoch + 1) % r.eval.every == 0 and not last:
                    averager = step.averager
                    with clock.pause("monitor"), (averager.applied() if averager else nullcontext()):
                        _, plain, n_test = self._evaluate(data.test_batches(r.eval.batch_size), "none", 1.0,
                                                          f"the monitoring evaluation after epoch {epoch + 1}"
                                                          ).tolist()
                        rec.test_acc = plain / n_test
                rec.seconds_total = clock.seconds()
                rec.seconds = rec.seconds_total - (st.history[-1].seconds_total if st.history else 0.0)
                st.history.append(rec)
                if last:                                # (its record is told with the final accuracy)
                    if st.target is not None and st.target.reached is not None:
                        with clock.pause("bookkeeping"):
                            progress.target_reached(st.target)
                    break
                with clock.pause("bookkeeping"):
                    progress.epoch(rec)
                    if on_epoch is not None:
                        on_epoch(rec)

            # --- final evaluation, with the recipe's TTA --------------------------------------
            if step.averager is not None:
                step.averager.finalize()
            eval_start = clock.seconds()
            with clock.pause("bookkeeping"):
                progress.final_evaluation(len(self.source.test_y), r.eval.tta)
            c_tta, c_plain, n_test = self._evaluate(data.test_batches(r.eval.batch_size), r.eval.tta,
                                                    r.eval.tta_fraction, FINAL).tolist()
        except EvaluationStopped as stopped:
            raise self._stopped_in_evaluation(stopped, end, checkpoint_dir, seed, st) from None
        except DataError as err:
            if step.steps_done == 0:
                raise
            path = self._checkpoint_after_failure(checkpoint_dir, seed, st, clock)
            raise DataFailure(err, last_good.state, last_good.step, path, step.steps_done) from None
        acc, acc_plain = c_tta / n_test, c_plain / n_test
        train_seconds = clock.seconds()
        final_eval_seconds = train_seconds - eval_start
        progress.final_evaluation_done(final_eval_seconds)
        last = st.history[-1]
        last.test_acc, last.seconds_total = acc_plain, train_seconds
        last.seconds = eval_start - (st.history[-2].seconds_total if len(st.history) > 1 else 0.0)
        progress.epoch(st.history[-1])
        if on_epoch is not None:
            on_epoch(st.history[-1])
        done = step.steps_done
        return RunResult(seed=seed, test_acc=acc, test_acc_no_tta=acc_plain, epochs=done / self.steps_per_epoch,
                         steps=done, train_seconds=train_seconds, final_eval_seconds=final_eval_seconds,
                         monitor_seconds=clock.paused["monitor"],
                         bookkeeping_seconds=clock.paused["bookkeeping"],
                         recompiles=compiled_graphs() - graphs_before if rt.compile else 0,
                         history=st.history, state_dict=snapshot(model), skipped_images=data.skipped,
                         skipped_files=dict(data.skipped_files),
                         resumed_from_step=resume["step"] if resume else None,
                         normalisation=(data.mean.tolist(), data.std.tolist()), test_images=int(n_test),
                         pass_images=list(pruner.kept) if pruner is not None else [], target_stop=st.target,
                         clock_started=clock_started)

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

    def _target_reached(self, data, st: RunState, rec: EpochRecord, clock: Clock) -> bool:
        """train.stop_at_target, after an epoch that is not the run's last (where it would stop
        anyway) and is due a check: the accuracy on the validation split held out of the
        training images (never the test set), with the averaged weights and the plain view,
        counted over every rank so that every rank decides alike; whether it reached the
        target. The check is timed as part of the run (its seconds are also kept apart)."""
        target = st.target
        if target is None or (st.epoch + 1) % target.every:
            return False
        averager = self.step.averager
        self.runtime.synchronize()
        t0 = time.perf_counter()
        with averager.applied() if averager else nullcontext():
            _, plain, n = self._evaluate(data.holdout_batches(self.recipe.eval.batch_size), "none", 1.0,
                                         f"the target check after epoch {st.epoch + 1}").tolist()
        target.checks += 1
        target.seconds += time.perf_counter() - t0
        rec.holdout_acc = plain / n
        if rec.holdout_acc < target.target:
            return False
        target.reached = {"epoch": st.epoch + 1, "step": self.step.steps_done, "seconds": clock.seconds(),
                          "holdout_acc": rec.holdout_acc}
        return True

    def _evaluate(self, batches, tta: str, fraction: float, what: str) -> torch.Tensor:
        """(correct with TTA, correct without, images) over the whole of an evaluation set
        (``batches``: the test set, or the validation split held out for train.stop_at_target):
        each rank evaluates its share with the batch-norm statistics averaged over ranks, and the
        counts are summed. While the run listens for stop signals, they are checked between
        batches (agreed by every rank): a stop raises :class:`EvaluationStopped` naming ``what``,
        with each rank's own statistics put back (and, in the final evaluation, the weights it
        evaluated kept for model.pt)."""
        own = distributed.average_norm_statistics(self.model, self.world)
        check = None
        if self._stop is not None:
            stop, agreement = self._stop
            check = lambda running: agreement.in_evaluation(lambda: stop.received, running)  # noqa: E731
        try:
            c_tta, c_plain, n = evaluate(self.forward, batches, tta, self.runtime, fraction, pad_to=self.eval_pad,
                                         stop=check, chunk=self.eval_chunk)
        except EvaluationStopped as stopped:
            stopped.what = what
            if what == FINAL and self.world.is_main:
                stopped.weights = snapshot(self.model)
            distributed.restore_norm_statistics(self.model, own)
            raise
        counts = torch.stack([c_tta, c_plain, torch.tensor(n, device=c_tta.device)]).to(torch.float64)
        return distributed.all_reduce_sum(counts, self.world)

    def _train_epoch(self, data, st: RunState, progress, clock: Clock, seed: int, checkpoint_dir) -> int:
        """One epoch of training steps (their losses and correct counts land in the step's
        metrics table, on the device); returns the step number the epoch started at."""
        r, rt, spe, step = self.recipe, self.runtime, self.steps_per_epoch, self.step
        every = r.checkpoint.every_steps or (round(r.checkpoint.every_epochs * spe) if r.checkpoint.every_epochs else 0)
        skip = st.skip
        if not skip:
            st.epoch_gen_state = st.gen.get_state()
        st.skip = 0
        first = step.steps_done - skip
        size = epoch_image_side(r, st.epoch, data.image_size[0])
        in_step = resized_in_step(r)                  # the step shrinks the full-size batch itself
        self._in_epoch = skip
        batches = data.epoch(st.epoch, r.data.batch_size, st.augment, st.gen, size=None if in_step else size,
                             skip=skip)
        for i, (x, y) in enumerate(batches, start=skip):
            if step.steps_done == self.total_steps:
                break
            rt.mark_step()
            step(x, y, size if in_step else None)         # (counts the step: step.steps_done)
            progress.step()
            done, self._in_epoch = step.steps_done, i + 1
            if every and done % every == 0 and done < self.total_steps and (checkpoint_dir or self.world.distributed):
                with clock.pause("bookkeeping"):
                    ranks = self._rank_states()                 # (every rank takes part)
                    if checkpoint_dir is not None:
                        ckpt.save_run(checkpoint_dir, self.recipe, seed, self.model, step, st, i + 1, clock.state(),
                                      ranks)
            if self._stop is not None and done < self.total_steps:
                self._stop_if_signalled(checkpoint_dir, seed, st, i + 1, clock)
        self._in_epoch = None                         # (the epoch is over: no mid-epoch position)
        return first

    def _checkpoint_after_failure(self, checkpoint_dir, seed: int, st: RunState, clock: Clock) -> Path | None:
        """After the data failed in the middle of an epoch (a worker killed by the system, an
        unreadable file), a checkpoint of the last finished step, which ``--resume`` continues
        bit for bit once the cause is fixed; None where there is none to write (the failure came
        between epochs or in the evaluation, or in a run of several processes, whose other ranks
        cannot be asked for their part any more)."""
        if checkpoint_dir is None or self.world.distributed or self._in_epoch is None:
            return None
        return ckpt.save_run(checkpoint_dir, self.recipe, seed, self.model, self.step, st, self._in_epoch,
                             clock.state())

    def _rank_states(self) -> list[dict] | None:
        """Each process's own part of a checkpoint (:func:`~speedrun.engine.checkpoint.rank_state`),
        gathered on rank 0 from every rank, which must all call this at the same step; None in
        one process, whose checkpoint holds it already."""
        if not self.world.distributed:
            return None
        group = self._stop[1].group if self._stop is not None else None
        return distributed.gather_objects(ckpt.rank_state(self.model, self.step), self.world, group)

    def _stop_if_signalled(self, checkpoint_dir, seed: int, st: RunState, batch_in_epoch: int, clock: Clock) -> None:
        """At a step boundary: when a rank received a stop signal (agreed by all ranks, on the
        host), checkpoint this step (rank 0, which holds ``checkpoint_dir``) and raise RunStopped
        on every rank once it is written."""
        stop, agreement = self._stop
        signum = agreement.signal(stop.received)
        if signum is None:
            return
        stop.saving = True                   # further signals can no longer interrupt the write
        path = None
        ranks = self._rank_states()
        if checkpoint_dir is not None:
            path = ckpt.save_run(checkpoint_dir, self.recipe, seed, self.model, self.step, st, batch_in_epoch,
                                 clock.state(), ranks)
        agreement.wait_for_all()
        raise RunStopped(signum, self.step.steps_done, self.total_steps, path)

    def _stopped_in_evaluation(self, stopped: EvaluationStopped, end: EpochEnd, checkpoint_dir, seed: int,
                               st: RunState) -> RunStopped:
        """A stop signal in an evaluation after an epoch (agreed by every rank, which all come
        here): the checkpoint a stop after the epoch's last step would have written (``end``),
        which ``--resume`` continues by doing the epoch's end again, the interrupted evaluation
        included; it also says whether the training was complete (a stop in the final
        evaluation). Returns the RunStopped every rank raises once rank 0 has written it."""
        stop, agreement = self._stop
        stop.saving = True                   # further signals can no longer interrupt the write
        ranks = self._rank_states()
        path = None
        if checkpoint_dir is not None:
            path = ckpt.save_run(checkpoint_dir, self.recipe, seed, self.model, self.step, end.run_state(st),
                                 end.batches, end.clock, ranks,
                                 interrupted={"evaluation": stopped.what, "training_complete": stopped.what == FINAL})
        agreement.wait_for_all()
        return RunStopped(stopped.signum, self.step.steps_done, self.total_steps, path, during=stopped.what,
                          weights=stopped.weights)

    def _check_epoch(self, st: RunState, first: int, last_good: LastGood, lr: float) -> tuple[EpochRecord, list[float]]:
        """Read the epoch's metrics back (the record and the per-step losses, averaged over
        ranks); stop on a non-finite loss or a collapsed loss scale (see :func:`first_bad_step`)."""
        w = self.world
        rows = self.step.metrics[first:self.step.steps_done]                    # loss, correct, overflowed per step
        n = len(rows)
        summed = distributed.all_reduce_sum(rows.clone(), w).tolist()   # ranks' losses, counts, flags; one read
        losses = [row[0] / w.size for row in summed]
        correct = sum(row[1] for row in summed)
        overflowed = [row[2] for row in summed]
        scaling = self.step.precision.loss_scaling
        bad, skipped, st.nonfinite_run = first_bad_step(losses, scaling, st.nonfinite_run, overflowed)
        if bad is not None:
            raise NonFiniteLoss(first + bad + 1, st.epoch + 1, losses[bad], last_good.state, last_good.step)
        finite = [v for v, o in zip(losses, overflowed) if math.isfinite(v) and not o]
        mean_loss = sum(finite) / len(finite) if finite else math.nan
        return EpochRecord(st.epoch + 1, mean_loss, correct / (n * self.recipe.data.batch_size), None, lr, 0.0,
                           skipped), losses
