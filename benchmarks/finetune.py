"""Time to a target on a folder of photos: fine-tuning weights trained on other images against
training from scratch, on this machine.

The weights are speedrun's own, trained on five classes of CIFAR-10 (airplane, automobile, bird,
cat, deer: 25,000 images); the folder is the other five (dog, frog, horse, ship, truck), 1,000
training images per class and the 5,000 test images of those classes as val/, so the weights
never saw an image of the folder, nor one of its classes. Every system is one `speedrun train`
process per seed, timed from outside:

- ``scratch``: `speedrun train folder` (the speed net from random weights, its 10 epochs); the
  mean of its final test accuracies (with its test-time augmentation) is the target;
- ``finetune``: `speedrun train folder --set model.init=PRETRAINED` (the folder recipe's
  fine-tuning choices);
- ``fastai``: the same weights under fastai's ``fine_tune`` shape written in speedrun's fields
  (one epoch of the classifier alone, then the whole network with learning rates from lr/100
  to lr, one-cycle; speedrun's SGD, not fastai's Adam);
- ``timm``: the same weights as timm's ``train.py`` fine-tunes (no frozen phase, layer-wise LR
  decay 0.75 per block, cosine schedule after a one-epoch linear warm-up; SGD, not AdamW).

The fine-tuning systems run as a user who wants the target would: ``train.stop_at_target`` with
the target, which checks a validation split held out of the folder's training images (10%) after
each epoch and stops there, then evaluates the test set. A run's time to the target is its
training clock (``train_seconds``: the checks and the final evaluation included, the per-epoch
monitoring of the test set excluded), counted where its final test accuracy reached the target;
the scratch runs' time is their whole training clock. The whole process's wall time is kept too.
Every run is in the record.

    .venv/bin/python benchmarks/finetune.py --work /work/finetune --seeds 3 \\
        --out benchmarks/results/finetune-cifar5-CPU-COMMIT.json [--systems scratch,finetune,...]

``--work`` holds the folders (exported from $SPEEDRUN_DATA's CIFAR-10 on first use), the
pretrained run (trained on first use: ``--pretrain-epochs``) and the runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from speedrun.errors import SpeedrunError
from speedrun.files import atomic_write_json, check_output_file
from speedrun.report.environment import machine

PRETRAIN_CLASSES = ("airplane", "automobile", "bird", "cat", "deer")
TARGET_CLASSES = ("dog", "frog", "horse", "ship", "truck")

TUNED = ["--set", "model.init={weights}", "--set", "train.stop_at_target=true", "--set", "target={target}"]
SYSTEMS = {
    "scratch": [],
    "finetune": TUNED,
    "fastai": TUNED + ["--set", "finetune.head_epochs=1", "--set", "finetune.lr_first=0.01",
                       "--set", "schedule={{kind='onecycle', peak_at=0.3, start=0.2, end=0.0}}"],
    "timm": TUNED + ["--set", "finetune.head_epochs=0", "--set", "finetune.lr_first=0.1335",      # 0.75 ** 7 blocks
                     "--set", "schedule={{kind='cosine', warmup_epochs=1, warmup_start=0.01, end=0.0}}"],
}


def speedrun(*args: str, env: dict | None = None) -> float:
    """``speedrun ARGS`` in a process; its wall seconds (a failure ends the script with its output)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "speedrun", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"speedrun {' '.join(args)} failed ({proc.returncode})")
    return wall


def split_folder(exported: Path, out: Path, classes: tuple[str, ...], per_class: int | None) -> Path:
    """``out`` with train/ and val/ holding only ``classes`` of the exported CIFAR-10 folder (hard
    links; the first ``per_class`` training images of each, by index, or all)."""
    if (out / "val").is_dir():
        return out
    tmp = out.with_name(out.name + ".tmp")
    for split, n in (("train", per_class), ("val", None)):
        for c in classes:
            files = sorted((exported / split / c).iterdir(), key=lambda p: int(p.stem))[:n]
            (tmp / split / c).mkdir(parents=True, exist_ok=True)
            for f in files:
                os.link(f, tmp / split / c / f.name)
    tmp.rename(out)
    return out


def prepare(work: Path, data_dir: str | None, per_class: int, pretrain_epochs: float) -> tuple[Path, Path]:
    """(the target folder, the pretrained run folder), made in ``work`` where missing."""
    exported = work / "cifar10-png"
    if not (exported / "val").is_dir():
        speedrun("data", "export", "cifar10", "--format", "png", "--out", str(exported),
                 *(["--data-dir", data_dir] if data_dir else []))
    source = split_folder(exported, work / "cifar5-pretrain", PRETRAIN_CLASSES, None)
    target = split_folder(exported, work / f"cifar5-target-{per_class}", TARGET_CLASSES, per_class)
    pretrained = work / "pretrained"
    if not (pretrained / "model.pt").is_file():
        speedrun("train", "folder", "--data-dir", str(source), "--out", str(pretrained),
                 "--set", f"train.epochs={pretrain_epochs}")
    return target, pretrained


def read_run(folder: Path) -> dict:
    """A finished run's summary and its epochs (test accuracy and training clock after each)."""
    summary = json.loads((folder / "summary.json").read_text())
    epochs = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epochs = [e for e in epochs if e.get("kind", "epoch") == "epoch" and "test_acc" in e]
    return {"summary": summary, "epochs": epochs}


def time_to(run: dict, target: float) -> float | None:
    """Seconds of the run's training clock to its final accuracy, where that reached ``target``."""
    s = run["summary"]
    return s["train_seconds"] if s["test_acc"] >= target else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="folder for the data, the pretrained run and the runs")
    ap.add_argument("--data-dir", default=os.environ.get("SPEEDRUN_DATA"), help="where CIFAR-10 is")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--per-class", type=int, default=1000, help="training images per class of the target folder")
    ap.add_argument("--pretrain-epochs", type=float, default=16)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", required=True, help="the JSON record to write")
    args = ap.parse_args(argv)
    try:
        check_output_file(args.out)
        systems = args.systems.split(",")
        unknown = [s for s in systems if s not in SYSTEMS]
        if unknown or "scratch" not in systems:
            raise SystemExit(f"--systems: {unknown or 'scratch is needed (it sets the target)'}; known: {', '.join(SYSTEMS)}")
        work = Path(args.work).resolve()
        work.mkdir(parents=True, exist_ok=True)
        target_dir, pretrained = prepare(work, args.data_dir, args.per_class, args.pretrain_epochs)
        runs = {s: [] for s in systems}
        target = None

        def one(system: str, seed: int) -> None:
            folder = work / "runs" / f"{system}-seed{seed}"
            if folder.exists():
                raise SystemExit(f"{folder} exists: give another --work or remove it")
            extra = [a.format(weights=pretrained, target=target) for a in SYSTEMS[system]]
            wall = speedrun("train", "folder", "--data-dir", str(target_dir), "--seed", str(seed),
                            "--out", str(folder), *extra)
            run = {"seed": seed, "wall_seconds": wall, "command": extra, **read_run(folder)}
            runs[system].append(run)
            stop = run["summary"].get("stop_at_target") or {}
            print(f"{system} seed {seed}: {run['summary']['test_acc']:.4f} in {run['summary']['train_seconds']:.1f} s "
                  f"({wall:.1f} s wall){'; stopped at ' + str(stop['reached']) if stop.get('reached') else ''}",
                  flush=True)
        for seed in range(args.seeds):                  # the target first
            one("scratch", seed)
        target = round(statistics.mean(r["summary"]["test_acc"] for r in runs["scratch"]), 4)
        for seed in range(args.seeds):                  # interleaved, so drift in the machine hits all alike
            for system in systems:
                if system != "scratch":
                    one(system, seed)
        scratch_seconds = statistics.mean(r["summary"]["train_seconds"] for r in runs["scratch"])
        results = {}
        for system, rs in runs.items():
            times = [time_to(r, target) for r in rs]
            reached = [t for t in times if t is not None]
            results[system] = {
                "final_test_acc": [r["summary"]["test_acc"] for r in rs],
                "mean_final_test_acc": statistics.mean(r["summary"]["test_acc"] for r in rs),
                "train_seconds": [r["summary"]["train_seconds"] for r in rs],
                "wall_seconds": [r["wall_seconds"] for r in rs],
                "seconds_to_target": times,
                "runs_reaching_target": len(reached),
                "mean_seconds_to_target": statistics.mean(reached) if len(reached) == len(rs) else None,
                "ratio_to_scratch": (statistics.mean(reached) / scratch_seconds) if len(reached) == len(rs) else None,
            }
            print(f"{system}: {results[system]}", flush=True)
        record = {"benchmark": "finetune", "what": __doc__.split("\n\n")[0], "target": target,
                  "target_rule": "mean final test accuracy (with TTA) of the scratch runs",
                  "timed": "each run's training clock (summary train_seconds: first touch of the data to the final "
                           "accuracy, the stop-at-target checks and the final evaluation included, monitoring "
                           "evaluations excluded), counted where its final test accuracy reached the target; "
                           "wall_seconds: the whole process",
                  "pretrained": {"folder": str(pretrained), "classes": PRETRAIN_CLASSES,
                                 "summary": json.loads((pretrained / "summary.json").read_text())},
                  "target_folder": {"classes": TARGET_CLASSES, "train_per_class": args.per_class},
                  "results": results, "runs": runs, "machine": machine()}
        atomic_write_json(args.out, record)
        return 0
    except SpeedrunError as err:
        print(f"finetune.py: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
