"""Time `speedrun train RECIPE` as a user runs it: the whole process, start-up included.

Runs the command N times, each a subprocess timed from outside, and writes one JSON record with
every run's summary.json and the machine. On a crowded machine, ``--busy`` and ``--system`` (see
their help) time each run beside processes that keep a core busy, and other checkouts or a plain
PyTorch loop beside speedrun, the yardstick of what sharing a core costs.

    .venv/bin/python benchmarks/train_cli.py fashion-mnist --runs 3 --data-dir ../shared/datasets \
        --out benchmarks/results/fashion-mnist-cpu-demo.json [-- --set key=value ...]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from speedrun.errors import SpeedrunError
from speedrun.files import atomic_write_json, check_output_file
from speedrun.report.environment import machine

HERE = Path(__file__).resolve()


def plain_loop(data_dir: str, n: int | None = None) -> None:
    """A plain PyTorch training loop: one epoch of Fashion-MNIST (``n``: its first n training and test
    images) on a three-stage conv net, SGD with Nesterov momentum in batches of 256, bf16 autocast where the
    CPU has native bf16, torch's default threads and wait policy. Prints one JSON line: seconds of training,
    test accuracy."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from speedrun.compat import cpu_bf16_units
    from speedrun.data import load_dataset

    ds = load_dataset("fashion-mnist", data_dir, fetch=False)
    normalise = lambda x: (x[:n].float() / 255 - 0.286) / 0.353        # noqa: E731
    xtr, ytr, xte, yte = normalise(ds.train_x), ds.train_y[:n], normalise(ds.test_x), ds.test_y[:n]

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU(),
                nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.GELU(), nn.MaxPool2d(2)]

    torch.manual_seed(0)
    net = nn.Sequential(*block(1, 24), *block(24, 48), *block(48, 96), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                        nn.Linear(96, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    bf16, order, t0 = bool(cpu_bf16_units()), torch.randperm(len(xtr)), time.perf_counter()
    for i in range(0, len(xtr), 256):
        take = order[i:i + 256]
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
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG (Linux)


@contextmanager
def busy(n: int):
    """``n`` processes that each keep one core busy (``yes > /dev/null``) while the block runs."""
    procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent) for _ in range(n)]
    time.sleep(0.5 if n else 0)                          # (running before the timed process starts)
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def checkout_commit(src: Path) -> str | None:
    """The commit checked out at ``src`` (None where git cannot say)."""
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def run_one(args, name: str, src: Path | None, i: int, busy_n: int, tmp: Path) -> dict:
    """One timed process of ``name`` (run ``i``, beside ``busy_n`` busy processes): its figures; its run folder
    copied to --keep-runs after the process ended. A failed process stops the script with its exit code."""
    folder, env = tmp / f"{name}-run{i}-busy{busy_n}", dict(os.environ)
    if name == "plain":
        cmd = [sys.executable, str(HERE), "--plain-child", args.data_dir, str(args.plain_images or "")]
    else:
        cmd = [sys.executable, "-m", "speedrun", "train", args.recipe, "--seed", str(args.first_seed + i),
               "--out", str(folder), *(["--data-dir", args.data_dir] if args.data_dir else []), *args.extra]
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(src / "src"), env.get("PYTHONPATH", "")])
    if args.cold_cache:
        env["SPEEDRUN_CACHE"] = str(tmp / f"cache-{name}-{i}-{busy_n}")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / f"inductor-{name}-{i}-{busy_n}")
    with busy(busy_n):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        raise SystemExit(proc.returncode)
    if name == "plain":
        summary, metrics = json.loads(proc.stdout.strip().splitlines()[-1]), None
    else:
        summary = json.loads((folder / "summary.json").read_text())
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        if args.keep_runs:
            shutil.copytree(folder, args.keep_runs / kept_name(args, name, i, busy_n))
    print(f"{name} run {i}{' beside %d busy' % busy_n if busy_n else ''}: test_acc {summary['test_acc']:.4f}, "
          f"process wall {wall:.1f} s, train_seconds {summary['train_seconds']:.1f}")
    return {"system": name, "busy_processes": busy_n, "process_wall_seconds": wall, "summary": summary,
            "metrics": metrics, "stdout_head": proc.stdout.splitlines()[:8]}


def kept_name(args, name: str, i: int, busy_n: int) -> str:
    """run<i> for one system alone, else SYSTEM-run<i>[-busyK]."""
    alone = len(args.systems) == 1 and not args.busy
    return f"run{i}" if alone else f"{name}-run{i}" + (f"-busy{busy_n}" if busy_n else "")


def parse():
    """The options before ``--`` (with ``extra``: the ``speedrun train`` arguments after it; ``systems``: (name,
    checkout or None); ``loads``: busy processes beside each run), refused before any run where a --system is
    no checkout, --system plain has no data, or --out or a folder --keep-runs would write exists."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + runs - 1")
    p.add_argument("--data-dir")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keep-runs", type=Path, help="copy each run's folder (weights included) to KEEP_RUNS/run<i> "
                   "(with --system or --busy: SYSTEM-run<i>[-busyK]) after its process ended (untimed)")
    p.add_argument("--cold-cache", action="store_true", help="each run with an empty decoded-folder cache and an "
                   "empty compile cache (the decoding and any compiling are in the timed process)")
    p.add_argument("--busy", type=int, default=0,
                   help="time each run alone and again beside this many processes that keep a core busy")
    p.add_argument("--busy-systems", metavar="NAME,...", help="with --busy: only these systems' runs are timed "
                   "again beside the busy processes (default: every system's)")
    p.add_argument("--system", action="append", default=[],
                   help="plain, or NAME=SRC: speedrun from the checkout SRC (repeatable; default: this checkout)")
    p.add_argument("--plain-images", type=int,
                   help="the plain loop trains and tests on the first N images of each split (all)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.extra, args.systems = argv[cut + 1:], []
    for text in args.system or ["speedrun"]:             # plain, NAME=SRC or NAME (this checkout)
        name, _, src = text.partition("=")
        args.systems.append((name, Path(src).resolve() if src else None))
        if src and not (Path(src) / "src" / "speedrun").is_dir():
            p.error(f"--system {name}: {src} has no src/speedrun; give a speedrun checkout")
    names = [name for name, _ in args.systems]
    chosen = names if args.busy_systems is None else [n for n in args.busy_systems.split(",") if n]
    if args.busy_systems is not None and not args.busy:
        p.error("--busy-systems goes with --busy K")
    if unknown := [n for n in chosen if n not in names]:
        p.error(f"--busy-systems: {unknown[0]!r} is not a --system of this call ({', '.join(names)})")
    args.loads = {name: [0, args.busy] if args.busy and name in chosen else [0] for name in names}
    if any(name == "plain" for name, _ in args.systems) and not args.data_dir:
        p.error("--system plain reads Fashion-MNIST from --data-dir")
    kept = [args.keep_runs / kept_name(args, name, i, n) for i in range(args.runs) for name, _ in args.systems
            for n in args.loads[name] if name != "plain"] if args.keep_runs else []
    if any(k.exists() for k in kept):
        p.error(f"--keep-runs: {next(k for k in kept if k.exists())} exists; give an empty or new folder")
    try:
        check_output_file(args.out, "--out")
    except SpeedrunError as err:
        p.error(str(err))
    return args


def main() -> int:
    if sys.argv[1:2] == ["--plain-child"]:                 # (the plain loop, in its own process)
        plain_loop(sys.argv[2], int(sys.argv[3]) if sys.argv[3] else None)
        return 0
    args = parse()
    environ = machine()      # (the commit that runs, read before it runs)
    commits = {name: (checkout_commit(src) if src else environ["commit"]) for name, src in args.systems}
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_one(args, name, src, i, n, Path(tmp))
                for i in range(args.runs) for name, src in args.systems for n in args.loads[name]]
    walls, accs = [r["process_wall_seconds"] for r in runs], [r["summary"]["test_acc"] for r in runs]
    summary = {"test_acc_min": min(accs), "test_acc_mean": sum(accs) / len(accs),
               "process_wall_seconds_max": max(walls), "process_wall_seconds_mean": sum(walls) / len(walls)}
    if args.busy or len(args.systems) > 1:
        summary["systems"] = {}
        for name, _ in args.systems:
            row = summary["systems"][name] = {"commit": commits[name]}
            for n in args.loads[name]:
                mine = [r["process_wall_seconds"] for r in runs if r["system"] == name and r["busy_processes"] == n]
                row["busy" if n else "alone"] = {"median_s": statistics.median(mine), "runs_s": mine}
            if "busy" in row:
                row["slowdown_busy_over_alone"] = row["busy"]["median_s"] / row["alone"]["median_s"]
    record = {
        "benchmark": "speedrun train, whole process" + (", alone and beside busy processes" if args.busy else ""),
        "timed": "process_wall_seconds: from starting the Python interpreter to its exit (imports, data loading and "
                 "checks, training, evaluation, writing the record); train_seconds inside each summary is the "
                 "speed-run region" + ("; each run alone, then beside --busy processes running `yes > /dev/null`"
                                       if args.busy else ""),
        "recipe": args.recipe, "cold_cache": args.cold_cache, "busy_processes": args.busy,
        **({"busy_systems": [name for name, _ in args.systems if args.busy in args.loads[name]]} if args.busy else {}),
        "systems": {name: {"source": str(src) if src else "this checkout", "commit": commits[name]}
                    for name, src in args.systems},
        "command": " ".join(["speedrun", "train", args.recipe,
                             *(["--data-dir", args.data_dir] if args.data_dir else []), *args.extra]),
        "runs": runs, "summary": summary, "environment": environ}
    atomic_write_json(args.out, record)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
