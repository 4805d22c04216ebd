"""``speedrun train``: one run of a recipe, from files on disk to a run record."""
from __future__ import annotations

import signal
from contextlib import nullcontext
from pathlib import Path

import torch

from .data.sources.skipped import skipped_line
from .engine import checkpoint as ckpt
from .engine import distributed
from .engine.batch_finder import halve_batch, is_out_of_memory
from .engine.distributed import World
from .engine.loop import DataFailure, RunStopped, Session
from .engine.plan import fit_batch_to_device, plan_run
from .engine.precision import NonFiniteLoss
from .engine.runtime import pick_device, resolve_runtime
from .errors import DistributedError, RecipeError, RunFolderError, TrainingStopped
from .files import check_output_folder
from .recipe import Recipe, load_recipe
from .run_lock import RunFolderLock
from .stop_signals import RESUMABLE_EXIT, StopSignals, requeue_slurm_job
from .report import loggers
from .report.console import TrainingProgress, print_table
from .report.environment import environment
from .report.record import NullRecord, RunRecord, new_run_dir, run_folder_bytes
from .report.summary import preprocessing_of, stop_at_target_line, summary_of, target_line


def out_of_memory_message(recipe: Recipe, device) -> str:
    return (f"out of memory on {device} with data.batch_size={recipe.data.batch_size}; "
            "lower it with --set data.batch_size=N (optim.lr and optim.weight_decay are stated "
            "per optim.ref_batch examples, so the recipe's meaning is kept)")


def _recipe_for(args) -> tuple[Recipe, dict | None, Path | None]:
    """The recipe to train, the checkpoint when resuming (whose run's config.toml is the
    recipe) and the resumed run's folder. Everything is checked before anything is written."""
    overrides = list(args.overrides) + ([f"train.seed={args.seed}"] if args.seed is not None else [])
    if not args.resume:
        if not args.recipe:
            raise RecipeError("speedrun train needs a RECIPE (or --resume RUN_DIR)")
        return load_recipe(args.recipe, overrides), None, None
    path = Path(args.resume)
    folder = path if path.is_dir() else path.parent
    state = ckpt.load(path)
    config = folder / "config.toml"
    if not config.is_file():
        raise RunFolderError(f"--resume {folder}: {config} is missing (the run's resolved recipe, written beside "
                             "checkpoint.pt when the run started), so the run cannot be resumed; put the run's "
                             "config.toml back there, or start a new run with `speedrun train RECIPE --out DIR`")
    recipe = load_recipe(str(config), overrides)
    if args.recipe and load_recipe(args.recipe, overrides).name != recipe.name:
        raise RecipeError(f"--resume {folder} is a run of {recipe.name!r}, not {args.recipe!r}")
    if recipe.digest() != state["recipe_hash"]:
        what = f" with {' '.join('--set ' + o for o in overrides)}" if overrides else ""
        raise RecipeError(f"--resume {folder}{what}: the recipe differs from the one the checkpoint was written "
                          f"by, so the run cannot continue; resume without --set/--seed (nothing was changed "
                          f"in {folder})")
    return recipe, state, folder


def _train(recipe: Recipe, source, runtime, record, resume, say, args, world: World, stop: StopSignals):
    """Build the session and train; with runtime.find_batch, an out-of-memory error during
    training (the probe before it cannot see everything the run allocates) halves the batch
    and starts the run again. Only rank 0 shows progress and writes (the record and the
    ``--log`` metric logs)."""
    while True:
        session = Session(recipe, source, runtime, world=world)
        if world.is_main:
            check_output_folder(record.folder, "--out", need_bytes=run_folder_bytes(session.model, session.recipe))
            if resume is None:
                record.write_config(recipe.to_toml())
        logs = loggers.MetricLogs(record, args.log, session.n_epochs, resume) if world.is_main and args.log else None

        def epoch_done(rec):
            record.append_metrics(vars(rec))
            if logs is not None:
                logs.epoch(rec)
        try:
            with (TrainingProgress(recipe.name, args.log_every) if world.is_main else nullcontext(None)) as progress:
                result = session.run(progress=progress, checkpoint_dir=record.folder if world.is_main else None,
                                     resume=resume, on_epoch=epoch_done if world.is_main else None,
                                     on_steps=logs.steps if logs is not None else None, stop=stop)
            if logs is not None:
                logs.finish(result.test_acc, result.test_acc_no_tta)
            return session, result
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not (recipe.runtime.find_batch and is_out_of_memory(err) and resume is None):
                raise
            del session, err
            recipe = fit_batch_to_device(halve_batch(recipe, runtime, say), source, runtime, say)
            record.reset_metrics()
            if logs is not None:
                logs.remove()
        finally:
            if logs is not None:
                logs.close()


def _run_folder(args, recipe: Recipe, world: World) -> Path:
    """--out, or a new folder under runs/: for a job of several processes, or a SLURM job, one
    name for all of them (the job's id where the launcher gives one, so a restarted or
    requeued job finds its folder)."""
    if args.out:
        return Path(args.out)
    if world.job_id:
        return Path("runs") / f"{recipe.name}-{world.job_id}"
    return Path(distributed.broadcast_object(str(new_run_dir(recipe.name)) if world.is_main else None, world))


def _restarted_run(args, world: World) -> str | None:
    """The folder to continue when the launcher started this job again (torchrun's restarts,
    a requeued SLURM job) and the run it had begun left a checkpoint there."""
    if args.resume is not None or not world.restart or not (args.out or (args.recipe and world.job_id)):
        return None
    folder = Path(args.out) if args.out else _run_folder(args, load_recipe(args.recipe, list(args.overrides)), world)
    return str(folder) if (folder / ckpt.NAME).is_file() and not (folder / "summary.json").exists() else None


def train_command(args) -> int:
    world = distributed.detect()
    chosen = loggers.parse(args.log)
    args.resume = args.resume or _restarted_run(args, world)      # continue from the run's last checkpoint
    recipe, resume, folder = _recipe_for(args)
    args.log = chosen if chosen is not None else loggers.found_in(folder) if folder else ()
    loggers.require(args.log)
    if world.distributed and recipe.runtime.find_batch:
        raise RecipeError("runtime.find_batch (--find-batch) probes one process's memory; with several processes "
                          "set data.batch_size (or data.per_device_batch) yourself")
    device = distributed.bind_device(world, pick_device(args.device))
    resolve_runtime(recipe.runtime, device)     # a runtime this device refuses stops here, before the job starts
    distributed.start(world, device, distributed.backend_for(recipe.distributed.backend, device),
                      recipe.distributed.timeout_s)
    stop = StopSignals()
    lock = None
    with stop.installed():                     # until the process group is gone: a stopped rank exits whole
        try:
            folder = folder or _run_folder(args, recipe, world)
            lock = RunFolderLock(folder, "--out" if args.resume is None else "--resume") if world.is_main else None
            if lock is not None and lock.taken_over:
                print(f"speedrun: {folder} was left locked by process {lock.taken_over}, which is no longer running; "
                      "this run takes it over")
            history = resume["history"] if resume is not None else None
            record = RunRecord(folder, resume_history=history, restarted=world.restart > 0) if world.is_main \
                else NullRecord(folder)
            try:
                code = _train_into(record, recipe, resume, device, args, world, stop)
            except RunStopped as stopped:
                return _stopped(stopped, world, record)
            except BaseException:
                record.discard()               # a failed run leaves no empty folder behind
                raise
            distributed.finish(world, recipe.distributed.timeout_s)
            return code
        finally:
            if lock is not None:
                lock.release()
            distributed.stop()


def _stopped(stopped: RunStopped, world: World, record) -> int:
    """Rank 0 says where the run stopped and how to continue it (after a stop in the final
    evaluation, with the trained weights written to model.pt), and requeues a SLURM job that
    asked for it (SIGUSR1); every rank exits with RESUMABLE_EXIT."""
    if world.is_main:
        name, where = signal.Signals(stopped.signum).name, stopped.checkpoint.parent
        during, after = "", ""
        if stopped.during is not None:
            during = f" in {stopped.during},"
        if stopped.weights is not None:
            after = (f" (the training is complete; its weights: "
                     f"{record.save_weights(stopped.weights)})")
        again = " (it runs the final evaluation)" if stopped.weights is not None else ""
        line = (f"speedrun: stopped by {name}{during} after step {stopped.step} of {stopped.total_steps}{after}; "
                f"checkpoint: {stopped.checkpoint}; continue with `speedrun train --resume {where}`{again}"
                + (" (under torchrun or srun, the same launch with --resume)" if world.distributed else ""))
        try:
            job = requeue_slurm_job(stopped.signum)
        except RuntimeError as err:
            line += f"; the SLURM job could not be requeued: {err}"
        else:
            if job is not None:
                line += f"; SLURM job {job} requeued: it continues from this checkpoint when it starts again"
        print(line, flush=True)
    return RESUMABLE_EXIT


def _train_into(record, recipe: Recipe, resume, device: torch.device, args, world: World, stop: StopSignals) -> int:
    env = environment()
    say = (lambda msg: print(f"speedrun: {msg}")) if world.is_main else (lambda msg: None)
    plan = plan_run(recipe, args.data_dir, device, say, announce=True)
    recipe, source, runtime = plan.recipe, plan.source, plan.runtime
    try:
        session, result = _train(recipe, source, runtime, record, resume, say, args, world, stop)
        recipe = session.recipe
    except NonFiniteLoss as err:
        path = record.save_weights(err.last_good, "last_good.pt")
        raise TrainingStopped(
            f"{err}. The last good weights (after step {err.last_good_step}) are in {path}. "
            "Lower optim.lr, or check the data, then run again.") from None
    except DataFailure as err:
        path = record.save_weights(err.last_good, "last_good.pt")
        if err.checkpoint is not None:
            raise TrainingStopped(f"{err.error} A checkpoint after step {err.step} is in {err.checkpoint}: once the "
                                  f"cause is fixed, continue with `speedrun train --resume {err.checkpoint.parent}` "
                                  f"(the weights after step {err.last_good_step}, the last checked, are in {path})"
                                  ) from None
        raise TrainingStopped(f"{err.error} The weights after step {err.last_good_step} are kept in {path}.") from None
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if is_out_of_memory(err):
            raise TrainingStopped(out_of_memory_message(recipe, runtime.device)) from None
        if world.distributed and distributed.lost_peer(err):
            raise DistributedError(f"rank {world.rank} of {world.size} lost contact with the other processes "
                                   f"({str(err).splitlines()[0][:300]}): another rank failed or hung (its own "
                                   "message, or the launcher's, names it)") from None
        raise
    if not world.is_main:
        return 0
    record.save_weights(result.state_dict)
    record.write_preprocessing(preprocessing_of(recipe, session, result))
    summary = summary_of(recipe, result, session, env, args.started, args.before_main)
    record.write_summary(summary)
    rows = [
        ("test accuracy" + (f" ({recipe.eval.tta} TTA)" if recipe.eval.tta != "none" else ""),
         f"{result.test_acc:.2%}"),
        ("without TTA", f"{result.test_acc_no_tta:.2%}"),
        ("target", target_line(summary, result.test_acc)),
        ("epochs", f"{result.epochs:g}"),
        ("train seconds", f"{result.train_seconds:.2f}"),
        ("compile seconds", f"{session.compile_seconds:.2f}"),
        ("start-up seconds", f"{summary['start_up_seconds']:.2f} (process start to the training clock)"),
        ("wall seconds", f"{summary['wall_seconds']:.2f}"),
        ("record", str(record.folder)),
    ]
    if world.distributed:
        rows.insert(4, ("processes", f"{world.size} ({session.local_batch} images each per step, {world.nodes} "
                                     f"node{'s' if world.nodes > 1 else ''})"))
    if result.recompiles:
        rows.insert(6, ("recompiles during the run", str(result.recompiles)))
    if result.target_stop is not None:
        rows.insert(4, ("stop at target", stop_at_target_line(result.target_stop)))
    if summary["skipped_images"]:
        rows.insert(4, ("unreadable images skipped", str(summary["skipped_images"])))
    if result.resumed_from_step is not None:
        rows.insert(4, ("resumed from step", str(result.resumed_from_step)))
    print_table(f"{recipe.name} on {summary['device_name']}", rows)
    if summary["skipped_images"]:
        files = {e["path"]: e["reason"] for e in summary["skipped_files"]}
        say(skipped_line(files, summary["skipped_images"], record.folder / "summary.json"))
    if stop.name is not None:
        say(f"{stop.name} arrived as the final evaluation ended: the run finished and its record in "
            f"{record.folder} is complete (nothing to resume)")
    return 0


def recipes_command(args) -> int:
    from rich.table import Table

    from .recipe import shipped_recipes
    from .report.console import make_console
    table = Table("recipe", "dataset", "target", "epochs", "description")
    for name in sorted(shipped_recipes()):
        r = load_recipe(name)
        table.add_row(name, r.data.dataset, f"{r.target:.1%}", f"{r.train.epochs:g}", r.description)
    make_console().print(table)
    return 0
