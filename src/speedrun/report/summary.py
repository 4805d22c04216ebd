"""A run's summary.json and preprocessing.json: what the run was, what it reached, how long
each part took, on what, and how its evaluation turned an image into the model's input. The
record writer (:mod:`speedrun.report.record`) writes them; ``speedrun train`` gathers them
from the finished run."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..data.sources.skipped import listed
from ..engine import flops
from ..engine.plan import newton_schulz_dtype
from ..engine.records import RunResult
from ..engine.runtime import device_name
from ..models import weight_grad
from ..recipe import Recipe

TRAIN_SECONDS_REGION = ("first touch of the training data on the device (channel statistics, whitening) to the "
                        "final TTA accuracy, the device synchronised at both ends (with train.stop_at_target, "
                        "its checks on the validation split included); excludes the move of an "
                        "in-memory data set to the device (made just before, as a loader that holds it there "
                        "would), the warm-up (compile_seconds), monitoring evaluations (monitor_seconds) and "
                        "bookkeeping: snapshots, checkpoints, metrics files, progress (bookkeeping_seconds)")


START_UP_REGION = ("the process's start (before_main_seconds: the interpreter and speedrun's entry point; 0 where "
                   "the operating system does not say when the process started) to the start of the training "
                   "clock: imports, the recipe, opening the data, building the network and loading its weights, "
                   "the warm-up (compile_seconds) and the move of an in-memory data set to the device")


def start_up_figures(result: RunResult, started: float, before_main: float | None) -> dict:
    """How long the process took to start training: ``started`` is time.perf_counter() at
    speedrun's entry point, ``before_main`` the process's age then (:func:`speedrun.world.process_age`)."""
    return {"start_up_seconds": result.clock_started - started + (before_main or 0.0),
            "before_main_seconds": before_main, "start_up_region": START_UP_REGION}


def flop_figures(result: RunResult, session) -> dict:
    """The run's FLOPs (training steps at their sizes, the final evaluation) and how close to
    the device's peak they ran. ``session``: the run's :class:`~speedrun.engine.loop.Session`."""
    rt = session.runtime
    total = flops.flops_of_run(session.recipe, session.source, result.steps, session.step.frozen_from)
    eff = flops.efficiency(total["total_flops"], result.train_seconds, rt.device.type,
                           device_name(rt.device), rt.precision)
    return {**total, **eff}


def summary_of(recipe: Recipe, result: RunResult, session, env: dict, started: float,
               before_main: float | None) -> dict:
    """summary.json of a finished run: ``env`` is the environment (device, versions, commit);
    ``started`` is time.perf_counter() at speedrun's entry point (the wall time counts from it) and
    ``before_main`` the process's age then, None where it has no process of its own."""
    wall = time.perf_counter() - started
    world, d = session.world, recipe.distributed
    parallel = {**world.describe(), "per_rank_batch": session.local_batch}
    if world.distributed:
        parallel.update(backend=torch.distributed.get_backend(), bucket_mb=d.bucket_mb, compression=d.compression,
                        norm_sync_ranks=recipe.model.norm.sync_ranks)
    return {
        "recipe": recipe.name,
        "recipe_hash": recipe.digest(),
        "dataset": recipe.data.dataset,
        "data_path": data_path(recipe, session.source),
        **target_of(recipe),
        "target_reached": None if target_of(recipe)["target"] is None else result.test_acc >= recipe.target,
        "test_acc": result.test_acc,
        "test_acc_no_tta": result.test_acc_no_tta,
        "test_images": result.test_images,
        "tta": recipe.eval.tta,
        "epochs": result.epochs,
        "steps": result.steps,
        "batch_size": recipe.data.batch_size,
        "pass_images": result.pass_images,
        "stop_at_target": result.target_stop.describe() if result.target_stop is not None else None,
        "newton_schulz_dtype": newton_schulz_dtype(recipe, session.runtime),
        "conv_weight_grad_choices": weight_grad.choices(),
        "train_seconds": result.train_seconds,
        "train_seconds_region": TRAIN_SECONDS_REGION,
        "final_eval_seconds": result.final_eval_seconds,
        "compile_seconds": session.compile_seconds,
        "compile_cache_hits": session.compile_cache["hits"],
        "compile_cache_misses": session.compile_cache["misses"],
        "monitor_seconds": result.monitor_seconds,
        "bookkeeping_seconds": result.bookkeeping_seconds,
        "recompiles": result.recompiles,
        "wall_seconds": wall,
        **start_up_figures(result, started, before_main),
        "seed": result.seed,
        **skipped_images(result, session.source),
        "resumed_from_step": result.resumed_from_step,
        "data_choices": list(getattr(session.source, "choices", None) or []),
        "data_cache": getattr(session.source, "cache", None),
        **flop_figures(result, session),
        **parallel,
        **session.runtime.describe(),
        **env,
        "torch_threads": torch.get_num_threads(),       # as the run trained (runtime.threads), not at start
    }


def target_of(recipe: Recipe) -> dict:
    """The recipe's target and the data set it was set for (a shipped recipe's own
    ``data.dataset``), or none where the run trains other data (``--set data.dataset=...``):
    a target is a claim about one data set."""
    from ..recipe import load_recipe, shipped_recipes
    d = recipe.data
    used = Path(d.path).name if d.dataset in ("folder", "npz") and d.path else d.dataset
    set_for = load_recipe(recipe.name).data.dataset if recipe.name in shipped_recipes() else d.dataset
    return {"target": recipe.target if set_for == d.dataset else None, "target_set_for": set_for,
            "target_data": used}


def target_line(target: dict, test_acc: float) -> str:
    """'94.00% (cifar10), reached' or 'none set for fashion.npz (94.00% is for cifar10)'."""
    if target["target"] is None:
        return f"none set for {target['target_data']} (the recipe's is for {target['target_set_for']})"
    reached = "reached" if test_acc >= target["target"] else "not reached"
    return f"{target['target']:.2%} ({target['target_set_for']}), {reached}"


def stop_at_target_line(target) -> str:
    """train.stop_at_target in the final table: where the run stopped, or that it never did,
    and what its checks cost (``target``: the run's :class:`~speedrun.engine.records.TargetStop`)."""
    cost = (f"{target.checks} check{'s' if target.checks != 1 else ''} of {target.holdout_images:,} held-out "
            f"images, {target.seconds:.2f} s")
    r = target.reached
    if r is None:
        return f"{target.target:.2%} not reached on the validation split ({cost})"
    return f"{r['holdout_acc']:.2%} on the validation split at epoch {r['epoch']}, step {r['step']} ({cost})"


def skipped_images(result: RunResult, source) -> dict:
    """The unreadable images the run left out (data.skip_corrupt): how many, and the first of
    them by name with why, from the decoded cache and from the streamed batches."""
    cache = getattr(source, "cache", None) or {}
    count = result.skipped_images + (cache.get("skipped_images") or 0)
    files = {**(getattr(source, "skipped_files", None) or {}), **result.skipped_files}
    return {"skipped_images": count, **listed(files, count)}


def data_path(recipe: Recipe, source) -> str | None:
    """Where the run read its data, as an absolute path (evaluate and export look there): the
    image folder or .npz file, or the folder holding a built-in set's files."""
    where = recipe.data.path if recipe.data.dataset in ("folder", "npz") else getattr(source, "source", None)
    return str(Path(where).expanduser().resolve()) if where else None


def preprocessing_of(recipe: Recipe, session, result: RunResult) -> dict:
    """How the run's evaluation turned an image into the model's input, for predict, evaluate
    and export: decode to ``channels``; for a folder run, resize the shorter side to
    ``image_size / eval_crop`` and take the centre ``image_size`` square (arrays are stored at
    ``image_size``); then (pixel - mean) / std per channel, in 0..255 units."""
    ds, d = session.source, recipe.data
    folder = d.dataset == "folder"
    return {"dataset": d.dataset, "channels": ds.in_channels, "image_size": list(ds.eval_size),
            "resize": "shorter_side_then_centre_crop" if folder else "to_image_size",
            "eval_crop": d.eval_crop if folder else 1.0, "decoder": d.decoder,
            "mean": result.normalisation[0], "std": result.normalisation[1], "pixel_range": [0, 255],
            "classes": list(ds.classes), "tta": recipe.eval.tta, "layout": "NCHW"}
