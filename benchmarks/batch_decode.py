"""Images per second the decode-once path (``data.decoder = "torchvision"``: torchvision's
``decode_jpeg`` on lists of files, nvJPEG on a CUDA GPU, libjpeg-turbo on the CPU) turns a folder
of photo-sized JPEGs into square training images, and where its time goes.

Two measurements on one folder of photo-like JPEGs whose shapes vary as ImageNet's do (most
500 x 375 or 375 x 500, the rest of sides drawn between 240 and 640 px; colour fields plus noise,
about 100 kB each at quality 90, written by ``throughput.photo_folder``):

* ``whole``: ``speedrun.data.prepare.prepare(..., decoder="torchvision", device=DEVICE)``, the
  call training makes on a cache miss (files read, decoded, resized to SIZE, written to an
  ``.npz``), timed end to end, ``--rounds`` times.
* ``phases``: the same steps one at a time on one host thread, each over every file, so their
  sum is what a path that never overlaps them pays: reading the files, checking each JPEG's
  header on the host, the batched decode (lists of ``--batch``), the resize to SIZE on the
  device (with the number of distinct image shapes per list, which sets how many resize calls
  a list needs), each with a device synchronisation at its end.

    .venv-2.14/bin/python benchmarks/batch_decode.py --work /tmp/batch-decode [--device cuda] \\
        [--images 1000] [--out benchmarks/results/batch-decode-DEVICE.json]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from speedrun.data.prepare import prepare
from speedrun.data.sources import device_decode as dd
from speedrun.data.sources.folder import folder_splits, read_bytes
from speedrun.errors import SpeedrunError
from speedrun.files import atomic_write_json, check_output_file
from speedrun.report.environment import machine
import throughput

RESULTS = Path(__file__).parent / "results"


def shapes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(width, height) of ``n`` photos: 60% 500 x 375, 20% 375 x 500, 20% drawn from 240-640 px."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        out.append((500, 375) if u < 0.6 else (375, 500) if u < 0.8
                   else (int(rng.integers(240, 641)), int(rng.integers(240, 641))))
    return out


def photo_folder(root: Path, n: int) -> Path:
    """``n`` training photos (and a tenth as many for validation, at least one a class) in ten
    classes, made once, by ``throughput.photo_folder`` (a forked writer per core)."""
    if not root.exists():
        tmp = root.with_name(f".{root.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        spec = SimpleNamespace(classes=10, val_per_class=max(1, n // 100), sizes=shapes(n), quality=90)
        throughput.photo_folder(tmp, spec, max(1, n // 10))
        os.replace(tmp, root)
    return root


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phases(paths: list[Path], size: int, batch: int, device: torch.device) -> dict:
    """Seconds of each step over all files, one step at a time, on one host thread."""
    import warnings
    tvio = dd.torchvision_io()
    t = {"read": 0.0, "header": 0.0, "decode": 0.0, "resize": 0.0}
    groups = []
    for start in range(0, len(paths), batch):
        chunk = paths[start:start + batch]
        t0 = time.perf_counter()
        data = [read_bytes(p) for p in chunk]
        t1 = time.perf_counter()
        for d, p in zip(data, chunk):
            dd._check_header(d, p)
        t2 = time.perf_counter()
        encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            images = tvio.decode_jpeg(encoded, mode=tvio.ImageReadMode.RGB, device=device)
        sync(device)
        t3 = time.perf_counter()
        out = torch.zeros((len(chunk), 3, size, size), dtype=torch.uint8, device=device)
        dd._squares_into(out, dict(enumerate(images)), size)
        sync(device)
        t4 = time.perf_counter()
        groups.append(len({tuple(x.shape) for x in images}))
        for key, seconds in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[key] += seconds
    n = len(paths)
    return {"seconds": t, "microseconds_per_image": {k: 1e6 * v / n for k, v in t.items()},
            "images_per_s_if_serial": n / sum(t.values()), "distinct_shapes_per_list": groups}


def writes(work: Path, n: int, size: int) -> dict:
    """Seconds to write ``n`` squares of ``size`` px (3 channels) as the decode-once path writes its
    cache: row lists of 256 into the scratch memory-mapped array, then the ``.npz`` member copied
    from it (``prepare._write_member``, as ``prepare`` calls it: every row kept)."""
    import zipfile
    from speedrun.data.prepare import _write_member
    shape, per = (n, 3, size, size), 3 * size * size
    rows = np.random.default_rng(0).integers(0, 256, (256, 3, size, size), dtype=np.uint8)
    scratch, out = work / "writes-scratch.npy", work / "writes.npz"
    t0 = time.perf_counter()
    arr = np.lib.format.open_memmap(scratch, mode="w+", dtype=np.uint8, shape=shape)
    for start in range(0, n, 256):
        arr[start:start + 256] = rows[:min(256, n - start)]
    arr.flush()
    t1 = time.perf_counter()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        _write_member(zf, "x_train", arr, np.ones(n, dtype=bool))
    t2 = time.perf_counter()
    del arr
    os.remove(scratch)
    os.remove(out)
    gb = n * per / 1e9
    return {"images": n, "size": size, "gigabytes": gb, "scratch_seconds": t1 - t0, "npz_member_seconds": t2 - t1,
            "scratch_gb_per_s": gb / (t1 - t0), "npz_member_gb_per_s": gb / (t2 - t1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="folder for the photos and the outputs")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--images", type=int, default=1000, help="training photos (default 1000)")
    p.add_argument("--size", type=int, default=160, help="side of the decoded squares (default 160)")
    p.add_argument("--batch", type=int, default=256, help="files per decode call in the phases (default 256)")
    p.add_argument("--rounds", type=int, default=3, help="timed whole passes (default 3)")
    p.add_argument("--write-images", type=int, default=10000,
                   help="squares (3 x 224 px) written as a cache is, to time the writing alone (default 10000; 0: not timed)")
    p.add_argument("--label", default="", help="a word for what code this is (kept in the record)")
    p.add_argument("--commit", help="the commit the record names (default: the checkout's; a copy without .git "
                                    "has none)")
    p.add_argument("--out", type=Path, help="the record (default: results/batch-decode-DEVICE.json)")
    args = p.parse_args()
    env = machine()
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{env['cpu_model']} {env['cpu_family_model']}"
    slug = re.sub(r"[^a-z0-9]+", "-", where.lower()).strip("-")
    out = args.out or RESULTS / f"batch-decode-{slug}.json"
    try:
        check_output_file(out)
        folder = photo_folder(args.work / f"photos-{args.images}", args.images)
        train, val = folder_splits(folder, 0.0, 0)
        paths = [train.path(i) for i in range(len(train))]
        files = len(train) + len(val)
        sizes = [pth.stat().st_size for pth in paths]
        prepare(folder, args.size, args.work / "warm.npz", decoder="torchvision", device=device)    # imports, nvJPEG set-up
        os.remove(args.work / "warm.npz")
        whole = []
        for r in range(args.rounds):
            target = args.work / f"round-{r}.npz"
            sync(device)
            t0 = time.perf_counter()
            prepare(folder, args.size, target, decoder="torchvision", device=device)
            sync(device)
            whole.append(files / (time.perf_counter() - t0))
            os.remove(target)
            print(f"whole pass {r}: {whole[-1]:,.0f} images/s", flush=True)
        split = phases(paths, args.size, args.batch, device)
        print("phases, microseconds per image: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                             split["microseconds_per_image"].items()), flush=True)
        written = writes(args.work, args.write_images, 224) if args.write_images else None
        if written:
            print(f"writing {written['gigabytes']:.2f} GB: scratch {written['scratch_gb_per_s']:.2f} GB/s, "
                  f".npz member {written['npz_member_gb_per_s']:.2f} GB/s", flush=True)
        record = {"benchmark": "batched decode (decode-once path)", "what": __doc__.split("\n\n")[0],
                  "label": args.label, "device": where, "threads": torch.get_num_threads(),
                  "host_cores": os.cpu_count(),
                  "photos": {"train": len(train), "val": len(val), "mean_bytes": statistics.mean(sizes),
                             "shapes": "60% 500x375, 20% 375x500, 20% sides drawn from 240-640 px",
                             "content": "photo-like (colour fields plus noise), JPEG quality 90"},
                  "size": args.size,
                  "timed": {"whole": f"prepare() over {files} files to {args.size} px squares in an .npz, end to end "
                                     "(device synchronised), after one untimed pass",
                            "phases": f"each step over the {len(paths)} training files, in lists of {args.batch}, "
                                      "one step at a time on one host thread, the device synchronised after each",
                            "writes": "the cache's two writes alone, of random squares at 224 px: lists of 256 rows "
                                      "into the scratch memory-mapped array, then its copy into the .npz member, on "
                                      "the --work folder's disk"},
                  "whole_images_per_s": whole, "median_whole_images_per_s": statistics.median(whole),
                  "phases": split, "writes": written, "torch_version": torch.__version__,
                  "torchvision_version": __import__("torchvision").__version__,
                  "commit": args.commit or env.get("commit"), "machine": env}
        atomic_write_json(out, record)
        print(f"median whole pass: {record['median_whole_images_per_s']:,.0f} images/s; wrote {out}")
        return 0
    except SpeedrunError as err:
        print(f"batch_decode.py: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
