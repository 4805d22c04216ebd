"""Accuracy of recipe variants over seeds: many `speedrun train` processes, several at a time.

For accuracy, not speed: a GPU kept busy by one small model's training is mostly idle (the
host launches kernels one at a time), so several training processes side by side get many
seeds through in the time of a few. Each run is `speedrun train RECIPE --seed S --set ...` in
its own process, as a user runs it; the record keeps every run's test accuracy and summary,
and per variant the mean, a 95% interval, the one-sided p-value of "mean above the target"
and Welch's test against the first variant of the same recipe. Times in it are of processes that shared the
device and the cores with each other: they say how long the sweep took, not how fast a run is
(benchmarks/train_cli.py times runs alone).

    python benchmarks/accuracy_sweep.py --variant base=imagenette \
        --variant stem=imagenette@model.antialias=stem --seeds 5 --jobs 8 --budget 540 \
        --data-dir DATA --out benchmarks/results/FILE.json [--seeds-of stem=3] [--target 0.8743] \
        [--runs-dir DIR] [--threads 2] [-- more speedrun train arguments, e.g. --device cuda]

Jobs go seed by seed across the variants (seed 0 of each, then seed 1 of each, ...), so a sweep
cut short by ``--budget`` still has every variant's first seeds. No job starts after the
budget is spent, and a job still running at the end is stopped and recorded as cut.
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
from pathlib import Path

from speedrun.bench.stats import describe, p_mean_at_least, welch
from speedrun.errors import RecipeError
from speedrun.files import atomic_write_json
from speedrun.recipe import load_recipe
from speedrun.report.environment import machine


def parse_variant(text: str) -> tuple[str, str, list[str]]:
    """``NAME=RECIPE[@KEY=VALUE...]`` as (name, recipe, ["KEY=VALUE", ...])."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--variant {text!r}: give NAME=RECIPE[@KEY=VALUE...]")
    recipe, *sets = rest.split("@")
    if not recipe or any("=" not in s for s in sets):
        raise ValueError(f"--variant {text!r}: give NAME=RECIPE[@KEY=VALUE...]")
    return name, recipe, sets


def job_order(variants: list[dict]) -> list[tuple[dict, int]]:
    """(variant, seed) pairs: seed index by seed index, across the variants in their order."""
    most = max(v["seeds"] for v in variants)
    return [(v, v["first_seed"] + i) for i in range(most) for v in variants if i < v["seeds"]]


def summarize(variants: list[dict], runs: list[dict]) -> dict:
    """Per variant: the accuracies' mean, sd and 95% interval, the one-sided p-value of "mean
    above the target", how many runs did not finish or never started, and Welch's test against
    the first variant of the same recipe (``against``), where both have two runs or more."""
    summary, firsts = {}, {}
    for v in variants:
        accs = [r["test_acc"] for r in runs if r["variant"] == v["name"] and "test_acc" in r]
        row = {**describe(accs), "target": v["target"], "p_value_mean_at_least_target": p_mean_at_least(accs, v["target"]),
               "runs_not_done": sum(1 for r in runs if r["variant"] == v["name"] and "test_acc" not in r),
               "runs_not_started": v["seeds"] - sum(1 for r in runs if r["variant"] == v["name"])}
        first = firsts.setdefault(v["recipe"], (v["name"], accs))
        if first[0] != v["name"] and len(accs) >= 2 and len(first[1]) >= 2:
            row["against"] = {"variant": first[0], **welch(first[1], accs)}
        summary[v["name"]] = row
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=RECIPE[@KEY=VALUE...]")
    p.add_argument("--seeds", type=int, default=5, help="seeds per variant (0, 1, ...), unless --seeds-of")
    p.add_argument("--seeds-of", action="append", default=[], metavar="NAME=N")
    p.add_argument("--first-seed", type=int, default=0)
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
    extra = argv[cut + 1:]
    if args.out.exists():
        p.error(f"--out: {args.out} exists; give a new file")
    if args.runs_dir is not None and args.runs_dir.exists() and any(args.runs_dir.iterdir()):
        p.error(f"--runs-dir: {args.runs_dir} is not empty; give an empty or new folder")
    if args.jobs < 1 or args.seeds < 1:
        p.error("--jobs and --seeds: give at least 1")
    try:
        variants, names = [], set()
        for text in args.variant:
            name, recipe_name, sets = parse_variant(text)
            if name in names:
                raise ValueError(f"--variant: the name {name!r} is given twice")
            names.add(name)
            recipe = load_recipe(recipe_name, sets)          # a bad recipe or value is refused before any run
            variants.append({"name": name, "recipe": recipe_name, "sets": sets, "seeds": args.seeds,
                             "first_seed": args.first_seed,
                             "target": args.target if args.target is not None else recipe.target})
        for text in args.seeds_of:
            name, _, n = text.partition("=")
            match = [v for v in variants if v["name"] == name]
            if not match or not n.isdigit() or int(n) < 1:
                raise ValueError(f"--seeds-of {text!r}: give NAME=N for a variant's name and N >= 1")
            match[0]["seeds"] = int(n)
    except (ValueError, RecipeError) as e:
        p.error(str(e))

    environ = machine(args.commit)      # read before any run
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    tmp = None
    if args.runs_dir is None:
        tmp = tempfile.TemporaryDirectory()
        root = Path(tmp.name)
    else:
        root = args.runs_dir
    root.mkdir(parents=True, exist_ok=True)
    pending = job_order(variants)
    running, runs = [], []
    t0 = time.monotonic()
    deadline = t0 + args.budget

    def finish(job, status):
        proc, log, folder, variant, seed, started = job
        log.close()
        run = {"variant": variant["name"], "seed": seed, "status": status, "returncode": proc.returncode,
               "process_wall_seconds": time.monotonic() - started, "started_at_seconds": started - t0}
        summary = folder / "summary.json"
        if status == "done" and proc.returncode == 0 and summary.is_file():
            run["summary"] = json.loads(summary.read_text())
            run["test_acc"] = run["summary"]["test_acc"]
            print(f"{variant['name']} seed {seed}: {run['test_acc']:.4f} ({run['process_wall_seconds']:.0f} s)",
                  flush=True)
        else:
            if status == "done":
                run["status"] = "failed"
            tail = Path(log.name).read_text(errors="replace").splitlines()[-15:]
            run["log_tail"] = tail
            print(f"{variant['name']} seed {seed}: {run['status']} (rc {proc.returncode})", flush=True)
        runs.append(run)

    while pending or running:
        now = time.monotonic()
        for job in list(running):
            if job[0].poll() is not None:
                running.remove(job)
                finish(job, "done")
        if now >= deadline:
            for job in running:
                job[0].terminate()
            for job in running:
                try:
                    job[0].wait(timeout=30)
                except subprocess.TimeoutExpired:
                    job[0].kill()
                    job[0].wait()
                finish(job, "cut")
            running = []
            break
        while pending and len(running) < args.jobs:
            variant, seed = pending.pop(0)
            folder = root / f"{variant['name']}-seed{seed}"
            cmd = [sys.executable, "-m", "speedrun", "train", variant["recipe"], "--seed", str(seed),
                   "--out", str(folder)]
            for s in variant["sets"]:
                cmd += ["--set", s]
            cmd += (["--data-dir", args.data_dir] if args.data_dir else []) + extra
            log = open(root / f"{variant['name']}-seed{seed}.log", "w")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((proc, log, folder, variant, seed, time.monotonic()))
        time.sleep(0.5)

    summary = summarize(variants, runs)
    record = {
        "benchmark": "accuracy of recipe variants over seeds, several training processes at a time",
        "timed": "nothing comparable: the processes shared the device and the cores; process_wall_seconds says how "
                 "long each took beside the others",
        "command": " ".join(["accuracy_sweep.py", *sys.argv[1:]]),
        "jobs": args.jobs, "threads_per_process": threads, "budget_seconds": args.budget,
        "sweep_seconds": time.monotonic() - t0,
        "variants": variants,
        "runs": sorted(runs, key=lambda r: (r["variant"], r["seed"])),
        "summary": summary,
        "environment": environ,
    }
    atomic_write_json(args.out, record)
    for name, row in summary.items():
        print(f"{name}: mean {row['mean']:.4f} over {row['n']} (std {row['std']:.4f}), "
              f"p(mean > {row['target']}) = {row['p_value_mean_at_least_target']:.3g}")
    if tmp is not None:
        tmp.cleanup()
    return 0 if all(r.get("test_acc") is not None for r in runs) and not any(
        row["runs_not_started"] for row in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
