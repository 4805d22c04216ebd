"""Accuracy of recipe variants over seeds: many `speedrun train` processes, several at a time.

For accuracy, not speed: one small model's training leaves a GPU mostly idle, so several processes
side by side get many seeds through in the time of a few (they share the device and cores, so their
times compare with nothing; benchmarks/train_cli.py times runs alone). The record keeps every run's
summary and each variant's statistics (``summarize``); a ``--budget`` cuts the sweep (``run_job``).

    python benchmarks/accuracy_sweep.py --variant base=imagenette \
        --variant stem=imagenette@model.antialias=stem --seeds 5 --jobs 8 --budget 540 \
        --data-dir DATA --out benchmarks/results/FILE.json [--seeds-of stem=3] [--target 0.8743] \
        [--runs-dir DIR] [--threads 2] [-- more speedrun train arguments, e.g. --device cuda]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from speedrun.bench.stats import describe, p_mean_at_least, welch
from speedrun.errors import SpeedrunError
from speedrun.files import atomic_write_json, check_output_file
from speedrun.recipe import load_recipe
from speedrun.report.environment import machine


def job_order(variants: list[dict]) -> list[tuple[dict, int]]:
    """(variant, seed) pairs: seed index by seed index, across the variants in their order, so that a sweep
    cut short by its budget still has every variant's first seeds."""
    most = max(v["seeds"] for v in variants)
    return [(v, i) for i in range(most) for v in variants if i < v["seeds"]]


def summarize(variants: list[dict], runs: list[dict]) -> dict:
    """Per variant: the accuracies' mean, sd and 95% interval, the one-sided p-value of "mean
    above the target", how many runs did not finish or never started, and Welch's test against
    the first variant of the same recipe (``against``), where both have two runs or more."""
    summary, firsts = {}, {}
    for v in variants:
        mine = [r for r in runs if r["variant"] == v["name"]]
        accs = [r["test_acc"] for r in mine if "test_acc" in r]
        row = {**describe(accs), "target": v["target"],
               "p_value_mean_at_least_target": p_mean_at_least(accs, v["target"]),
               "runs_not_done": len(mine) - len(accs), "runs_not_started": v["seeds"] - len(mine)}
        first = firsts.setdefault(v["recipe"], (v["name"], accs))
        if first[0] != v["name"] and len(accs) >= 2 and len(first[1]) >= 2:
            row["against"] = {"variant": first[0], **welch(first[1], accs)}
        summary[v["name"]] = row
    return summary


def parse():
    """The options before ``--`` (``extra``: the arguments after it for every run) and the variants; a bad
    variant, recipe value or folder is refused before anything runs or is written."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=RECIPE[@KEY=VALUE...]")
    p.add_argument("--seeds", type=int, default=5, help="seeds per variant (0, 1, ...), unless --seeds-of")
    p.add_argument("--seeds-of", action="append", default=[], metavar="NAME=N")
    p.add_argument("--jobs", type=int, default=1, help="training processes at a time")
    p.add_argument("--budget", type=float, default=math.inf, help="seconds for the whole sweep")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for each process (default: cores / jobs)")
    p.add_argument("--target", type=float, help="accuracy to test each mean against (default: the recipe's)")
    p.add_argument("--data-dir")
    p.add_argument("--runs-dir", type=Path, help="keep each run's folder and log here (default: a temporary folder)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--commit", help="the commit the record names (default: $SPEEDRUN_COMMIT, else git rev-parse HEAD)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.extra, args.variants = argv[cut + 1:], []
    if args.runs_dir is not None and args.runs_dir.exists() and any(args.runs_dir.iterdir()):
        p.error(f"--runs-dir: {args.runs_dir} is not empty; give an empty or new folder")
    if args.jobs < 1 or args.seeds < 1:
        p.error("--jobs and --seeds: give at least 1")
    try:
        check_output_file(args.out, "--out")
        for text in args.variant:
            name, _, rest = text.partition("=")                # NAME=RECIPE[@KEY=VALUE...]
            recipe_name, *sets = rest.split("@")
            if not name or not recipe_name or any("=" not in s for s in sets):
                raise ValueError(f"--variant {text!r}: give NAME=RECIPE[@KEY=VALUE...]")
            if any(v["name"] == name for v in args.variants):
                raise ValueError(f"--variant: the name {name!r} is given twice")
            recipe = load_recipe(recipe_name, sets)          # a bad recipe or value is refused before any run
            args.variants.append({"name": name, "recipe": recipe_name, "sets": sets, "seeds": args.seeds,
                                  "target": args.target if args.target is not None else recipe.target})
        for text in args.seeds_of:
            name, _, n = text.partition("=")
            match = [v for v in args.variants if v["name"] == name]
            if not match or not n.isdigit() or int(n) < 1:
                raise ValueError(f"--seeds-of {text!r}: give NAME=N for a variant's name and N >= 1")
            match[0]["seeds"] = int(n)
    except (ValueError, SpeedrunError) as e:
        p.error(str(e))
    return args


def run_job(args, variant: dict, seed: int, root: Path, env: dict, t0: float) -> dict | None:
    """One ``speedrun train`` process, stopped (SIGTERM, then SIGKILL after 30 s) at the budget's end;
    None where the budget was spent before it could start."""
    started, deadline = time.monotonic(), t0 + args.budget
    if started >= deadline:
        return None
    folder, log = root / f"{variant['name']}-seed{seed}", root / f"{variant['name']}-seed{seed}.log"
    cmd = [sys.executable, "-m", "speedrun", "train", variant["recipe"], "--seed", str(seed), "--out", str(folder),
           *[a for s in variant["sets"] for a in ("--set", s)],
           *(["--data-dir", args.data_dir] if args.data_dir else []), *args.extra]
    with open(log, "w") as out:
        proc, status = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env), "done"
        try:
            proc.wait(timeout=None if math.isinf(deadline) else max(0.0, deadline - started))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = "cut"
    run = {"variant": variant["name"], "seed": seed, "status": status, "returncode": proc.returncode,
           "process_wall_seconds": time.monotonic() - started, "started_at_seconds": started - t0}
    if status == "done" and proc.returncode == 0 and (folder / "summary.json").is_file():
        run["summary"] = json.loads((folder / "summary.json").read_text())
        run["test_acc"] = run["summary"]["test_acc"]
        print(f"{variant['name']} seed {seed}: {run['test_acc']:.4f} ({run['process_wall_seconds']:.0f} s)", flush=True)
    else:
        run["status"] = "cut" if status == "cut" else "failed"
        run["log_tail"] = log.read_text(errors="replace").splitlines()[-15:]
        print(f"{variant['name']} seed {seed}: {run['status']} (rc {proc.returncode})", flush=True)
    return run


def main() -> int:
    args = parse()
    environ = machine(args.commit)      # read before any run
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        root = args.runs_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        jobs = [pool.submit(run_job, args, v, seed, root, env, t0) for v, seed in job_order(args.variants)]
        runs = [run for run in (job.result() for job in jobs) if run is not None]
    summary = summarize(args.variants, runs)
    record = {
        "benchmark": "accuracy of recipe variants over seeds, several training processes at a time",
        "timed": "nothing comparable: the processes shared the device and the cores; process_wall_seconds says how "
                 "long each took beside the others",
        "command": " ".join(["accuracy_sweep.py", *sys.argv[1:]]), "jobs": args.jobs, "threads_per_process": threads,
        "budget_seconds": args.budget, "sweep_seconds": time.monotonic() - t0, "variants": args.variants,
        "runs": sorted(runs, key=lambda r: (r["variant"], r["seed"])), "summary": summary, "environment": environ}
    atomic_write_json(args.out, record)
    for name, row in summary.items():
        print(f"{name}: mean {row['mean']:.4f} over {row['n']} (std {row['std']:.4f}), "
              f"p(mean > {row['target']}) = {row['p_value_mean_at_least_target']:.3g}")
    return 0 if all("test_acc" in r for r in runs) and not any(r["runs_not_started"] for r in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
