"""The structure of one training step, eager and compiled, counted on the CPU (what a GPU
would launch and wait for), and CPU milliseconds per step; or the cost of the stop check the
loop makes after every step. Which rows, and what each counts: benchmarks/README.md.

    python benchmarks/step_structure.py [--backend inductor] [--only cifar10-94] [--timed-steps 3]
        [--no-structure] [--ddp | --ddp-only] [--set KEY=VALUE ...] [--out FILE.json]
    python benchmarks/step_structure.py --stop-check [--calls 2000] [--out FILE.json]

The counts are taken on narrow nets (they do not depend on width), the times at the recipes' own
widths, on the first 2,048 CIFAR-10 training images ($SPEEDRUN_DATA or ../shared/datasets),
upscaled to 64 px for imagenet-resnet50. Where --set makes a timing row's recipe a structure
row's (e.g. --set model.widths=... --set data.batch_size=...), its steps are timed in that row's
session, after the counted steps, and the timing entry says so (``timed_in``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F

from speedrun.data import load_dataset
from speedrun.engine.distributed import StopAgreement
from speedrun.engine.runtime import BACKEND_VARIABLE, Runtime
from speedrun.errors import SpeedrunError
from speedrun.files import atomic_write_json, check_output_file
from speedrun.profiling.step_structure import measure
from speedrun.recipe import load_recipe
from speedrun.report.environment import machine
from speedrun.stop_signals import StopSignals
from speedrun.world import World

RESULTS = Path(__file__).resolve().parent / "results"
NARROW = {"cifar10-94": ["model.widths=[16,32,32]"], "cifar10-94-fast": ["model.widths=[16,32,32]"],
          "imagenet-resnet50": ["model.width=16"]}
BATCH = {"cifar10-94": 256, "cifar10-94-fast": 256, "imagenet-resnet50": 32}
TIMED_BATCH = {"cifar10-94": 1024, "cifar10-94-fast": 2000, "imagenet-resnet50": 64}


def data(recipe: str, train: int = 2048, test: int = 512):
    root = os.environ.get("SPEEDRUN_DATA") or str(Path(__file__).resolve().parents[2] / "shared" / "datasets")
    ds = load_dataset("cifar10", root, fetch=False)
    ds = dataclasses.replace(ds, train_x=ds.train_x[:train], train_y=ds.train_y[:train],
                             test_x=ds.test_x[:test], test_y=ds.test_y[:test])
    if recipe.startswith("imagenet"):
        up = lambda x: F.interpolate(x.float(), size=(64, 64), mode="bilinear", antialias=False).round().clamp(0, 255) \
            .to(torch.uint8)
        ds = dataclasses.replace(ds, train_x=up(ds.train_x), test_x=up(ds.test_x))
    return ds


def overrides_of(name: str, sets: list[str], timing: bool) -> list[str]:
    """A row's overrides: a structure row's on the narrow net, a timing row's at the recipe's own widths."""
    batch = TIMED_BATCH[name] if timing else BATCH[name]
    overrides = ([] if timing else NARROW[name]) + [f"data.batch_size={batch}", "eval.batch_size=512", *sets]
    return overrides + (["eval.tta=none"] if name == "imagenet-resnet50" else [])


def one(name: str, precision: str, compiled: bool, backend: str, sets: list[str], timed_steps: int = 0,
        steps: int = 4, world=None, timing: bool | None = None) -> dict:
    """One row: ``steps`` steps counted, then ``timed_steps`` timed, on the overrides of a timing row
    (``timing``; default: where ``timed_steps``) or of a structure row."""
    os.environ[BACKEND_VARIABLE] = backend
    timing = bool(timed_steps) if timing is None else timing
    overrides, batch = overrides_of(name, sets, timing), (TIMED_BATCH if timing else BATCH)[name]
    recipe = load_recipe(name, overrides)
    rt = Runtime(torch.device("cpu"), precision, compiled, True, "default", backend, cast=recipe.runtime.cast)
    t = time.perf_counter()
    out = measure(recipe, data(name, train=max(2048, 2 * batch)), rt, steps=steps, timed_steps=timed_steps,
                  world=world)
    return {"recipe": name, "precision": precision, "compiled": compiled, "backend": backend if compiled else None,
            "overrides": overrides, **out, "seconds": time.perf_counter() - t}


DDP_ROWS = [("cifar10-94", []), ("imagenet-resnet50", []), ("imagenet-resnet50", ["distributed.bucket_mb=1"])]
"""Data-parallel rows, each a compiled step counted in two torchrun workers (gloo), its sets after --set's:
the recipes' own gradient buckets (one bucket for the narrow nets), and ResNet-50 with 1 MiB buckets, the
smallest compiled DDP allows (DDP's first bucket), so that dynamo cuts the compiled model into several graphs."""


def torchrun(worker: list[str], processes: int = 2) -> list[dict]:
    """This script's ``worker`` arguments run in ``processes`` torchrun processes (gloo, one
    thread each); what each rank wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               __file__, *worker, "--ddp-out", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode:
            raise SystemExit(f"{' '.join(worker)}: {proc.stdout[-1500:]}{proc.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(processes)]


def ddp_worker(args, precision: str) -> int:
    """One torchrun process: a data-parallel structure row, or the stop check's rounds."""
    from speedrun.engine import distributed
    world = distributed.detect()
    distributed.start(world, torch.device("cpu"), "gloo", 600.0)
    try:
        if args.ddp_worker == "stop-check":
            agreement, stop = StopAgreement(world), StopSignals()
            row = {"us": time_calls(lambda: agreement.signal(stop.received), args.calls)}
        else:
            row = one(args.ddp_worker, precision, True, args.backend, args.set, world=world)
    finally:
        distributed.stop()
    atomic_write_json(args.ddp_out / f"rank{world.rank}.json", row)
    return 0


def time_calls(check, calls: int) -> list[float]:
    """Microseconds per call of ``check``, in 5 rounds of ``calls`` calls (after 100 to warm up; timeit's
    rounds, the garbage collector paused)."""
    timeit.timeit(check, number=100)
    return [seconds / calls * 1e6 for seconds in timeit.repeat(check, repeat=5, number=calls)]


def stop_check(calls: int, out: Path, env: dict) -> int:
    """The stop check's microseconds per call in one process and in two (torchrun, gloo)."""
    torch.set_num_threads(1)
    one_process, stop = StopAgreement(World()), StopSignals()
    record = {"script": "step_structure.py", "what": "microseconds per call of the loop's stop check, 5 rounds",
              "calls_per_round": calls, "one_process_us": time_calls(lambda: one_process.signal(stop.received), calls)}
    record["two_processes_gloo_us"] = torchrun(["--ddp-worker", "stop-check", "--calls", str(calls)])[0]["us"]
    record.update(median_us={k: statistics.median(record[k]) for k in ("one_process_us", "two_processes_gloo_us")},
                  environment=env)
    atomic_write_json(out, record)
    print({k: round(v, 2) for k, v in record["median_us"].items()}, f"record: {out}")
    return 0


def counts(row: dict) -> str:
    return (f"breaks {row['graph_breaks']} regions {row['compiled_regions_per_step']} eager ops "
            f"{row['eager_ops_per_step']} syncs {row['host_syncs_per_step']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--only", action="append", help="a recipe (repeatable)")
    p.add_argument("--precisions", default="fp32,bf16,fp16",
                   help="the accumulate and data-parallel rows: bf16, or the first of these without bf16")
    p.add_argument("--timed-steps", type=int, default=3, help="steps timed per recipe at full width (0: none)")
    p.add_argument("--no-structure", action="store_true", help="only the timing")
    p.add_argument("--timing-precisions", default="fp32,bf16")
    p.add_argument("--ddp", action="store_true", help="also the data-parallel rows (2 torchrun processes, gloo)")
    p.add_argument("--ddp-only", action="store_true", help="only the data-parallel rows (added to --out's record)")
    p.add_argument("--stop-check", action="store_true", help="time the loop's stop check instead (its own record)")
    p.add_argument("--calls", type=int, default=2000, help="--stop-check: calls per round")
    p.add_argument("--ddp-worker", help=argparse.SUPPRESS)
    p.add_argument("--ddp-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every row (e.g. the GPU levers: model.global_pool_grad=select)")
    p.add_argument("--out", type=Path, help="the record (default: results/step-structure-CPU.json; --stop-check: "
                                            "results/stop-check-CPU-COMMIT.json, never overwritten)")
    args = p.parse_args()
    precisions = args.precisions.split(",")
    lead = "bf16" if "bf16" in precisions else precisions[0]         # (the accumulate and data-parallel rows)
    if args.ddp_worker:
        return ddp_worker(args, lead)
    env = machine()
    cpu = re.sub(r"[^a-z0-9]+", "-", f"{env['cpu_model']} {env['cpu_family_model']}".lower()).strip("-")
    if args.stop_check:
        commit = (env.get("git_commit") or "")[:7]
        out = args.out or RESULTS / f"stop-check-{cpu}{'-' if commit else ''}{commit}.json"
        try:
            check_output_file(out, "--out")
        except SpeedrunError as err:
            p.error(str(err))
        return stop_check(args.calls, out, env)
    out = args.out or RESULTS / f"step-structure-{cpu}.json"
    recipes = args.only or ["cifar10-94", "cifar10-94-fast", "imagenet-resnet50"]
    kept = json.loads(out.read_text()) if (args.ddp_only or args.no_structure) and out.exists() else {}
    record = {"what": "structure of one training step (TrainStep) per recipe, precision and mode: graph breaks, "
                      "compiled regions per step, eager ATen compute ops per step outside compiled regions, host "
                      "syncs per step (max over the counted steps of a real epoch); then ms per step (wall, after "
                      "the warm-up) eager vs compiled at the recipes' own widths",
              "environment": env, "backend": args.backend, "rows": kept.get("rows", []),
              "timing": kept.get("timing", []) if args.ddp_only else [], "ddp": kept.get("ddp", [])}
    structure = [(precision, compiled, []) for precision in precisions for compiled in (False, True)]
    structure.append((lead, True, ["train.accumulate=2"]))
    timings = [(name, precision, compiled) for name in (recipes if args.timed_steps and not args.ddp_only else [])
               for precision in args.timing_precisions.split(",") for compiled in (False, True)]
    timed_in = {}        # (name, precision, compiled) -> a structure row whose session also timed the steps
    for name in recipes if not (args.no_structure or args.ddp_only) else []:
        for precision, compiled, sets in structure:
            # where --set makes a timing row's recipe this row's (a narrow timing), its steps are timed in
            # this row's session, after the counted ones, rather than in a session built and compiled again
            same = (not sets and (name, precision, compiled) in timings and load_recipe(
                name, overrides_of(name, args.set, False)).digest() == load_recipe(
                name, overrides_of(name, args.set, True)).digest())
            row = one(name, precision, compiled, args.backend, [*args.set, *sets],
                      timed_steps=args.timed_steps if same else 0, timing=False)
            if same:
                timed_in[(name, precision, compiled)] = row
            record["rows"].append(row)
            print(f"{name:18} {precision:5} {'compiled' if compiled else 'eager':8} {' '.join(sets)} {counts(row)}",
                  flush=True)
            atomic_write_json(out, record)
    for name, sets in DDP_ROWS if args.ddp or args.ddp_only else []:
        if name in recipes:
            ranks = torchrun(["--ddp-worker", name, "--backend", args.backend, "--precisions", lead,
                              *sum((["--set", s] for s in [*args.set, *sets]), [])])
            row = {**ranks[0], "processes": len(ranks), "ddp_sets": sets,            # (rank 0's counts)
                   "compiled_regions_per_step_by_rank": [r["compiled_regions_per_step"] for r in ranks]}
            record["ddp"] = [r for r in record["ddp"] if (r["recipe"], r.get("ddp_sets", [])) != (name, sets)] + [row]
            print(f"{name:18} {lead:5} compiled DDP x{row['processes']} {' '.join(sets) or 'recipe buckets'}: "
                  f"{counts(row)}, regions by rank {row['compiled_regions_per_step_by_rank']}", flush=True)
            atomic_write_json(out, record)
    for name, precision, compiled in timings:
        row = timed_in.get((name, precision, compiled))
        shared = row is not None
        if not shared:
            row = one(name, precision, compiled, args.backend, args.set, timed_steps=args.timed_steps, steps=1)
        record["timing"].append({**{k: row[k] for k in ("recipe", "precision", "compiled", "backend",
                                                       "ms_per_step", "build_and_warm_up_seconds")},
                                 "overrides": overrides_of(name, args.set, True),
                                 **({"timed_in": "the structure row's session (the same recipe)"}
                                    if shared else {})})
        ms = row["ms_per_step"]
        print(f"{name:18} {precision:5} {'compiled' if compiled else 'eager':8} {sum(ms) / len(ms):9.1f} "
              f"ms/step (min {min(ms):.1f}) warm-up {row['build_and_warm_up_seconds']:.1f} s", flush=True)
        atomic_write_json(out, record)
    print(f"record: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
