"""``speedrun train``: one run of a recipe, from files on disk to a run record."""
from __future__ import annotations

import time

import torch

from .bench import flops
from .data import load_dataset
from .engine.loop import NonFiniteLoss, RunResult, Session
from .engine.runtime import device_name, pick_device, resolve_runtime
from .errors import TrainingStopped
from .recipe import Recipe, load_recipe
from .report.console import TrainingProgress, print_table
from .report.environment import environment
from .report.record import RunRecord, new_run_dir


def out_of_memory_message(recipe: Recipe, device) -> str:
    return (f"out of memory on {device} with data.batch_size={recipe.data.batch_size}; "
            "lower it with --set data.batch_size=N (optim.lr and optim.weight_decay are stated "
            "per optim.ref_batch examples, so the recipe's meaning is kept)")


def flop_figures(recipe: Recipe, result: RunResult, session: Session) -> dict:
    ds, rt = session.dataset, session.runtime
    per_image = flops.per_image_flops(recipe, ds.in_channels, ds.num_classes, ds.image_size)
    total = flops.run_flops(recipe, per_image, result.steps * recipe.data.batch_size, len(ds.test_y))
    eff = flops.efficiency(total["total_flops"], result.train_seconds, rt.device.type,
                           device_name(rt.device), rt.precision)
    return {**total, **eff}


def summary_of(recipe: Recipe, result: RunResult, session: Session, env: dict, wall: float) -> dict:
    return {
        "recipe": recipe.name,
        "recipe_hash": recipe.digest(),
        "dataset": recipe.data.dataset,
        "target": recipe.target,
        "test_acc": result.test_acc,
        "test_acc_no_tta": result.test_acc_no_tta,
        "tta": recipe.eval.tta,
        "epochs": result.epochs,
        "steps": result.steps,
        "batch_size": recipe.data.batch_size,
        "train_seconds": result.train_seconds,
        "train_seconds_region": "first touch of the training data (incl. preprocessing and "
                                "whitening) to the final TTA accuracy; excludes compile warm-up "
                                "and per-epoch monitoring evaluations",
        "compile_seconds": session.compile_seconds,
        "monitor_seconds": result.monitor_seconds,
        "wall_seconds": wall,
        "seed": result.seed,
        **flop_figures(recipe, result, session),
        **session.runtime.describe(),
        **env,
    }


def train_command(args) -> int:
    overrides = list(args.overrides) + ([f"train.seed={args.seed}"] if args.seed is not None else [])
    recipe = load_recipe(args.recipe, overrides)
    runtime = resolve_runtime(recipe.runtime, pick_device(args.device))
    record = RunRecord(args.out or new_run_dir(recipe.name))
    record.write_config(recipe.to_toml())
    env = environment()
    dataset = load_dataset(recipe.data.dataset, args.data_dir)
    try:
        session = Session(recipe, dataset, runtime)
        with TrainingProgress(recipe.name) as progress:
            result = session.run(progress=progress, on_epoch=lambda rec: record.append_metrics(vars(rec)))
    except NonFiniteLoss as err:
        path = record.save_weights(err.last_good, "last_good.pt")
        raise TrainingStopped(
            f"{err}. The last good weights (after step {err.last_good_step}) are in {path}. "
            "Lower optim.lr, or check the data, then run again.") from None
    except torch.OutOfMemoryError:
        raise TrainingStopped(out_of_memory_message(recipe, runtime.device)) from None
    record.save_weights(result.state_dict)
    summary = summary_of(recipe, result, session, env, time.perf_counter() - args.started)
    record.write_summary(summary)
    print_table(f"{recipe.name} on {summary['device_name']}", [
        ("test accuracy" + (f" ({recipe.eval.tta} TTA)" if recipe.eval.tta != "none" else ""),
         f"{result.test_acc:.2%}"),
        ("without TTA", f"{result.test_acc_no_tta:.2%}"),
        ("target", f"{recipe.target:.2%}"),
        ("epochs", f"{result.epochs:g}"),
        ("train seconds", f"{result.train_seconds:.2f}"),
        ("compile seconds", f"{session.compile_seconds:.2f}"),
        ("wall seconds", f"{summary['wall_seconds']:.2f}"),
        ("record", str(record.folder)),
    ])
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
