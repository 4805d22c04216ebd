"""speedrun against the loops a careful engineer would write without it: the cifar10-94 algorithm
trained three ways, one after another, each in a fresh process with the same torch threads.
``plain``: eager PyTorch from the tutorials; ``lightning``: the same under lightning.Trainer (both in
peer_algorithm.py, on speedrun's network); ``speedrun``: ``python -m speedrun train cifar10-94``.

    python benchmarks/peers.py --epochs 9.9 --out FILE.json [--peers plain,lightning,speedrun]
        [--set KEY=VALUE ...] [--precision auto|bf16|fp32] [--rounds N] [--threads N]
    python benchmarks/peers.py --epochs 1 --data-dir SLICE.npz --out /tmp/smoke.json      (a smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.perf_counter()       # (before torch's import: a child's seconds_before_training include it)

import torch  # noqa: E402

from peer_algorithm import (LIGHTNING_PRECISION, Algorithm, Clock, autocast_for, check_supported,  # noqa: E402
                            eval_batches, evaluate, first_touch, lightning_module, make_optimizer, make_trainer,
                            peer_model, train_plain)
from speedrun.compat import cpu_bf16_units  # noqa: E402
from speedrun.data import load_dataset  # noqa: E402
from speedrun.data.sources.arrays import load_npz  # noqa: E402
from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.files import atomic_write_json, check_output_file  # noqa: E402
from speedrun.recipe import load_recipe  # noqa: E402
from speedrun.report.environment import machine  # noqa: E402

RECIPE, PEERS, REPO = "cifar10-94", ("plain", "lightning", "speedrun"), Path(__file__).resolve().parents[1]

DEFINITIONS = {
    "process_seconds": "the whole process from outside, just before its interpreter starts to its exit",
    "train_seconds": "speedrun's region in every peer: first touch of the data to the final TTA accuracy",
    "final_eval_seconds": "the final TTA evaluation with the averaged weights (lightning: the whole Trainer.test)",
    "epoch_seconds": "each epoch's training seconds, monitoring paused out, the final evaluation left out",
    "images_per_s": "training images (steps x batch) / train_seconds_without_final_eval",
    "monitor_seconds": "the per-epoch monitoring evaluations (no TTA, averaged weights), outside train_seconds",
    "seconds_before_training": "plain, lightning: from the script's start to the first touch of the data",
    "rounds": "with --rounds N: every peer N times, round r in --peers order rotated left by r",
    "summary": "with --rounds N: per peer the medians over rounds; speedrun's over the fastest other peer's",
    "ratios_to_speedrun": "peer / speedrun: above 1 the peer took longer (seconds) or trained faster (images_per_s)",
    "flops": "speedrun's FlopCounterMode count over each peer's train_seconds; a measured (lower-bound) peak",
}


# --- Each peer's run, in its own process -----------------------------------------------------

def run_peer(name: str, recipe, data, precision: str) -> dict:
    """Train and evaluate one peer ("plain" or "lightning") here; its figures. The Trainer or optimizer is
    built before the clock, as speedrun's session (a first optimizer imports torch._dynamo: about 1 s)."""
    algo = Algorithm.from_recipe(recipe, len(data.train_y))
    model = peer_model(recipe, algo.seed)
    engine = make_trainer(algo, precision) if name == "lightning" else make_optimizer(model, algo)
    before, clock = time.perf_counter() - STARTED, Clock()
    normalise, batches = first_touch(model, data, algo)
    monitor = (lambda: eval_batches(data, normalise, algo.eval_batch)) if algo.monitor_every else None
    test = eval_batches(data, normalise, algo.eval_batch)
    if name == "plain":
        monitor_acc = train_plain(model, algo, engine, batches, precision, clock, monitor)
        trained = clock.seconds()
        acc_tta, acc = evaluate(model, test, algo.tta, lambda: autocast_for(precision))
        extra = {"autocast": "torch.autocast('cpu', dtype=torch.bfloat16)" if precision == "bf16" else None}
    else:
        import lightning
        module = lightning_module(model, algo, clock, monitor)
        engine.fit(module, train_dataloaders=batches)
        trained = clock.seconds()
        engine.test(module, dataloaders=test, verbose=False)           # (the final TTA accuracy)
        (acc_tta, acc), monitor_acc = (module.correct.double() / module.seen).tolist(), module.monitor_acc
        extra = {"lightning_version": lightning.__version__, "trainer_precision": LIGHTNING_PRECISION[precision],
                 "trainer": "Trainer(accelerator='cpu', devices=1, barebones=True, max_epochs, max_steps, "
                            "inference_mode=True); batches as a plain iterable"}
    total, images = clock.seconds(), algo.total_steps * algo.batch_size
    return {"peer": name, "precision": precision, "threads": torch.get_num_threads(), **extra,
            "seconds_before_training": before, "train_seconds": total, "final_eval_seconds": total - trained,
            "train_seconds_without_final_eval": trained, "monitor_seconds": clock.paused,
            "epoch_seconds": clock.epoch_seconds(), "steps": algo.total_steps, "images_trained": images,
            "images_per_s": images / trained, "test_acc": acc_tta, "test_acc_no_tta": acc,
            "monitor_test_acc": monitor_acc, "flip": algo.flip, "algorithm": algo.describe()}


def run_process(cmd: list[str], threads: int, log: Path) -> float:
    """Run ``cmd`` with ``threads`` threads and its output in ``log``; its wall seconds, start to exit."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(log, "w") as out:
        t = time.perf_counter()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
        wall = time.perf_counter() - t
    if rc:
        raise SystemExit(f"peers: {' '.join(cmd)} failed with exit code {rc}; the end of its output ({log}):\n"
                         + log.read_text()[-3000:])
    return wall


def run_child(argv: list[str], name: str, precision: str, threads: int, work: Path) -> dict:
    """This script again, with this run's arguments, training peer ``name`` in its own process; its figures."""
    result = work / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", name, "--result", str(result),
           "--precision", precision, "--threads", str(threads)]
    wall = run_process(cmd, threads, work / f"{name}.log")
    return {**json.loads(result.read_text()), "process_seconds": wall, "command": " ".join(cmd)}


def run_speedrun(args, work: Path) -> dict:
    """``speedrun train`` as a subprocess; its figures from its summary.json and metrics.jsonl."""
    sets = [*args.overrides, *([f"runtime.precision={args.precision}"] if args.precision != "auto" else []),
            *(["data.dataset=npz"] if args.data_dir.endswith(".npz") else [])]
    cmd = [sys.executable, "-m", "speedrun", "train", RECIPE, *[a for s in sets for a in ("--set", s)],
           "--device", "cpu", "--out", str(work / "speedrun-run"), "--data-dir", args.data_dir]
    wall = run_process(cmd, args.threads, work / "speedrun.log")
    s = json.loads((work / "speedrun-run" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (work / "speedrun-run" / "metrics.jsonl").read_text().splitlines()]
    recorded, final, images = [m["seconds"] for m in metrics], s["final_eval_seconds"], s["steps"] * s["batch_size"]
    return {"peer": "speedrun", "precision": s["precision"], "threads": s["torch_threads"], "command": " ".join(cmd),
            "process_seconds": wall, "train_seconds": s["train_seconds"], "final_eval_seconds": final,
            "train_seconds_without_final_eval": s["train_seconds"] - final, "monitor_seconds": s["monitor_seconds"],
            "epoch_seconds": recorded[:-1] + [recorded[-1] - final], "steps": s["steps"], "images_trained": images,
            "images_per_s": images / (s["train_seconds"] - final), "test_acc": s["test_acc"],
            "test_acc_no_tta": s["test_acc_no_tta"], "monitor_test_acc": [m["test_acc"] for m in metrics[:-1]],
            "flip": "alternating (the recipe's)", "summary": s}


# --- The record ------------------------------------------------------------------------------

def ratios(peers: dict) -> dict:
    s = peers.get("speedrun")
    keys = ("process_seconds", "train_seconds", "train_seconds_without_final_eval", "final_eval_seconds",
            "monitor_seconds", "images_per_s")
    return {name: {**{k: p[k] / s[k] if s[k] else None for k in keys},
                   "epoch_seconds": [a / b for a, b in zip(p["epoch_seconds"], s["epoch_seconds"])]}
            for name, p in peers.items() if name != "speedrun"} if s else {}


def flop_figures(peers: dict, sizes: tuple[int, ...] = (1024, 2048)) -> dict:
    """speedrun's FLOP count over its training seconds and over each peer's seconds, the peak rechecked at
    square products of ``sizes`` (speedrun's summary holds its count, peak and utilisation)."""
    from speedrun.engine.flops import measured_peak
    s, trained = peers["speedrun"]["summary"], peers["speedrun"]["train_seconds_without_final_eval"]
    fine = s["precision"] == "fp32" or cpu_bf16_units()              # (emulated bf16 would take minutes)
    return {"peak_precision": s["precision"], "speedrun_training_flops_per_s": s["train_flops"] / trained,
            "speedrun_training_utilisation": (s["train_flops"] / trained / s["peak_flops_per_s"]
                                              if s["peak_flops_per_s"] else None),
            "achieved_flops_per_s_by_peer": {k: s["total_flops"] / p["train_seconds"] for k, p in peers.items()},
            "peak_recheck_flops_per_s_by_size": {str(n): measured_peak("cpu", s["precision"], size=n)
                                                 for n in (sizes if fine else ())}}


def round_order(peers: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``peers`` rotated left by r, so each peer runs first, then later."""
    k = r % len(peers)
    return peers[k:] + peers[:k]


def round_summary(rounds: list[dict], epochs: float) -> dict:
    """Per peer the medians over rounds (seconds per epoch without the final evaluation, and more);
    whether speedrun's per epoch and for its final evaluation are at most the fastest other peer's."""
    names, out = list(rounds[0]["peers"]), {"medians": {}, "runs": {}}
    for name in names:
        runs = [r["peers"][name] for r in rounds if name in r["peers"]]
        out["runs"][name] = values = {
            "seconds_per_epoch": [p["train_seconds_without_final_eval"] / epochs for p in runs],
            **{k: [p[k] for p in runs] for k in ("final_eval_seconds", "train_seconds", "process_seconds",
                                                 "images_per_s", "test_acc")}}
        out["medians"][name] = {k: statistics.median(v) for k, v in values.items()}
    others, m = [n for n in names if n != "speedrun"], out["medians"]
    if "speedrun" in names and others:
        for key, figure in (("per_epoch", "seconds_per_epoch"), ("final_eval", "final_eval_seconds")):
            out[f"fastest_peer_{key}"] = fastest = min(others, key=lambda n: m[n][figure])
            out[f"speedrun_over_fastest_{key}"] = m["speedrun"][figure] / m[fastest][figure]
        out["speedrun_at_most_fastest_peer"] = max(v for k, v in out.items() if "_over_" in k) <= 1.0
    return out


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--epochs", type=float, required=True, help="train.epochs for every peer (9.9: the full recipe)")
    a("--out", type=Path, required=True, help="the JSON record to write")
    a("--peers", default=",".join(PEERS), help="which peers, in order (default: all)")
    a("--data-dir", default=os.environ.get("SPEEDRUN_DATA") or str(REPO.parent / "shared" / "datasets"),
      help="the folder holding cifar-10-batches-py/, or an .npz of CIFAR-shaped arrays (a smoke run's slice)")
    a("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="an override for every peer")
    a("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 where native, else fp32")
    a("--threads", type=int, default=torch.get_num_threads(), help="torch threads in every peer")
    a("--rounds", type=int, default=1, help="every peer this many times, the order rotated each round: medians")
    a("--peak-sizes", default="1024,2048", metavar="N,N", help="the square matrix products the peak is rechecked "
      "at (default 1024,2048; not where bf16 is emulated)")
    a("--child", choices=["plain", "lightning"], help=argparse.SUPPRESS)
    a("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.overrides = [f"train.epochs={args.epochs!r}", *args.sets]        # (every peer's)
    try:
        args.peak_sizes = tuple(int(n) for n in args.peak_sizes.split(","))
    except ValueError:
        p.error(f"--peak-sizes {args.peak_sizes}: sizes written N,N (e.g. 1024,2048)")
    if not args.peak_sizes or min(args.peak_sizes) < 1:
        p.error(f"--peak-sizes {args.peak_sizes}: each at least 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    recipe = load_recipe(RECIPE, args.overrides)
    if args.child:                              # a peer's own process, CIFAR-10 read as speedrun reads it
        torch.set_num_threads(args.threads)
        npz = args.data_dir.endswith(".npz")     # (a slice's CIFAR-shaped arrays)
        data = load_npz(args.data_dir) if npz else load_dataset("cifar10", args.data_dir, fetch=False)
        atomic_write_json(args.result, run_peer(args.child, recipe, data, args.precision))
        return 0
    peers = args.peers.split(",")
    if args.rounds < 1 or any(p not in PEERS for p in peers) or len(set(peers)) != len(peers):
        raise SystemExit(f"peers: error: give --rounds 1 or more and --peers from {', '.join(PEERS)}, each once")
    check_supported(recipe)
    try:
        check_output_file(args.out, "--out")
    except SpeedrunError as err:
        raise SystemExit(f"peers: error: {err}")
    precision = args.precision if args.precision != "auto" else ("bf16" if cpu_bf16_units() else "fp32")
    record = {"benchmark": "speedrun against a plain PyTorch loop and a Lightning Trainer, same algorithm",
              "recipe": RECIPE, "overrides": args.overrides, "epochs": args.epochs, "threads": args.threads,
              "precision": precision, "bf16_units": list(cpu_bf16_units()), "data": args.data_dir, "order": peers,
              "definitions": DEFINITIONS, "environment": machine(), "peers": {}}
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        for r in range(args.rounds):
            done, work = {"order": round_order(peers, r), "peers": {}}, Path(tmp) / f"round-{r + 1}"
            work.mkdir()
            if args.rounds > 1:
                record.setdefault("rounds", []).append(done)
            for name in done["order"]:
                print(f"peers: round {r + 1}/{args.rounds}: {name} ...", flush=True)
                result = done["peers"][name] = (run_speedrun(args, work) if name == "speedrun"
                                                else run_child(argv, name, precision, args.threads, work))
                done["ratios_to_speedrun"] = ratios(done["peers"])
                if r == 0:                      # the first round, as a one-round record has it
                    record["peers"], record["ratios_to_speedrun"] = done["peers"], done["ratios_to_speedrun"]
                if args.rounds > 1:
                    record["summary"] = round_summary(record["rounds"], args.epochs)
                atomic_write_json(args.out, record)
                print(f"peers: {name}: test_acc {result['test_acc']:.4f}, train {result['train_seconds']:.1f} s, "
                      f"final eval {result['final_eval_seconds']:.1f} s, process {result['process_seconds']:.1f} s",
                      flush=True)
            if r == 0 and "speedrun" in record["peers"]:
                record["flops"] = flop_figures(record["peers"], args.peak_sizes)
                atomic_write_json(args.out, record)
    print(json.dumps(record.get("summary") or record.get("ratios_to_speedrun", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
