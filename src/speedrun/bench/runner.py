"""``speedrun bench``: N seeded, independent runs of a recipe in one process.

Warm-up (and compilation) happens once, before the first timed run. Before each run the
model is re-initialised from its seed and the dataset is loaded from disk again, so the
three timing regions can be measured on every run:

- ``train+eval`` (speed-run convention): first touch of the training data on the device,
  including its preprocessing and whitening, to the final TTA accuracy; the device is
  synchronised at both ends. The data set is moved to the device just before (the peers'
  loaders hold it there before their timers start).
- ``end_to_end`` (DAWNBench convention): the above plus loading the dataset from disk and
  moving it to the device.
- ``run_start_to_stop`` (MLPerf convention): the above plus model construction,
  initialisation and device memory allocation.
"""
from __future__ import annotations

import time

from ..data.pipeline.dataset import open_source
from ..engine.loop import Session
from ..engine.plan import plan_run
from ..recipe import Recipe
from ..report.environment import environment
from ..files import atomic_write_json
from ..engine import flops
from .stats import describe, describe_times, p_mean_at_least

REGIONS = ("train+eval", "end_to_end", "run_start_to_stop")
REGION_NOTES = {
    "train+eval": "first touch of the training data on the device (its channel statistics, the whitening "
                  "fit) to the final TTA accuracy; device synchronised at both ends; compile warm-up and the "
                  "data's move to the device excluded",
    "end_to_end": "train+eval plus loading and verifying the dataset files from disk and moving them to the "
                  "device (DAWNBench)",
    "run_start_to_stop": "end_to_end plus model construction, initialisation and device memory "
                         "allocation (MLPerf)",
}


def summarize(recipe: Recipe, runs: list[dict]) -> dict:
    accs = [r["test_acc"] for r in runs]
    return {
        "runs": len(runs),
        "test_acc": describe(accs),
        "test_acc_no_tta": describe([r["test_acc_no_tta"] for r in runs]),
        "times": {region: describe_times([r["times"][region] for r in runs]) for region in REGIONS},
        "frac_at_target": sum(a >= recipe.target for a in accs) / len(accs) if accs else None,
        "p_value_mean_at_least_target": p_mean_at_least(accs, recipe.target),
    }


def run_bench(recipe: Recipe, device, runs: int, data_dir=None, seed0: int | None = None,
              out_path=None, progress=None, on_run=None) -> dict:
    """Run the benchmark of ``recipe`` on ``device`` (planned as ``speedrun train`` plans a
    run: :func:`~speedrun.engine.plan.plan_run`); writes ``out_path`` (bench.json) after every
    run when given."""
    seed0 = recipe.train.seed if seed0 is None else seed0
    plan = plan_run(recipe, data_dir, device)
    recipe, dataset, runtime, load_seconds = plan.recipe, plan.source, plan.runtime, plan.open_seconds
    session = Session(recipe, dataset, runtime, warm_up=True)
    record = {
        "recipe": recipe.name,
        "target": recipe.target,
        "recipe_hash": recipe.digest(),
        "recipe_config": recipe.to_dict(),
        "regions": REGION_NOTES,
        "compile_seconds": session.compile_seconds,
        "compile_cache": session.compile_cache,       # inductor's persistent cache: hits and misses of the warm-up
        "first_load_seconds": load_seconds,
        "runs": [],
        "summary": None,
        "environment": {**environment(), **runtime.describe()},
    }
    rt = runtime
    for i in range(runs):
        seed = seed0 + i
        rt.synchronize()
        t0 = time.perf_counter()
        session.reset(seed)
        rt.synchronize()
        t1 = time.perf_counter()
        session.source = open_source(recipe, data_dir)[1]
        result = session.run(seed, progress)
        t2 = time.perf_counter()
        paused = result.monitor_seconds
        run = {
            "seed": seed,
            "test_acc": result.test_acc,
            "test_acc_no_tta": result.test_acc_no_tta,
            "epochs": result.epochs,
            "steps": result.steps,
            "recompiles": result.recompiles,
            "stop_at_target": result.target_stop.describe() if result.target_stop is not None else None,
            "times": {"train+eval": result.train_seconds, "end_to_end": t2 - t1 - paused,
                      "run_start_to_stop": t2 - t0 - paused},
            "history": [vars(h) for h in result.history],
        }
        record["runs"].append(run)
        record["summary"] = summarize(recipe, record["runs"])
        if out_path is not None:
            atomic_write_json(out_path, record)
        if on_run is not None:
            on_run(i, run)
    total = flops.flops_of_run(session.recipe, session.source, record["runs"][0]["steps"] if runs else 0,
                               session.step.frozen_from)
    mean_time = record["summary"]["times"]["train+eval"]["mean"] if runs else 0.0
    record["flops"] = {**total, **flops.efficiency(total["total_flops"], mean_time, rt.device.type,
                                                   record["environment"]["device_name"], rt.precision)}
    if out_path is not None:
        atomic_write_json(out_path, record)
    return record
