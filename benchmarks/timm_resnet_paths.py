"""timm's ResNet-18 weights two ways: converted to speedrun's own ResNet (what ``model.init =
timm:resnet18=FILE`` does) or loaded into timm's own network by timm's loader (what it does for
every other architecture), on this machine.

Two things are timed, each way:

- **loading**: from the weights file to a model for 10 classes with the weights in it (reading the
  file, checking it is timm's resnet18, converting or adapting it, building the network, loading):
  ``open_weights`` + ``build_model`` + ``apply_weights`` for speedrun's ResNet; the same file opened
  as timm's network and loaded by timm's ``load_pretrained`` for timm's. The median of ``--repeats``
  (each in this process, after one untimed round that imports everything).
- **the first epoch**: ``speedrun train`` of the same network from random weights, speedrun's
  ResNet-18 (``model.name = "resnet"``, depth 18, variant a: torchvision's and timm's resnet18) and
  timm's (``model.name = "timm"``, ``model.arch = "resnet18"``), one process each, interleaved
  ``--runs`` times, on CIFAR-10's first ``--images`` training images at 32 px (an .npz made from
  $SPEEDRUN_DATA), batch 64, the device's default precision: the first epoch's seconds from
  ``metrics.jsonl`` and the whole process.

    .venv-2.14/bin/python benchmarks/timm_resnet_paths.py --work /tmp/paths \\
        --out benchmarks/results/timm-resnet18-paths-CPU-COMMIT.json

Needs timm (``.venv-2.14``).
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

import numpy as np
import torch

from speedrun.files import atomic_write_json, check_output_file
from speedrun.report.environment import machine

RECIPE = """name = "resnet18-paths"
target = 0.5
[data]
dataset = "npz"
batch_size = 64
[augment]
flip = "random"
crop = "translate"
translate = 2
[optim]
lr = 4.0
ref_batch = 256
[schedule]
kind = "piecewise"
knots = [0.0, 0.2, 1.0]
values = [0.2, 1.0, 0.0]
[train]
epochs = 1
[eval]
every = 0
batch_size = 256
"""
MODELS = {"speedrun": ["--set", "model={name='resnet', depth=18, variant='a'}"],
          "timm": ["--set", "model={name='timm', arch='resnet18'}"]}


def loading_seconds(path: Path, way: str) -> float:
    """Seconds from the file to a 10-class model holding its weights, one way."""
    from speedrun.models import build_model, pretrained, published_weights, timm_models
    from speedrun.recipe import ResNetConfig, TimmConfig
    t0 = time.perf_counter()
    if way == "speedrun":
        pre = pretrained.open_weights(f"timm:resnet18={path}")
        model = build_model(ResNetConfig(**pre.model), 3, 10)
        pretrained.apply_weights(model, pre, 3, 10)
    else:
        timm = published_weights.import_timm("timm:resnet18")
        net = published_weights.timm_model(timm, "resnet18")
        net.load_state_dict(pretrained.read_weights_file(path))
        pre = pretrained._timm_network(f"timm:resnet18={path}", "resnet18", net, path,
                                       published_weights.timm_preprocessing(net))
        cfg = TimmConfig(arch="resnet18")
        timm_models._adapted.clear()                 # (made afresh each time, as in a new process)
        model = build_model(cfg, 3, 10)
        pretrained.apply_weights(model, pre, 3, 10, None, cfg)
    return time.perf_counter() - t0


def first_epoch(work: Path, way: str, run: int, data: Path) -> dict:
    out = work / f"run-{way}-{run}"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "speedrun", "train", str(work / "recipe.toml"), "--data-dir", str(data),
                           "--device", "cpu", "--out", str(out), *MODELS[way]], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{way} run {run} failed:\n{proc.stderr[-2000:]}")
    epoch = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    summary = json.loads((out / "summary.json").read_text())
    return {"way": way, "run": run, "first_epoch_seconds": epoch["seconds"], "process_seconds": wall,
            "precision": summary.get("precision"), "test_acc": summary.get("test_acc")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--images", type=int, default=2048)
    args = ap.parse_args(argv)
    check_output_file(args.out, "--out", 1 << 20)
    env = machine()
    import timm
    from speedrun.data import load_dataset
    args.work.mkdir(parents=True, exist_ok=True)
    weights = args.work / "resnet18.pth"
    torch.manual_seed(0)
    torch.save(timm.create_model("resnet18", pretrained=False).state_dict(), weights)
    data = args.work / "cifar.npz"
    ds = load_dataset("cifar10", os.environ.get("SPEEDRUN_DATA"), fetch=False)
    np.savez(data, x_train=ds.train_x[:args.images].numpy(), y_train=ds.train_y[:args.images].numpy(),
             x_test=ds.test_x[:512].numpy(), y_test=ds.test_y[:512].numpy(), classes=np.array(ds.classes))
    (args.work / "recipe.toml").write_text(RECIPE, encoding="utf-8")

    for way in MODELS:                                   # (imports and first calls, untimed)
        loading_seconds(weights, way)
    loads = {way: [] for way in MODELS}
    for _ in range(args.repeats):
        for way in MODELS:
            loads[way].append(loading_seconds(weights, way))
    runs = [first_epoch(args.work, way, i, data) for i in range(args.runs) for way in MODELS]
    results = {}
    for way in MODELS:
        mine = [r for r in runs if r["way"] == way]
        results[way] = {"loading_seconds_median": statistics.median(loads[way]), "loading_seconds": loads[way],
                        "first_epoch_seconds_median": statistics.median(r["first_epoch_seconds"] for r in mine),
                        "process_seconds_median": statistics.median(r["process_seconds"] for r in mine)}
    record = {"benchmark": "timm_resnet_paths",
              "what": (f"timm's resnet18 weights converted to speedrun's ResNet-18 or loaded into timm's own network: "
                       f"seconds from the file to a 10-class model holding them (median of {args.repeats}), and the "
                       f"first epoch of `speedrun train` of each network ({args.images} CIFAR-10 images at 32 px, "
                       f"batch 64, {args.runs} runs each, interleaved)"),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else " ".join(argv),
              "timm_version": timm.__version__, "results": results, "runs": runs, "machine": env}
    atomic_write_json(args.out, record)
    for way, r in results.items():
        print(f"{way}: loading {r['loading_seconds_median']:.3f} s, first epoch {r['first_epoch_seconds_median']:.2f} s, "
              f"process {r['process_seconds_median']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
