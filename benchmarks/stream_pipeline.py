"""Throughput of the streamed input pipeline against a plain per-sample Pillow pipeline.

Both read the same JPEG folder with DataLoader workers on this machine's cores and produce
augmented, normalised float batches (random crop with 4-pixel reflect padding and a random
flip; or random-resized crops), in one process, one after the other:

- speedrun: workers decode (simplejpeg, or Pillow) to uint8 and collate uint8 batches; the
  normalising, padding, cropping and flipping are done on whole batches ("device" = CPU here).
- plain: each worker opens the file with Pillow, pads, crops and flips it, converts it to a
  float tensor and normalises it, sample by sample (the usual torchvision-style pipeline,
  written here with Pillow and numpy since torchvision is not installed).

Usage: .venv/bin/python benchmarks/stream_pipeline.py DIR --out benchmarks/results/stream-pipeline-cpu.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset

from speedrun.data.augment.batch import BatchAugment, reflect_pad
from speedrun.data.sources.folder import folder_splits
from speedrun.data.pipeline.stream import Decoding, EpochSampler, ImageItems, collate, worker_context
from speedrun.recipe import AugmentConfig
from speedrun.report.environment import environment
from speedrun.files import atomic_write_json

MEAN = np.array([125.3, 123.0, 113.9], dtype=np.float32)
STD = np.array([63.0, 62.1, 66.7], dtype=np.float32)


class PlainItems(Dataset):
    """The per-sample baseline: decode, augment, convert and normalise each image alone."""

    def __init__(self, images, size, crop, seed=0):
        self.images, self.size, self.crop, self.rng = images, size, crop, np.random.default_rng(seed)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = Image.open(self.images.path(i)).convert("RGB")
        if self.crop == "translate":
            img = ImageOps.expand(img, border=4)
            x, y = self.rng.integers(0, 9, 2)
            img = img.crop((x, y, x + self.size, y + self.size))
        else:
            w, h = img.size
            area = w * h * self.rng.uniform(0.35, 1.0)
            ratio = np.exp(self.rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            cw, ch = min(w, int(round(np.sqrt(area * ratio)))), min(h, int(round(np.sqrt(area / ratio))))
            x, y = self.rng.integers(0, w - cw + 1), self.rng.integers(0, h - ch + 1)
            img = img.resize((self.size, self.size), Image.BILINEAR, box=(x, y, x + cw, y + ch))
        if self.rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        arr = (np.asarray(img, dtype=np.float32) - MEAN) / STD
        return torch.from_numpy(arr.transpose(2, 0, 1).copy()), int(self.images.labels[i])


def time_loader(batches, n_batches: int) -> float:
    """Images per second over ``n_batches`` batches after the first (worker start-up) one."""
    it = iter(batches)
    next(it)
    t0, n = time.perf_counter(), 0
    for _ in range(n_batches):
        x = next(it)
        n += len(x)
    return n / (time.perf_counter() - t0)


def speedrun_batches(images, size, crop, decoder, workers, batch):
    items = ImageItems(images, Decoding(3, True, "random_resized" if crop == "rrc" else "translate", (0.35, 1.0),
                                        (3 / 4, 4 / 3), decoder=decoder))
    sampler = EpochSampler(len(images), batch, 0, True, size)
    loader = DataLoader(items, batch_sampler=sampler, num_workers=workers, collate_fn=collate,
                        persistent_workers=True, prefetch_factor=4, multiprocessing_context=worker_context())
    cfg = AugmentConfig(flip="random", crop="translate" if crop == "translate" else "random_resized", translate=4)
    aug = BatchAugment(cfg, len(images), (size, size), torch.Generator().manual_seed(0), torch.device("cpu"),
                       resized_crop=False)
    mean, std = torch.tensor(MEAN)[:, None, None], torch.tensor(STD)[:, None, None]
    pad = 4 if crop == "translate" else 0
    for epoch in range(1000):
        draws = aug.draw(epoch)
        for x_u8, y, idx, _ in loader:
            x = reflect_pad((x_u8.float() - mean) / std, pad)
            yield aug(x, idx, draws)


def plain_batches(images, size, crop, workers, batch):
    loader = DataLoader(PlainItems(images, size, crop), batch_size=batch, shuffle=True, num_workers=workers,
                        persistent_workers=True, prefetch_factor=4, drop_last=True)
    for _ in range(1000):
        for x, y in loader:
            yield x


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    env = environment()      # (the commit that runs, read before it runs)
    images, _ = folder_splits(args.folder, 0.0, 0)
    size = 32
    results = []
    for crop in ("translate", "rrc"):
        for name, make in (("speedrun (simplejpeg)", lambda: speedrun_batches(images, size, crop, "simplejpeg",
                                                                              args.workers, args.batch)),
                           ("speedrun (pillow)", lambda: speedrun_batches(images, size, crop, "pillow",
                                                                          args.workers, args.batch)),
                           ("plain per-sample pillow", lambda: plain_batches(images, size, crop, args.workers,
                                                                             args.batch))):
            rate = time_loader(make(), args.batches)
            results.append({"pipeline": name, "crop": crop, "images_per_second": rate})
            print(f"{crop:9s} {name:26s} {rate:8.0f} images/s", flush=True)
    record = {
        "benchmark": "streamed input pipeline throughput",
        "timed": f"{args.batches} batches of {args.batch} augmented, normalised float images after a first "
                 "batch (worker start-up) that is not counted",
        "folder": str(args.folder), "images": len(images), "image_size": size, "workers": args.workers,
        "results": results,
        "speedup": {crop: next(r["images_per_second"] for r in results if r["crop"] == crop
                               and r["pipeline"] == "speedrun (simplejpeg)")
                    / next(r["images_per_second"] for r in results if r["crop"] == crop
                           and r["pipeline"] == "plain per-sample pillow") for crop in ("translate", "rrc")},
        "environment": env,
    }
    atomic_write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
