"""Fine-tuning beside fastai's and timm's own code: how soon each system gets a photo folder to a
held-out accuracy from the same weights, each one's own code run one after another on this machine.

Systems, each a process timed from outside from its start (installs excluded):

- ``speedrun``: `speedrun train folder --init WEIGHTS` (the folder recipe's fine-tuning choices),
  with ``--speedrun-set`` fields added;
- ``fastai``: fastai's ``vision_learner(dls, ARCH, pretrained=False)`` with the weights loaded into
  its body and ``fine_tune`` with fastai's defaults (one frozen epoch, then the rest unfrozen), or
  with ``lr_find``'s suggestion (``fastai-lr-find``), run by benchmarks/peer_fastai_finetune.py
  under ``--fastai-python`` (an interpreter with fastai installed);
- ``timm``: timm's ``train.py`` (a copy fetched from timm's repository: ``--timm-train``) under
  ``--timm-python``, fine-tuning with ``--pretrained --pretrained-path WEIGHTS`` and the flags in
  TIMM_FLAGS.

Every system trains on ``train/`` of each ``--folder`` and reports its accuracy on ``val/`` after
every epoch; the time of a report is when its line reached this script. A run's
``seconds_to_target`` is the time of its first report at or above the target; the target is
``--target``, else the highest accuracy every run of every system reached (the lowest of the runs'
best reports). Per folder and architecture the record holds speedrun's mean over the faster peer's,
the accuracy each run had reached when speedrun's runs had ended, on average (the accuracy in the
same time), and Welch's one-sided t-tests of speedrun's mean time against the faster peer's, and against half
of it (``--from-record OLD`` works these out again from an earlier record's runs, running
nothing). Each folder, architecture and seed runs every system in turn, so that drift in the
machine hits all alike. A peer that is not given, or whose interpreter lacks its package, is left
out and the record says why.

    .venv-2.14/bin/python benchmarks/finetune_peers.py --folder imagenette=/data/imagenette \\
        --weights resnet18=/work/pre/resnet18.safetensors --seeds 3 --epochs 5 \\
        --fastai-python /work/venv-fastai/bin/python --timm-python /work/venv-fastai/bin/python \\
        --timm-train /work/peers/timm/train.py --out benchmarks/results/finetune-peers-CPU-COMMIT.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from speedrun.errors import SpeedrunError
from speedrun.files import atomic_write_json, check_output_file
from speedrun.report.environment import machine

HERE = Path(__file__).resolve().parent
FASTAI_RUNNER = HERE / "peer_fastai_finetune.py"
SYSTEMS = ("speedrun", "fastai", "fastai-lr-find", "timm")
TIMM_FLAGS = ["--opt", "adamw", "--lr", "1e-3", "--weight-decay", "0.05", "--sched", "cosine", "--warmup-epochs", "1",
              "--layer-decay", "0.75", "--smoothing", "0.1", "--no-prefetcher", "--log-interval", "100000",
              "--checkpoint-hist", "1"]
"""timm train.py's fine-tuning flags here: AdamW at 1e-3 with decay 0.05, layer-wise LR decay 0.75,
a one-epoch warm-up into a cosine decay, label smoothing 0.1 (its default), no CUDA prefetcher."""

SPEEDRUN_EPOCH = re.compile(r" epoch (\d+)/\d+ done: .* test acc ([0-9.]+)")
TIMM_TEST = re.compile(r"^.*Test: \[\s*(\d+)/(\d+)\].*Acc@1:\s*[0-9.]+\s*\(\s*([0-9.]+)\)")


def parse_report(system: str, line: str) -> float | None:
    """The held-out accuracy (0..1) a line of ``system``'s output reports after an epoch, or None."""
    if system == "speedrun":
        m = SPEEDRUN_EPOCH.search(line)
        return float(m.group(2)) if m else None
    if system.startswith("fastai"):
        if line.startswith("{") and '"valid_accuracy"' in line:
            return float(json.loads(line)["valid_accuracy"])
        return None
    m = TIMM_TEST.match(line)                      # its last batch's line holds the epoch's mean
    return float(m.group(3)) / 100 if m and m.group(1) == m.group(2) else None


def timed(cmd: list[str], system: str, log: Path, cwd: Path, timeout: float) -> dict:
    """Run ``cmd``, keeping its output in ``log``; each accuracy report with the seconds since the
    process started. At ``timeout`` seconds the process and the ones it started are killed, whether
    or not it is printing (``timed_out`` in the result)."""
    t0 = time.perf_counter()
    reports = []
    stopped = threading.Event()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

        def stop():
            stopped.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            for line in proc.stdout:
                now = time.perf_counter() - t0
                out.write(line)
                acc = parse_report(system, line)
                if acc is not None:
                    reports.append({"seconds": now, "accuracy": acc})
        finally:
            timer.cancel()
        rc = proc.wait()
    return {"rc": rc, "wall_seconds": time.perf_counter() - t0, "timed_out": stopped.is_set(), "reports": reports,
            "log": str(log)}


SPEEDRUN_TIMES = ("start_up_seconds", "train_seconds", "monitor_seconds", "final_eval_seconds", "compile_seconds",
                  "wall_seconds", "test_acc", "epochs")


def speedrun_times(out: Path) -> dict | None:
    """A speedrun run's own split of its time (start-up: process start to the training clock), from
    its summary.json; None where the run wrote none."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return {k: summary.get(k) for k in SPEEDRUN_TIMES}


def peer_python(kind: str, python: str | None, module: str) -> tuple[str | None, str | None]:
    """(its version, None) where ``python`` imports ``module``; else (None, why it is left out)."""
    if not python:
        return None, f"no --{kind}-python given"
    proc = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True, text=True)
    if proc.returncode:
        return None, f"{python} cannot import {module} (pip install {module} into it)"
    return proc.stdout.strip(), None


def command(system: str, args, folder: Path, arch: str, weights: str, seed: int, out: Path) -> list[str]:
    """The process that fine-tunes ``weights`` (a file of ``arch``, or a speedrun run) on ``folder``."""
    if system == "speedrun":
        init = weights if Path(weights).is_dir() else f"timm:{arch}={weights}"
        sets = [f"train.epochs={args.epochs}", f"data.image_size={args.image_size}",
                f"data.batch_size={args.batch_size}", *args.speedrun_set]
        return [args.speedrun_python, "-m", "speedrun", "train", "folder", "--data-dir", str(folder), "--init", init,
                "--seed", str(seed), "--device", "cpu", "--out", str(out), *sum((["--set", s] for s in sets), [])]
    if system.startswith("fastai"):
        return [args.fastai_python, str(FASTAI_RUNNER), "--data", str(folder), "--arch", arch, "--weights", weights,
                "--epochs", str(args.epochs), "--size", str(args.image_size), "--bs", str(args.batch_size),
                "--seed", str(seed), *(["--lr-find"] if system == "fastai-lr-find" else [])]
    classes = len([p for p in (folder / "train").iterdir() if p.is_dir()])
    return [args.timm_python, args.timm_train, "--data-dir", str(folder), "--train-split", "train", "--val-split", "val",
            "--model", arch, "--pretrained", "--pretrained-path", weights, "--num-classes", str(classes),
            "--img-size", str(args.image_size), "--epochs", str(args.epochs), "-b", str(args.batch_size),
            "--workers", "1", "--device", "cpu", "--seed", str(seed), "--output", str(out.parent),
            "--experiment", out.name, *TIMM_FLAGS]


def best(run: dict) -> float:
    return max((r["accuracy"] for r in run["reports"]), default=0.0)


def seconds_to(run: dict, target: float) -> float | None:
    return next((r["seconds"] for r in run["reports"] if r["accuracy"] >= target), None)


def accuracy_by(run: dict, seconds: float) -> float | None:
    """The best accuracy ``run`` reported within ``seconds`` of its start; None if it reported none by then."""
    return max((r["accuracy"] for r in run["reports"] if r["seconds"] <= seconds), default=None)


def summarise(runs: list[dict], systems: list[str], target: float | None) -> dict:
    """Per folder and architecture: the target, each system's seconds_to_target (every run),
    speedrun's mean over the faster peer's mean, and the accuracy each run reached by the time
    speedrun's runs made their last report, on average (accuracy_by_speedruns_time)."""
    out = {}
    for key in sorted({(r["folder"], r["arch"]) for r in runs}):
        group = [r for r in runs if (r["folder"], r["arch"]) == key and r["rc"] == 0]
        goal = target if target is not None else min((best(r) for r in group), default=None)
        row = {"target": goal, "target_rule": "--target" if target is not None else
               "the highest accuracy every run reached (the lowest of the runs' best reports)", "systems": {}}
        for s in systems:
            mine = [r for r in group if r["system"] == s]
            times = [seconds_to(r, goal) for r in mine] if goal is not None else []
            row["systems"][s] = {"seconds_to_target": times, "best_accuracy": [best(r) for r in mine],
                                 "wall_seconds": [r["wall_seconds"] for r in mine],
                                 "mean_seconds_to_target": statistics.mean(times) if times and None not in times else None}
        budget = [r["reports"][-1]["seconds"] for r in group if r["system"] == "speedrun" and r["reports"]]
        if budget:                                  # the accuracy each system reached in speedrun's time
            row["speedrun_mean_seconds_to_last_report"] = statistics.mean(budget)
            for s in systems:
                row["systems"][s]["accuracy_by_speedruns_time"] = [
                    accuracy_by(r, row["speedrun_mean_seconds_to_last_report"]) for r in group if r["system"] == s]
        means = {s: v["mean_seconds_to_target"] for s, v in row["systems"].items()}
        peers = [m for s, m in means.items() if s != "speedrun" and m is not None]
        row["faster_peer_mean_seconds"] = min(peers) if peers else None
        row["ratio_to_faster_peer"] = (means.get("speedrun") / min(peers)) if peers and means.get("speedrun") else None
        faster = min((s for s, m in means.items() if s != "speedrun" and m is not None), key=means.get, default=None)
        if faster and means.get("speedrun"):
            row["one_sided_tests"] = one_sided_tests(row["systems"]["speedrun"]["seconds_to_target"],
                                                     row["systems"][faster]["seconds_to_target"], faster)
        out[f"{key[0]}/{key[1]}"] = row
    return out


GOAL = 0.5
"""speedrun's mean time to the target over the faster peer's that the comparison is to reach."""


def one_sided_tests(mine: list[float], peer: list[float], name: str) -> dict:
    """Welch's one-sided t-tests (unequal variances) of speedrun's mean time to the target against
    the faster peer's: below it, and below GOAL times it. A p-value under 0.05 is evidence for that
    claim; a larger one is not evidence against it (3 runs a side can show little)."""
    from scipy import stats
    out = {"faster_peer": name, "method": "Welch's t-test, one-sided (H1: speedrun's mean time is below the bound)",
           "runs": [len(mine), len(peer)]}
    for label, factor in (("below_peer", 1.0), (f"below_{GOAL:g}_of_peer", GOAL)):
        bound = [factor * t for t in peer]
        if len(mine) < 2 or len(peer) < 2:
            out[label] = {"bound_mean_seconds": statistics.mean(bound), "p": None}
            continue
        res = stats.ttest_ind(mine, bound, equal_var=False, alternative="less")
        out[label] = {"bound_mean_seconds": statistics.mean(bound), "t": float(res.statistic), "p": float(res.pvalue)}
    return out


def summarised_again(args, ap) -> int:
    """--from-record: the results of an earlier record's runs worked out by this script's code, into --out."""
    try:
        old = json.loads(Path(args.from_record).read_text())
        runs, systems = old["runs"], old["systems"]
    except (OSError, ValueError, KeyError) as err:
        ap.error(f"--from-record {args.from_record}: not a finetune_peers record ({err})")
    record = {**old, "results": summarise(runs, systems, args.target), "summarised_from": str(args.from_record),
              "summarised_by": machine()["git_commit"]}
    atomic_write_json(args.out, record)
    for key, row in record["results"].items():
        print(f"{key}: target {row['target']}, ratio to the faster peer {row['ratio_to_faster_peer']}, "
              f"one-sided tests {json.dumps(row.get('one_sided_tests'))}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", action="append", help="NAME=DIR with train/ and val/ (repeatable; required)")
    ap.add_argument("--weights", action="append",
                    help="ARCH=FILE: timm's ARCH's weights (a state dict), or ARCH=RUN, a speedrun run (repeatable; required)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=5, help="epochs every system trains")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--target", type=float, help="held-out accuracy to time to (default: the highest all runs reach)")
    ap.add_argument("--speedrun-python", default=sys.executable)
    ap.add_argument("--speedrun-set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--fastai-python")
    ap.add_argument("--timm-python")
    ap.add_argument("--timm-train", help="timm's train.py, from a copy of timm's repository")
    ap.add_argument("--timeout", type=float, default=3600,
                    help="seconds after which a run is killed, with the processes it started (timed_out in its row)")
    ap.add_argument("--work", help="folder for the runs and their logs (required)")
    ap.add_argument("--out", required=True, help="the JSON record to write")
    ap.add_argument("--from-record", metavar="RECORD",
                    help="run nothing: work out RECORD's results again (target, ratio, one-sided tests) into --out")
    args = ap.parse_args(argv)
    if not args.timeout > 0:
        ap.error(f"--timeout {args.timeout:g}: seconds above 0")
    try:
        check_output_file(args.out)
    except SpeedrunError as err:                    # (a record that exists, a folder that cannot hold it)
        ap.error(str(err))
    if args.from_record:
        return summarised_again(args, ap)
    missing = [f"--{name}" for name in ("folder", "weights", "work") if not getattr(args, name)]
    if missing:
        ap.error(f"{', '.join(missing)} required (or --from-record)")
    folders = dict(f.split("=", 1) for f in args.folder if "=" in f)
    weights = dict(w.split("=", 1) for w in args.weights if "=" in w)
    if len(folders) != len(args.folder) or len(weights) != len(args.weights):
        ap.error("--folder and --weights take NAME=PATH")
    for name, d in folders.items():
        if not (Path(d) / "train").is_dir() or not (Path(d) / "val").is_dir():
            ap.error(f"--folder {name}={d}: needs train/ and val/ folders of classes")
    for arch, w in weights.items():
        if not Path(w).exists():
            ap.error(f"--weights {arch}={w}: no such file or folder")
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"--systems: unknown {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    left_out = {}
    fastai_version, why = peer_python("fastai", args.fastai_python, "fastai")
    for s in ("fastai", "fastai-lr-find"):
        if s in systems and why:
            left_out[s] = why
    timm_version, why = peer_python("timm", args.timm_python, "timm")
    if "timm" in systems:
        why = why or (None if args.timm_train and Path(args.timm_train).is_file() else
                      "no --timm-train given (timm's train.py, from a copy of timm's repository)")
        if why:
            left_out["timm"] = why
    versions = {"fastai_version": fastai_version, "timm_version": timm_version}
    for s, why in left_out.items():
        print(f"finetune_peers.py: {s} left out: {why}", flush=True)
    systems = [s for s in systems if s not in left_out]
    env = machine()                                 # (the commit as it is when the runs start)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for fname, fdir in folders.items():
        for arch, w in weights.items():
            for seed in range(args.seeds):
                for s in systems:
                    out = work / f"{fname}-{arch}-{s}-seed{seed}"
                    if out.exists():
                        ap.error(f"{out} exists: give another --work or remove it")
                    cmd = command(s, args, Path(fdir).resolve(), arch, str(Path(w).resolve()), seed, out)
                    run = {"system": s, "folder": fname, "arch": arch, "seed": seed, "command": cmd,
                           **timed(cmd, s, work / f"{out.name}.log", work, args.timeout)}
                    if s == "speedrun":                 # where its time went, from its own summary
                        run["speedrun_summary"] = speedrun_times(out)
                    runs.append(run)
                    print(f"{fname} {arch} {s} seed {seed}: exit {run['rc']}, best {best(run):.4f}, "
                          f"{run['wall_seconds']:.1f} s", flush=True)
    record = {"benchmark": "finetune_peers", "what": __doc__.split("\n\n")[0], "systems": systems,
              "left_out": left_out, **versions, "epochs": args.epochs, "image_size": args.image_size,
              "batch_size": args.batch_size, "timm_flags": TIMM_FLAGS, "speedrun_set": args.speedrun_set,
              "timed": "each process from its start; a report's time is when its line reached the harness",
              "folders": folders, "weights": weights, "results": summarise(runs, systems, args.target),
              "runs": runs, "environment": env}
    atomic_write_json(args.out, record)
    for key, row in record["results"].items():
        ratio = row["ratio_to_faster_peer"]
        print(f"{key}: target {row['target']}, " + ", ".join(
            f"{s} {v['mean_seconds_to_target']}" for s, v in row["systems"].items())
            + (f"; speedrun / faster peer {ratio:.2f}" if ratio and math.isfinite(ratio) else ""), flush=True)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
