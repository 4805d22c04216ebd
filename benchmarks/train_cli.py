"""Time `speedrun train RECIPE` as a user runs it: the whole process, start-up included.

Runs the command N times as a subprocess, measures each process's wall time from outside,
and writes one JSON record with every run's summary.json, the device, torch version and
commit. Usage:

    .venv/bin/python benchmarks/train_cli.py fashion-mnist --runs 3 --data-dir ../shared/datasets \
        --out benchmarks/results/fashion-mnist-cpu-demo.json [-- --set key=value ...]

On a crowded machine: ``--busy 1`` times every run twice, alone and beside one process that
keeps a core busy (``yes > /dev/null``); ``--system NAME=SRC`` (repeatable) runs speedrun from
another source folder (another commit's checkout, its ``src/`` put first on the path), and
``--system plain`` a plain PyTorch loop of a similar conv net on the same data (one epoch of
Fashion-MNIST, bf16 where the CPU has native bf16), the yardstick of what sharing a core costs.
"""
from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speedrun.report.environment import machine
from speedrun.files import atomic_write_json

HERE = Path(__file__).resolve()


def timed_train(cmd: list[str], env: dict, folder: Path | None, cwd: Path | None = None):
    """Run one ``speedrun train ... --out folder`` process; (its completed process, wall seconds
    from interpreter start to exit, summary.json, metrics.jsonl rows). The record is read only
    when the process succeeded and wrote a folder (else summary and metrics are None)."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if proc.returncode or folder is None:
        return proc, wall, None, None
    summary = json.loads((folder / "summary.json").read_text())
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return proc, wall, summary, metrics


def plain_loop(data_dir: str, n_train: int | None = None, epochs: int = 1, batch: int = 256) -> None:
    """A plain PyTorch training loop: Fashion-MNIST from its .gz files, a three-stage conv net,
    SGD with Nesterov momentum, bf16 autocast where the CPU has native bf16, torch's default
    threads and wait policy; ``n_train``: the first so many training and test images (all by default).
    Prints one JSON line: seconds of training, test accuracy."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from speedrun.compat import cpu_bf16_units

    def read(name, offset):
        raw = gzip.open(Path(data_dir) / "fashion-mnist" / name).read()
        return torch.frombuffer(bytearray(raw[offset:]), dtype=torch.uint8)

    def images(name):
        return (read(name, 16).view(-1, 1, 28, 28).float() / 255 - 0.286) / 0.353

    xtr, ytr = images("train-images-idx3-ubyte.gz"), read("train-labels-idx1-ubyte.gz", 8).long()
    xte, yte = images("t10k-images-idx3-ubyte.gz"), read("t10k-labels-idx1-ubyte.gz", 8).long()
    xtr, ytr, xte, yte = xtr[:n_train], ytr[:n_train], xte[:n_train], yte[:n_train]

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU(),
                nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU(), nn.MaxPool2d(2)]

    torch.manual_seed(0)
    net = nn.Sequential(*block(1, 24), *block(24, 48), *block(48, 96), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                        nn.Linear(96, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    bf16 = bool(cpu_bf16_units())
    t0 = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(xtr))
        for i in range(0, len(xtr), batch):
            take = order[i:i + batch]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(net(xtr[take]), ytr[take], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    seconds = time.perf_counter() - t0
    net.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        right = sum(int((net(xte[i:i + 2000]).argmax(1) == yte[i:i + 2000]).sum()) for i in range(0, len(xte), 2000))
    print(json.dumps({"train_seconds": seconds, "test_acc": right / len(xte), "bf16": bf16,
                      "threads": torch.get_num_threads()}))


def _die_with_parent() -> None:
    """In a busy child, before it starts: the kernel ends it when this script ends, however this
    script ends (a SIGKILL, a test's timeout), so no busy process outlives the measurement."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


class Busy:
    """``n`` processes that each keep one core busy (``yes > /dev/null``) while the block runs."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
                      for _ in range(self.n)]
        time.sleep(0.5 if self.n else 0)                  # (running before the timed process starts)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def checkout_commit(src: Path) -> str | None:
    """The commit checked out at ``src`` (None where git cannot say)."""
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def parse_system(text: str) -> tuple[str, Path | None]:
    """``plain``, ``NAME=SRC`` (speedrun from the checkout at SRC) or ``NAME`` (this checkout)."""
    if text == "plain":
        return text, None
    name, _, src = text.partition("=")
    return name, (Path(src).resolve() if src else None)


def main() -> int:
    if sys.argv[1:2] == ["--plain-child"]:                 # (the plain loop, in its own process)
        plain_loop(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + runs - 1")
    p.add_argument("--data-dir")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keep-runs", type=Path,
                   help="copy each run's folder (config, metrics, summary, weights) to KEEP_RUNS/run<i> (with "
                        "--system or --busy: SYSTEM-run<i>[-busyK]) after its process ended (outside the timed "
                        "region)")
    p.add_argument("--cold-cache", action="store_true",
                   help="each run with an empty decoded-folder cache and an empty compile cache (the "
                        "decoding and any compiling are in the timed process)")
    p.add_argument("--busy", type=int, default=0,
                   help="time each run alone and again beside this many processes that keep a core busy")
    p.add_argument("--system", action="append", default=[],
                   help="plain, or NAME=SRC: speedrun from the checkout SRC (repeatable; default: this checkout)")
    p.add_argument("--plain-images", type=int,
                   help="the plain loop trains and tests on the first N images of each split (all)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)     # after --: more arguments for speedrun train
    args = p.parse_args(argv[:cut])
    environ = machine()      # (the commit that runs, read before it runs)
    args.extra = argv[cut + 1:]
    systems = [parse_system(s) for s in args.system] or [("speedrun", None)]
    if any(name == "plain" for name, _ in systems) and not args.data_dir:
        p.error("--system plain reads Fashion-MNIST from --data-dir")
    for name, src in systems:
        if src is not None and not (src / "src" / "speedrun").is_dir():
            p.error(f"--system {name}: {src} has no src/speedrun; give a speedrun checkout")
    loads = [0, args.busy] if args.busy else [0]               # busy processes beside each run
    one_alone = len(systems) == 1 and not args.busy            # (kept as run<i>; else SYSTEM-run<i>[-busyK])

    def kept_name(name: str, i: int, busy: int) -> str:
        return f"run{i}" if one_alone else f"{name}-run{i}" + (f"-busy{busy}" if busy else "")
    kept = [args.keep_runs / kept_name(name, i, busy) for i in range(args.runs) for name, _ in systems
            for busy in loads if name != "plain"] if args.keep_runs else []
    taken = [k for k in kept if k.exists()]
    if taken:                                        # refused before any run, not after the first
        p.error(f"--keep-runs: {taken[0]} exists; give an empty or new folder")
    commits = {name: (checkout_commit(src) if src else environ["commit"]) for name, src in systems}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, src in systems:
                for busy in loads:
                    folder = Path(tmp) / f"{name}-run{i}-busy{busy}"
                    env = dict(os.environ)
                    if name == "plain":
                        cmd, out = [sys.executable, str(HERE), "--plain-child", args.data_dir,
                                    *([str(args.plain_images)] if args.plain_images else [])], None
                    else:
                        cmd = [sys.executable, "-m", "speedrun", "train", args.recipe,
                               "--seed", str(args.first_seed + i), "--out", str(folder)]
                        cmd += (["--data-dir", args.data_dir] if args.data_dir else []) + args.extra
                        out = folder
                        if src is not None:
                            env["PYTHONPATH"] = os.pathsep.join([str(src / "src"), env.get("PYTHONPATH", "")])
                    if args.cold_cache:
                        env["SPEEDRUN_CACHE"] = str(Path(tmp) / f"cache-{name}-{i}-{busy}")
                        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"inductor-{name}-{i}-{busy}")
                    with Busy(busy):
                        proc, wall, summary, metrics = timed_train(cmd, env, out)
                    if proc.returncode:
                        print(proc.stderr, file=sys.stderr)
                        return proc.returncode
                    if name == "plain":
                        summary = json.loads(proc.stdout.strip().splitlines()[-1])
                    if args.keep_runs and name != "plain":
                        shutil.copytree(folder, args.keep_runs / kept_name(name, i, busy), dirs_exist_ok=False)
                    runs.append({"system": name, "busy_processes": busy, "process_wall_seconds": wall,
                                 "summary": summary, "metrics": metrics, "stdout_head": proc.stdout.splitlines()[:8]})
                    print(f"{name} run {i}{' beside %d busy' % busy if busy else ''}: test_acc "
                          f"{summary['test_acc']:.4f}, process wall {wall:.1f} s, "
                          f"train_seconds {summary['train_seconds']:.1f}")
    walls = [r["process_wall_seconds"] for r in runs]
    accs = [r["summary"]["test_acc"] for r in runs]
    summary = {"test_acc_min": min(accs), "test_acc_mean": sum(accs) / len(accs),
               "process_wall_seconds_max": max(walls), "process_wall_seconds_mean": sum(walls) / len(walls)}
    if args.busy or len(systems) > 1:
        summary["systems"] = {}
        for name, _ in systems:
            row = {"commit": commits[name]}
            for busy in loads:
                mine = [r["process_wall_seconds"] for r in runs if r["system"] == name and r["busy_processes"] == busy]
                row["busy" if busy else "alone"] = {"median_s": statistics.median(mine), "runs_s": mine}
            if args.busy:
                row["slowdown_busy_over_alone"] = row["busy"]["median_s"] / row["alone"]["median_s"]
            summary["systems"][name] = row
    record = {
        "benchmark": "speedrun train, whole process" + (", alone and beside busy processes" if args.busy else ""),
        "timed": "process_wall_seconds: from starting the Python interpreter to its exit (imports, data "
                 "loading and checks, training, evaluation, writing the record); train_seconds inside "
                 "each summary is the speed-run region" +
                 ("; each run alone, then beside --busy processes running `yes > /dev/null`" if args.busy else ""),
        "recipe": args.recipe,
        "cold_cache": args.cold_cache,
        "busy_processes": args.busy,
        "systems": {name: {"source": str(src) if src else "this checkout", "commit": commits[name]}
                    for name, src in systems},
        "command": " ".join(["speedrun", "train", args.recipe, *(["--data-dir", args.data_dir] if args.data_dir else []),
                             *args.extra]),
        "runs": runs,
        "summary": summary,
        "environment": environ,
    }
    atomic_write_json(args.out, record)
    print(json.dumps(record["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
