"""speedrun against the training loops a careful engineer would write without it: the same
cifar10-94 algorithm trained three ways, one after another, each in its own fresh process,
with the same number of torch threads:

- plain:     eager PyTorch from the tutorials (torch.optim.SGD with parameter groups, a LambdaLR
             stepped every batch, bf16 autocast where the CPU computes bf16 natively,
             channels_last, whole-batch augmentation of uint8 tensors in memory): :func:`train_plain`;
- lightning: the same algorithm as a LightningModule under lightning.Trainer (peer_algorithm.py);
- speedrun:  ``python -m speedrun train cifar10-94 --set train.epochs=E --device cpu``.

The plain and Lightning peers share one implementation of the algorithm (peer_algorithm.py):
speedrun's network built by ``speedrun.models.build_model`` from the recipe (identical kernels)
and whitened by its own ``whiten.fit`` on the same images, and everything else rewritten in
plain torch from the recipe's numbers. tests/test_peers.py checks that their steps give
speedrun's ``TrainStep``'s weights. Usage:

    python benchmarks/peers.py --epochs 9.9 --out benchmarks/results/peers-<cpu>.json \\
        [--peers plain,lightning,speedrun] [--set key=value ...] [--precision auto|bf16|fp32] [--rounds N]
    python benchmarks/peers.py --epochs 1 --limit-train 2048 --limit-test 1000 --out /tmp/smoke.json  # smoke

What each figure covers is in the record's ``definitions`` (:data:`DEFINITIONS`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

STARTED = time.perf_counter()       # (before torch's import: a child's seconds_before_training include it)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_algorithm import (CHANNELS_LAST, Algorithm, Clock, EvalBatches, Normalise, TrainBatches,  # noqa: E402
                            autocast_for, evaluate, load_cifar10, make_lookahead, make_optimizer)
from speedrun.compat import cpu_bf16_units  # noqa: E402
from speedrun.files import atomic_write_json  # noqa: E402
from speedrun.models import build_model  # noqa: E402
from speedrun.recipe import load_recipe  # noqa: E402

RECIPE = "cifar10-94"
REPO = Path(__file__).resolve().parents[1]
PEERS = ("plain", "lightning", "speedrun")

DEFINITIONS = {
    "process_seconds": "wall time of the peer's whole process, measured from outside: from just before this script "
                       "started its Python interpreter to the process's exit (interpreter start, imports, loading "
                       "CIFAR-10, building the model, training, the final evaluation; for speedrun also checking the "
                       "files' MD5 sums, writing its run folder, its FLOP count and a matmul peak measurement)",
    "train_seconds": "speedrun's train_seconds region in every peer: from the first touch of the training data "
                     "(channel statistics, the whitening fit) to the final accuracy with TTA; monitoring evaluations "
                     "after each epoch are paused out (monitor_seconds)",
    "final_eval_seconds": "the final evaluation of the test set with the recipe's TTA (6 views), with the averaged "
                          "weights, measured inside each run (lightning: the whole Trainer.test call; speedrun: "
                          "summary.json's final_eval_seconds)",
    "train_seconds_without_final_eval": "train_seconds - final_eval_seconds",
    "epoch_seconds": "training seconds of each epoch (monitoring paused out); the first includes the first touch of "
                     "the data, none includes the final evaluation (speedrun's last is its recorded figure minus "
                     "its final_eval_seconds; epoch_seconds_as_recorded keeps the recorded ones)",
    "images_per_s": "training images (steps x batch) / train_seconds_without_final_eval",
    "monitor_seconds": "the per-epoch monitoring evaluations (no TTA, averaged weights), outside train_seconds",
    "seconds_before_training": "plain and lightning: from the start of the peer's script (before its imports) to "
                               "the first touch of the data: imports, loading CIFAR-10, building the model and the "
                               "optimizer (plain; its first torch.optim optimizer imports torch._dynamo and sympy) "
                               "or the Trainer (lightning), as speedrun builds its session before its clock",
    "rounds": "with --rounds N: every peer run N times, round r in --peers order rotated left by r; each "
              "round's figures and ratios",
    "summary": "with --rounds N: per peer the median over rounds of seconds_per_epoch "
               "(train_seconds_without_final_eval / epochs), final_eval_seconds, train_seconds, process_seconds "
               "and images_per_s, and speedrun's medians over the fastest other peer's",
    "ratios_to_speedrun": "peer / speedrun: above 1 the peer took longer (seconds) or trained more images per "
                          "second (images_per_s)",
}


# ==========================================================================================
# The plain peer
# ==========================================================================================

def train_plain(model: nn.Module, algo: Algorithm, optimizer, batches, precision: str = "fp32",
                clock: Clock | None = None, monitor_batches=None) -> list[float]:
    """The plain PyTorch loop: ``algo.total_steps`` steps over ``batches`` (an iterable, one
    pass per epoch) with ``optimizer`` (SGD and its LambdaLR, from :func:`make_optimizer`),
    then the averaged weights left in ``model``. After each epoch but the last, with
    ``monitor_batches()``, the accuracy of the averaged weights (returned, one per epoch), its
    time paused out of ``clock``."""
    opt, schedule = optimizer
    lookahead = make_lookahead(model, algo)        # (the average starts from the fitted whitening)
    model.train()
    step, monitor_acc = 0, []
    for epoch in range(algo.epochs):
        for x, y in batches:
            with autocast_for(precision):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=algo.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            step += 1
            if lookahead is not None:
                lookahead.update(step)
            if step == algo.total_steps:
                break
        if clock is not None:
            clock.mark_epoch()
        if monitor_batches is not None and algo.monitors_after(epoch):
            with clock.pause() if clock is not None else nullcontext(), \
                    lookahead.applied() if lookahead is not None else nullcontext():
                monitor_acc.append(evaluate(model, monitor_batches(), "none", lambda: autocast_for(precision))[1])
    if lookahead is not None:
        lookahead.finalize()
    return monitor_acc


def peer_model(recipe, seed: int) -> nn.Module:
    """speedrun's network for the recipe, initialised from ``seed`` as speedrun initialises it."""
    torch.manual_seed(seed)
    return build_model(recipe.model, 3, 10).to(memory_format=CHANNELS_LAST)


def first_touch(model: nn.Module, data, algo: Algorithm) -> tuple[Normalise, TrainBatches]:
    """The first touch of the training data, as speedrun's clock counts it: the channel
    statistics, the whitening fit on the first ``whiten.samples`` images, the batch maker."""
    normalise = Normalise(data.train_x)
    if getattr(model, "whiten", None) is not None:
        model.whiten.fit(normalise(data.train_x[:algo.whiten_samples]))
    batches = TrainBatches(data.train_x, data.train_y, normalise, algo.batch_size, algo.translate, algo.flip,
                           algo.seed)
    return normalise, batches


def run_peer(name: str, recipe, data, precision: str) -> dict:
    """Train and evaluate one peer ("plain" or "lightning") in this process; its figures."""
    algo = Algorithm.from_recipe(recipe, len(data.train_y))
    model = peer_model(recipe, algo.seed)
    if name == "lightning":
        import lightning
        from peer_algorithm import final_accuracy, lightning_precision, make_trainer, train_lightning
        trainer = make_trainer(algo, precision)
    else:
        # built before the clock, as speedrun builds its optimizer before its clock; the first
        # torch.optim optimizer of a process imports torch._dynamo and sympy (about a second)
        optimizer = make_optimizer(model, algo)
    before = time.perf_counter() - STARTED
    clock = Clock()
    normalise, batches = first_touch(model, data, algo)
    monitor = (lambda: EvalBatches(data, normalise, algo.eval_batch)) if algo.monitor_every else None
    test = EvalBatches(data, normalise, algo.eval_batch)
    extra = {}
    if name == "plain":
        monitor_acc = train_plain(model, algo, optimizer, batches, precision, clock, monitor)
        trained = clock.seconds()
        acc_tta, acc = evaluate(model, test, algo.tta, lambda: autocast_for(precision))
        extra["autocast"] = "torch.autocast('cpu', dtype=torch.bfloat16)" if precision == "bf16" else None
    else:
        trainer, module = train_lightning(model, algo, batches, precision, clock, monitor, trainer)
        trained = clock.seconds()
        acc_tta, acc = final_accuracy(trainer, module, test)
        monitor_acc = module.monitor_acc
        extra = {"lightning_version": lightning.__version__, "trainer_precision": lightning_precision(precision),
                 "trainer": "Trainer(accelerator='cpu', devices=1, barebones=True, max_epochs, max_steps, "
                            "inference_mode=True); batches as a plain iterable"}
    total = clock.seconds()
    images = algo.total_steps * algo.batch_size
    return {"peer": name, "precision": precision, "threads": torch.get_num_threads(), **extra,
            "seconds_before_training": before, "train_seconds": total, "final_eval_seconds": total - trained,
            "train_seconds_without_final_eval": trained, "monitor_seconds": clock.paused,
            "epoch_seconds": clock.epoch_seconds(), "steps": algo.total_steps, "images_trained": images,
            "images_per_s": images / trained, "test_acc": acc_tta, "test_acc_no_tta": acc,
            "monitor_test_acc": monitor_acc, "flip": algo.flip, "algorithm": algo.describe()}


# ==========================================================================================
# speedrun
# ==========================================================================================

def run_speedrun(args, work: Path, env: dict, data_arg: str, tag: str = "") -> dict:
    """``speedrun train`` as a subprocess (its run folder ``work/speedrun-run{tag}``), its
    figures from summary.json and metrics.jsonl."""
    run_dir = work / f"speedrun-run{tag}"
    sets = [f"train.epochs={args.epochs!r}", *args.sets]
    if args.precision != "auto":
        sets.append(f"runtime.precision={args.precision}")
    if args.limit_train or args.limit_test:
        sets.append("data.dataset=npz")
    cmd = [sys.executable, "-m", "speedrun", "train", RECIPE, *[a for s in sets for a in ("--set", s)],
           "--device", "cpu", "--out", str(run_dir), "--data-dir", data_arg]
    wall = run_process(cmd, env, work / f"speedrun{tag}.log")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final_eval = summary["final_eval_seconds"]                # timed inside the run, as the peers time theirs
    recorded = [m["seconds"] for m in metrics]                # each epoch's own training seconds
    train = summary["train_seconds"]
    images = summary["steps"] * summary["batch_size"]
    return {"peer": "speedrun", "precision": summary["precision"], "threads": summary["torch_threads"],
            "command": " ".join(cmd), "process_seconds": wall, "train_seconds": train,
            "final_eval_seconds": final_eval,
            "train_seconds_without_final_eval": train - final_eval, "monitor_seconds": summary["monitor_seconds"],
            "bookkeeping_seconds": summary["bookkeeping_seconds"],
            "epoch_seconds": recorded[:-1] + [recorded[-1] - final_eval], "epoch_seconds_as_recorded": recorded,
            "steps": summary["steps"], "images_trained": images, "images_per_s": images / (train - final_eval),
            "test_acc": summary["test_acc"], "test_acc_no_tta": summary["test_acc_no_tta"],
            "monitor_test_acc": [m["test_acc"] for m in metrics[:-1]], "flip": "alternating (the recipe's)",
            "summary": summary}


# ==========================================================================================
# The record
# ==========================================================================================

def run_process(cmd: list[str], env: dict, log: Path) -> float:
    """Run ``cmd`` with its output in ``log``; its wall seconds, from before the start to the exit."""
    with open(log, "w") as out:
        t = time.perf_counter()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
        wall = time.perf_counter() - t
    if rc:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"peers: {' '.join(cmd)} failed with exit code {rc}; the end of its output ({log}):\n{tail}")
    return wall


def ratios(peers: dict) -> dict:
    s = peers.get("speedrun")
    if s is None:
        return {}
    keys = ("process_seconds", "train_seconds", "train_seconds_without_final_eval", "final_eval_seconds",
            "monitor_seconds", "images_per_s")
    out = {}
    for name, p in peers.items():
        if name != "speedrun":
            out[name] = {k: p[k] / s[k] if s[k] else None for k in keys}
            out[name]["epoch_seconds"] = [a / b for a, b in zip(p["epoch_seconds"], s["epoch_seconds"])]
    return out


def flop_figures(peers: dict) -> dict:
    """speedrun's FLOP count and utilisation from its summary.json, the same count divided by
    each peer's seconds (the algorithm, hence the arithmetic, is the same), and a second look
    at the peak with larger matrices."""
    from speedrun.engine.flops import measured_peak
    s = peers["speedrun"]["summary"]
    est = peers["speedrun"]["train_seconds_without_final_eval"]
    recheck = {}
    if s["precision"] == "fp32" or cpu_bf16_units():                 # (emulated bf16 would take minutes)
        recheck = {str(n): measured_peak("cpu", s["precision"], size=n) for n in (1024, 2048)}
    return {
        "count": "torch's FlopCounterMode on the recipe's model (speedrun.engine.flops): per image, forward and "
                 "forward+backward, times the images trained and evaluated (the final evaluation's 6 TTA views)",
        **{k: s.get(k) for k in ("flops_per_train_image", "flops_per_forward_image", "train_flops", "eval_flops",
                                 "total_flops", "achieved_flops_per_s", "peak_flops_per_s", "peak_source",
                                 "utilisation", "ideal_seconds")},
        "peak_precision": s["precision"],
        "peak_how": "speedrun.engine.flops.measured_peak, in the speedrun process after training: the best of 2 "
                    "trials of 5 back-to-back n x n matrix products in the run's precision (n = 512 for bf16, "
                    "1024 for fp32 on a CPU), 2n^3 FLOP each; a measured lower bound of the peak, not the "
                    "datasheet figure (none is known for CPUs), so utilisation above 1 is possible",
        "achieved_flops_per_s_meaning": "total_flops / train_seconds (training and the final TTA evaluation)",
        "speedrun_training_flops_per_s": s["train_flops"] / est if est > 0 else None,
        "speedrun_training_utilisation": (s["train_flops"] / est / s["peak_flops_per_s"]
                                          if est > 0 and s.get("peak_flops_per_s") else None),
        "achieved_flops_per_s_by_peer": {k: s["total_flops"] / p["train_seconds"] for k, p in peers.items()},
        "peak_recheck_flops_per_s_by_size": recheck,
    }


MEDIAN_KEYS = ("seconds_per_epoch", "final_eval_seconds", "train_seconds", "process_seconds", "images_per_s")


def rotated(peers: list[str], r: int) -> list[str]:
    """The order of round ``r``: ``peers`` rotated left by ``r``."""
    k = r % len(peers)
    return peers[k:] + peers[:k]


def round_summary(rounds: list[dict], epochs: float) -> dict:
    """Per peer, the median over rounds of: seconds per epoch (training without the final
    evaluation, divided by the epochs), the final TTA evaluation, train_seconds, the whole
    process and images/s; and whether speedrun's median per epoch and for its TTA evaluation
    is at most the fastest other peer's (issue 16's bar)."""
    import statistics
    names = list(rounds[0]["peers"])
    out = {"medians": {}, "runs": {}}
    for name in names:
        runs = [r["peers"][name] for r in rounds if name in r["peers"]]
        values = {"seconds_per_epoch": [p["train_seconds_without_final_eval"] / epochs for p in runs],
                  **{k: [p[k] for p in runs] for k in MEDIAN_KEYS if k != "seconds_per_epoch"},
                  "test_acc": [p["test_acc"] for p in runs]}
        out["runs"][name] = values
        out["medians"][name] = {k: statistics.median(v) for k, v in values.items()}
    others = [n for n in names if n != "speedrun"]
    if "speedrun" in names and others:
        m = out["medians"]
        fastest_epoch = min(others, key=lambda n: m[n]["seconds_per_epoch"])
        fastest_eval = min(others, key=lambda n: m[n]["final_eval_seconds"])
        out["fastest_peer_per_epoch"] = fastest_epoch
        out["fastest_peer_final_eval"] = fastest_eval
        out["speedrun_over_fastest_per_epoch"] = m["speedrun"]["seconds_per_epoch"] / m[fastest_epoch]["seconds_per_epoch"]
        out["speedrun_over_fastest_final_eval"] = m["speedrun"]["final_eval_seconds"] / m[fastest_eval]["final_eval_seconds"]
        out["speedrun_at_most_fastest_peer"] = (out["speedrun_over_fastest_per_epoch"] <= 1.0
                                                and out["speedrun_over_fastest_final_eval"] <= 1.0)
    return out


def child_args(args, precision: str) -> list[str]:
    out = ["--epochs", repr(args.epochs), "--data-dir", args.data_dir, "--precision", precision,
           "--threads", str(args.threads), *[a for s in args.sets for a in ("--set", s)]]
    for flag, value in (("--limit-train", args.limit_train), ("--limit-test", args.limit_test)):
        if value:
            out += [flag, str(value)]
    return out


def smoke_npz(args, work: Path) -> str:
    """The data slice of a smoke run as an .npz, for speedrun (which trains what --data-dir names)."""
    d = load_cifar10(args.data_dir, args.limit_train, args.limit_test)
    path = work / "cifar10-slice.npz"
    np.savez(path, x_train=d.train_x.numpy(), y_train=d.train_y.numpy(), x_test=d.test_x.numpy(),
             y_test=d.test_y.numpy(), classes=np.array([str(i) for i in range(10)]))
    return str(path)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=float, required=True, help="train.epochs for every peer (9.9: the full recipe)")
    p.add_argument("--out", type=Path, help="the JSON record to write")
    p.add_argument("--peers", default=",".join(PEERS), help="which peers, in order (default: all)")
    p.add_argument("--data-dir", default=os.environ.get("SPEEDRUN_DATA") or str(REPO.parent / "shared" / "datasets"),
                   help="the folder holding cifar-10-batches-py/ (default: $SPEEDRUN_DATA, ../shared/datasets)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every peer (smoke runs: e.g. model.widths=[16,32,32])")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 where the CPU computes it natively (speedrun's rule), else fp32")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads in every peer")
    p.add_argument("--limit-train", type=int, help="smoke runs: only the first N training images")
    p.add_argument("--limit-test", type=int, help="smoke runs: only the first N test images")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every peer this many times, the order rotated by one each round (round r starts "
                        "with peer r of --peers), and record per-peer medians: the VM's drift then falls on all")
    p.add_argument("--keep-runs", type=Path, help="keep the peers' logs and speedrun's run folder here")
    p.add_argument("--child", choices=["plain", "lightning"], help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def overrides(args) -> list[str]:
    return [f"train.epochs={args.epochs!r}", *args.sets]


def child_main(args) -> int:
    torch.set_num_threads(args.threads)
    data = load_cifar10(args.data_dir, args.limit_train, args.limit_test)
    result = run_peer(args.child, load_recipe(RECIPE, overrides(args)), data, args.precision)
    atomic_write_json(args.result, result)
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args)
    if args.out is None:
        raise SystemExit("peers: --out FILE.json is required")
    peers = args.peers.split(",")
    if not peers or any(p not in PEERS for p in peers) or len(set(peers)) != len(peers):
        raise SystemExit(f"peers: --peers takes a comma-separated selection of {', '.join(PEERS)}")
    from peer_algorithm import check_supported
    from speedrun.report.environment import machine
    recipe = load_recipe(RECIPE, overrides(args))
    check_supported(recipe)
    precision = args.precision if args.precision != "auto" else ("bf16" if cpu_bf16_units() else "fp32")
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    smoke = bool(args.limit_train or args.limit_test)
    record = {"benchmark": "speedrun against a plain PyTorch loop and a Lightning Trainer, same algorithm",
              "recipe": RECIPE, "overrides": overrides(args), "epochs": args.epochs, "threads": args.threads,
              "precision": precision, "bf16_units": list(cpu_bf16_units()), "smoke": smoke,
              "limit_train": args.limit_train, "limit_test": args.limit_test, "order": peers,
              "definitions": DEFINITIONS, "environment": machine(), "peers": {}}
    if args.rounds < 1:
        raise SystemExit("peers: --rounds must be at least 1")
    if args.rounds > 1:
        record["rounds"] = []
    try:
        data_arg = smoke_npz(args, work) if smoke and "speedrun" in peers else args.data_dir
        for r in range(args.rounds):
            order = rotated(peers, r)
            if args.rounds > 1:
                record["rounds"].append({"order": order, "peers": {}})
            for name in order:
                print(f"peers: round {r + 1}/{args.rounds}: {name} ...", flush=True)
                if name == "speedrun":
                    result = run_speedrun(args, work, env, data_arg, f"-{r + 1}" if r else "")
                else:
                    tag = f"-{r + 1}" if r else ""
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name,
                           "--result", str(work / f"{name}{tag}.json"), *child_args(args, precision)]
                    wall = run_process(cmd, env, work / f"{name}{tag}.log")
                    result = {**json.loads((work / f"{name}{tag}.json").read_text()), "process_seconds": wall,
                              "command": " ".join(cmd)}
                if r == 0:                                 # the first round, as a one-round record has it
                    record["peers"][name] = result
                    record["ratios_to_speedrun"] = ratios(record["peers"])
                if args.rounds > 1:
                    record["rounds"][-1]["peers"][name] = result
                    record["rounds"][-1]["ratios_to_speedrun"] = ratios(record["rounds"][-1]["peers"])
                    record["summary"] = round_summary(record["rounds"], args.epochs)
                atomic_write_json(args.out, record)
                print(f"peers: {name}: test_acc {result['test_acc']:.4f}, train {result['train_seconds']:.1f} s, "
                      f"final eval {result['final_eval_seconds']:.1f} s, process {result['process_seconds']:.1f} s",
                      flush=True)
            if r == 0 and "speedrun" in record["peers"]:
                record["flops"] = flop_figures(record["peers"])
                atomic_write_json(args.out, record)
    finally:
        if args.keep_runs:
            shutil.copytree(work, args.keep_runs, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(record.get("summary") or record.get("ratios_to_speedrun", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
