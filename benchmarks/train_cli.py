"""Time `speedrun train RECIPE` as a user runs it: the whole process, start-up included.

Runs the command N times as a subprocess, measures each process's wall time from outside,
and writes one JSON record with every run's summary.json, the device, torch version and
commit. Usage:

    .venv/bin/python benchmarks/train_cli.py fashion-mnist --runs 3 --data-dir ../shared/datasets \
        --out benchmarks/results/fashion-mnist-cpu-demo.json [-- --set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speedrun.report.environment import machine
from speedrun.files import atomic_write_json


def timed_train(cmd: list[str], env: dict, folder: Path, cwd: Path | None = None):
    """Run one ``speedrun train ... --out folder`` process; (its completed process, wall seconds
    from interpreter start to exit, summary.json, metrics.jsonl rows). The record is read only
    when the process succeeded (else summary and metrics are None)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if proc.returncode:
        return proc, wall, None, None
    summary = json.loads((folder / "summary.json").read_text())
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return proc, wall, summary, metrics


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + runs - 1")
    p.add_argument("--data-dir")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keep-runs", type=Path,
                   help="copy each run's folder (config, metrics, summary, weights) to KEEP_RUNS/run<i> "
                        "after its process ended (outside the timed region)")
    p.add_argument("--cold-cache", action="store_true",
                   help="each run with an empty decoded-folder cache and an empty compile cache (the "
                        "decoding and any compiling are in the timed process)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)     # after --: more arguments for speedrun train
    args = p.parse_args(argv[:cut])
    environ = machine()      # (the commit that runs, read before it runs)
    args.extra = argv[cut + 1:]
    kept = [args.keep_runs / f"run{i}" for i in range(args.runs)] if args.keep_runs else []
    taken = [k for k in kept if k.exists()]
    if taken:                                        # refused before any run, not after the first
        p.error(f"--keep-runs: {taken[0]} exists; give an empty or new folder")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            folder = Path(tmp) / f"run{i}"
            cmd = [sys.executable, "-m", "speedrun", "train", args.recipe, "--seed", str(args.first_seed + i),
                   "--out", str(folder)]
            cmd += (["--data-dir", args.data_dir] if args.data_dir else []) + args.extra
            env = dict(os.environ)
            if args.cold_cache:
                env["SPEEDRUN_CACHE"] = str(Path(tmp) / f"cache{i}")
                env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"inductor{i}")
            proc, wall, summary, metrics = timed_train(cmd, env, folder)
            if proc.returncode:
                print(proc.stderr, file=sys.stderr)
                return proc.returncode
            if args.keep_runs:
                shutil.copytree(folder, args.keep_runs / f"run{i}", dirs_exist_ok=False)
            runs.append({"process_wall_seconds": wall, "summary": summary, "metrics": metrics,
                         "stdout_head": proc.stdout.splitlines()[:8]})
            print(f"run {i}: test_acc {summary['test_acc']:.4f}, process wall {wall:.1f} s, "
                  f"train_seconds {summary['train_seconds']:.1f}")
    walls = [r["process_wall_seconds"] for r in runs]
    accs = [r["summary"]["test_acc"] for r in runs]
    record = {
        "benchmark": "speedrun train, whole process",
        "timed": "process_wall_seconds: from starting the Python interpreter to its exit (imports, data "
                 "loading and checks, training, evaluation, writing the record); train_seconds inside "
                 "each summary is the speed-run region",
        "recipe": args.recipe,
        "cold_cache": args.cold_cache,
        "command": " ".join(["speedrun", "train", args.recipe, *(["--data-dir", args.data_dir] if args.data_dir else []),
                             *args.extra]),
        "runs": runs,
        "summary": {"test_acc_min": min(accs), "test_acc_mean": sum(accs) / len(accs),
                    "process_wall_seconds_max": max(walls), "process_wall_seconds_mean": sum(walls) / len(walls)},
        "environment": environ,
    }
    atomic_write_json(args.out, record)
    print(json.dumps(record["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
