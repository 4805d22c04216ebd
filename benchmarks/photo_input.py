"""A folder of photos on a few CPU cores: decode once to a cache, or stream every epoch?

Measures on one folder (e.g. the Imagenette copy, see benchmarks/README.md), one after the
other in one session:

1. decode: `speedrun data prepare` of the whole folder at the evaluation size (every core),
   images/s;
2. the input pipelines alone, no training: batches of random-resized crops at the training size,
   streamed (DataLoader workers decode and crop each image, DCT-scaled JPEG decoding) and from
   the cache (crops cut on whole batches), images/s;
3. training: `--epochs` (default one) of `speedrun train RECIPE` at full training size with each pipeline
   (`data.cache=on` / `off`), from its metrics (seconds of the epoch), images/s; the workers of
   the streamed run share the cores with training.

Usage: .venv/bin/python benchmarks/photo_input.py DIR --out benchmarks/results/photo-input-....json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from speedrun.data.augment.batch import BatchAugment
from speedrun.data.pipeline.dataset import open_pipeline
from speedrun.data.prepare import prepare
from speedrun.engine.plan import plan_run
from speedrun.files import atomic_write_json
from speedrun.recipe import load_recipe
from speedrun.report.environment import environment


def pipeline_rate(recipe, data_dir, batches: int) -> float:
    plan = plan_run(recipe, data_dir, torch.device("cpu"), fit_batch=False)
    recipe, source, rt = plan.recipe, plan.source, plan.runtime
    data = open_pipeline(source, recipe, rt, 0)
    gen = torch.Generator().manual_seed(0)
    aug = BatchAugment(recipe.augment, data.n_train, data.image_size, gen, rt.device, data.mean, data.std,
                       resized_crop=not data.crops_in_workers, input_size=getattr(data, "stored_size", None))
    it = data.epoch(0, recipe.data.batch_size, aug, gen)
    next(it)                                                    # workers started, first batch out
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        x, _ = next(it)
        n += x.shape[0]
    return n / (time.perf_counter() - t0)


def train_epoch(recipe: str, data_dir: str, cache: str, tmp: Path, size: int, epochs: float) -> dict:
    out = tmp / f"train-{cache}"
    cmd = [sys.executable, "-m", "speedrun", "train", recipe, "--data-dir", data_dir, "--out", str(out),
           "--set", f"train.epochs={epochs}", "--set", f"data.cache={cache}", "--set", "data.progressive=[[0.0, 1.0]]",
           "--set", "eval.every=0"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    images = summary["steps"] * summary["batch_size"]
    epoch_s = summary["train_seconds"] - summary["final_eval_seconds"]
    return {"cache": cache, "train_size": size, "images": images, "epoch_seconds": epoch_s,
            "images_per_s": images / epoch_s, "final_eval_seconds": summary["final_eval_seconds"],
            "process_wall_seconds": wall, "test_acc": summary["test_acc"], "metrics": rows,
            "data_cache": summary.get("data_cache")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--recipe", default="imagenette")
    p.add_argument("--batches", type=int, default=15)
    p.add_argument("--no-training", action="store_true")
    p.add_argument("--order", default="on,off", help="order of the training runs")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs of each timed training run")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    env = environment()      # (the commit that runs, read before it runs)
    base = load_recipe(args.recipe)
    size, evaluate = base.data.image_size, base.data.eval_size
    record = {"benchmark": "photo folder input: decode once vs stream", "folder": args.folder,
              "recipe": args.recipe, "train_size": size, "eval_size": evaluate}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["SPEEDRUN_CACHE"] = str(tmp / "cache")
        t0 = time.perf_counter()
        made = prepare(args.folder, evaluate, tmp / "decoded.npz")
        seconds = time.perf_counter() - t0
        n = made["train"] + made["test"]
        record["decode"] = {"images": n, "seconds": seconds, "images_per_s": n / seconds, "size": evaluate,
                            "workers": os.cpu_count()}
        print(f"decode once at {evaluate} px: {n / seconds:.0f} images/s ({seconds:.1f} s)")
        rates = {}
        for cache in ("off", "on"):
            r = load_recipe(args.recipe, [f"data.cache={cache}", "data.progressive=[[0.0, 1.0]]"])
            rates[cache] = pipeline_rate(r, args.folder, args.batches)
            print(f"pipeline alone, cache {cache}: {rates[cache]:.0f} images/s of {size} px crops")
        record["pipeline_images_per_s"] = {"streamed": rates["off"], "cached": rates["on"]}
        if not args.no_training:
            record["training"] = []
            for cache in args.order.split(","):
                row = train_epoch(args.recipe, args.folder, cache, tmp, size, args.epochs)
                record["training"].append(row)
                print(f"training {args.epochs:g} epoch(s) at {size} px, cache {cache}: {row['images_per_s']:.1f} images/s "
                      f"({row['epoch_seconds']:.1f} s)")
    record["environment"] = env
    atomic_write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
