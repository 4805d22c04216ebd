"""Images per second one core decodes and crops for training, from large JPEGs and from reduced
stores of them (``speedrun data prepare --reduce``).

Each image is read, decoded and cut to one random-resized crop of SIZE px exactly as the streamed
folder pipeline's workers do it (``ImageItems`` with the ``imagenette`` recipe's crop scales; the
decoder ``auto`` is simplejpeg with DCT-domain down-scaling where installed, ``pillow`` is
Pillow's ``draft``), in this one process with one thread: the rate one worker adds. Two sources by
default (or ``--source DIR``, your own folder): CIFAR-10's images exported as 480 px JPEGs (smooth:
upscaled 32 px pictures compress far better than photos), and photo-like 500 x 375 JPEGs (colour
fields plus noise, about 95 kB each, as ``throughput.py`` makes them: closer to what a photo costs
to decode); stores are made from each at every ``--sides`` value (quality ``--quality``), and the
pass that makes each one is timed too. Each rate is the median of ``--rounds`` passes over the images (a
new crop per pass). The record predicts, from the per-core rate, what a 16-core host's workers
would decode.

    .venv/bin/python benchmarks/decode_rate.py --work /tmp/decode-rate [--limit 300] \\
        [--out benchmarks/results/decode-rate-CPU.json]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from speedrun.data.pipeline.stream import Decoding, ImageItems
from speedrun.data.prepare import export
from speedrun.data.reduced_store import reduce_store
from speedrun.data.sources.folder import folder_splits, probe
from speedrun.errors import SpeedrunError
from speedrun.files import atomic_write_json, check_output_file
from speedrun.recipe import load_recipe
from speedrun.report.environment import machine
from throughput import write_photo

PHOTO_SIZE = (500, 375)

RESULTS = Path(__file__).parent / "results"
HOST_CORES = 16


def rate(folder: Path, size: int, decoder: str, rounds: int, augment) -> dict:
    """Images per second of decode + random-resized crop over ``folder``'s training images."""
    train, _ = folder_splits(folder, 0.1, 0)
    decoding = Decoding(probe(train)["channels"], True, "random_resized", tuple(augment.rrc_scale),
                        tuple(augment.rrc_ratio), decoder=decoder, seed=0)
    items = ImageItems(train, decoding)
    items[(0, size, 0)]                                         # (the first call's imports and caches)
    per_round, per_cpu_round = [], []
    for epoch in range(rounds):
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(len(train)):
            items[(i, size, epoch)]
        per_cpu_round.append(len(train) / (time.process_time() - cpu_start))
        per_round.append(len(train) / (time.perf_counter() - start))
    files = [train.path(i) for i in range(len(train))]
    return {"images": len(train), "decoder": decoder, "images_per_cpu_s": per_cpu_round,
            "median_images_per_cpu_s": statistics.median(per_cpu_round), "images_per_wall_s": per_round,
            "median_images_per_wall_s": statistics.median(per_round),
            "mean_file_bytes": sum(f.stat().st_size for f in files) / len(files)}


def cifar_source(args) -> Path:
    source = args.work / f"cifar10-{args.side}"
    if not source.exists():
        export("cifar10", "jpeg", source, args.data_dir, quality=90, limit=args.limit, size=args.side)
    return source


def photo_source(args) -> Path:
    """``args.limit`` photo-like JPEGs per split, ten classes, at quality 90."""
    source = args.work / "photo-like"
    if not source.exists():
        tmp = args.work / ".photo-like"
        for split, offset in (("train", 0), ("val", 10 ** 6)):
            for i in range(args.limit):
                folder = tmp / split / f"c{i % 10}"
                folder.mkdir(parents=True, exist_ok=True)
                write_photo(str(folder / f"{i:05d}.jpg"), offset + i, *PHOTO_SIZE, 90)
        os.replace(tmp, source)
    return source


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="folder for the source JPEGs and the stores")
    p.add_argument("--source", type=Path, help="an image folder of your own (default: CIFAR-10 exported at --side)")
    p.add_argument("--data-dir", help="where CIFAR-10 is (else $SPEEDRUN_DATA, ~/.cache/speedrun)")
    p.add_argument("--limit", type=int, default=300, help="images per split of each made source (default 300)")
    p.add_argument("--side", type=int, default=480, help="side of the exported source JPEGs (default 480)")
    p.add_argument("--sides", default="320,160", help="max sides of the stores (default 320,160)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of the stores (default 90)")
    p.add_argument("--size", type=int, default=128, help="side of the random-resized crops (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="passes over the images per rate (default 3)")
    p.add_argument("--decoders", default="auto,pillow", help="folder decoders to time (default auto,pillow)")
    p.add_argument("--out", type=Path, help="the record (default: results/decode-rate-CPU.json)")
    args = p.parse_args()
    env = machine()                                             # (the commit that runs, read before it runs)
    cpu = re.sub(r"[^a-z0-9]+", "-", f"{env['cpu_model']} {env['cpu_family_model']}".lower()).strip("-")
    out = args.out or RESULTS / f"decode-rate-{cpu}.json"
    try:
        check_output_file(out)
        sources = {"--source": args.source} if args.source else \
            {f"cifar10 {args.side} px": cifar_source(args), "photo-like 500x375": photo_source(args)}
        stores, passes, groups = {}, [], {}
        for label, source in sources.items():
            stores[label] = groups[label] = source
            for side in (int(s) for s in args.sides.split(",")):
                store = args.work / f"{source.name}-store-{side}-q{args.quality}"
                if not store.exists():
                    start = time.perf_counter()
                    manifest = reduce_store(source, store, side, args.quality)
                    passes.append({"source": label, "max_side": side, "quality": args.quality,
                                   "seconds": time.perf_counter() - start, "workers": min(8, os.cpu_count() or 1),
                                   "images": manifest["images"], "resized": manifest["resized"],
                                   "copied": manifest["copied"]})
                stores[f"{label} -> store {side} px q{args.quality}"] = store
        torch.set_num_threads(1)
        load_before = os.getloadavg()
        augment = load_recipe("imagenette").augment
        measurements = []
        for decoder in args.decoders.split(","):
            for name, folder in stores.items():
                m = {"images_from": name, **rate(folder, args.size, decoder, args.rounds, augment)}
                measurements.append(m)
                print(f"{decoder:>7} {name:>40}: {m['median_images_per_cpu_s']:7.1f} images per CPU second "
                      f"({m['median_images_per_wall_s']:.1f} per wall second)", flush=True)
        median = {(m["decoder"], m["images_from"]): m["median_images_per_cpu_s"] for m in measurements}
        speedups = {d: {name: median[d, name] / median[d, base] for name in stores
                        for base in [next(b for b in groups if name.startswith(b))] if name != base}
                    for d in args.decoders.split(",")}
        best = {m["images_from"]: m["median_images_per_cpu_s"] for m in measurements
                if m["decoder"] == args.decoders.split(",")[0]}
        prediction = (f"prediction, not a measurement: a 16-core GPU host's data workers ({args.decoders.split(',')[0]} "
                      "decoder) at this CPU's per-core rate × 16, with the cores doing nothing else and perfect "
                      "scaling (a different CPU, and the training process's own share of the cores, change it): "
                      + "; ".join(f"{name} {r * HOST_CORES:,.0f} images/s" for name, r in best.items()))
        record = {"benchmark": "decode rate per core", "what": __doc__.split("\n\n")[0],
                  "timed": f"read + decode + one random-resized crop to {args.size} px per image (the streamed "
                           "folder pipeline's worker code, ImageItems), one process, one thread; median of "
                           f"{args.rounds} passes over the training images. The per-core rate is images per second "
                           "of this process's CPU time (unaffected by other processes' use of the other cores, "
                           "beyond shared caches); images per wall-clock second are kept beside it",
                  "crop": {"size": args.size, "rrc_scale": list(augment.rrc_scale),
                           "rrc_ratio": list(augment.rrc_ratio), "from": "the imagenette recipe"},
                  "sources": {k: str(v) for k, v in sources.items()}, "measurements": measurements, "speedup_over_source": speedups,
                  "store_passes": passes, "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
                  "shared_machine": "other processes ran beside it where the 1-minute load average is well above 1 "
                                    "(this process uses one core); the per-CPU-second rates hold, the wall rates less", "host_cores": HOST_CORES, "prediction": prediction,
                  "torch_version": torch.__version__, "commit": env.get("commit"), "machine": env}
        atomic_write_json(out, record)
        print(prediction)
        print(f"wrote {out}")
        return 0
    except SpeedrunError as err:
        print(f"decode_rate.py: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
