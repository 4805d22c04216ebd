"""speedrun's epoch on networks it did not design, against the plain PyTorch loop a user would write for
them: two of timm's networks (convnext_atto, mobilenetv3_small_100; from random weights) and a plain conv
net from a factory file this script writes, on a slice of CIFAR-10 at its 32 px.

Each system trains each network in its own fresh process, one after another, with the same threads:
``speedrun``: ``python -m speedrun train`` on a recipe this script writes (AdamW, label smoothing, random
flip and a 2-pixel translation, bf16 where the CPU computes it natively, speedrun's defaults otherwise);
``plain``: ``timm.create_model`` or the factory, ``torch.optim.AdamW``, a ``DataLoader`` over a
``TensorDataset``, the same augmentation per batch on tensors, ``torch.autocast`` in bf16 where native,
channels_last, the same batch, epochs, LR schedule and label smoothing. ``--runs K`` rounds, each round
every network and system once (the systems' order alternating round by round).

timm needs torchvision, which cannot be imported beside the CPU torch of .venv/; run it where both are:

    PYTHONPATH=$PWD/src .venv-2.14/bin/python benchmarks/any_network.py --train-images 10000 --epochs 2 \
        --runs 3 --threads 2 --out benchmarks/results/any-network-CPU-COMMIT.json [--note TEXT]
    ... --train-images 256 --test-images 256 --epochs 1 --runs 1 --narrow --out /tmp/smoke.json  (a smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NETWORKS = ("convnext_atto", "mobilenetv3_small_100", "custom")
SYSTEMS = ("speedrun", "plain")
MEAN, STD = (125.31, 122.95, 113.87), (62.99, 62.09, 66.70)      # CIFAR-10's, per channel, of 0..255
FACTORY = '''\
"""A plain conv net, as a user might write one: conv-BN-ReLU layers, pooled, then a linear classifier."""
import torch.nn as nn


def make(in_channels, num_classes, width=32):
    layers, c = [], in_channels
    for out, pool in ((width, False), (2 * width, True), (4 * width, True), (8 * width, True)):
        layers += [nn.Conv2d(c, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
        layers += [nn.MaxPool2d(2)] if pool else []
        c = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes))
'''
# each network's [model] table for speedrun and its constructor arguments for the plain loop; --narrow:
# the narrowest variant the script allows (for a smoke run: seconds, not minutes)
MODELS = {
    "convnext_atto": ({"arch": "convnext_atto"}, {"arch": "convnext_atto", "args": {"dims": [16, 32, 64, 128]}}),
    "mobilenetv3_small_100": ({"arch": "mobilenetv3_small_100"}, {"arch": "mobilenetv3_small_050"}),
    "custom": ({"args": {"width": 32}}, {"args": {"width": 8}}),
}
DEFINITIONS = {
    "epoch_seconds": "each epoch's training seconds as the system itself times it: speedrun's metrics.jsonl "
                     "'seconds' (the final evaluation left out), the plain loop's perf_counter around each epoch",
    "seconds_per_epoch": "the sum of epoch_seconds over the epochs (the first epoch's warm-up included; no "
                         "compiling: both run eager on a CPU, see compile)",
    "images_per_s": "training images (steps x batch) / the sum of epoch_seconds",
    "process_seconds": "the whole process from outside: interpreter start (imports, data, model) to exit",
    "process_cpu_seconds": "the CPU seconds (user + system) the whole process used (getrusage of the children)",
    "core_share": "process_cpu_seconds / (process_seconds x threads): near 1 where each thread had a core to "
                  "itself; other work on the machine lowers it (a contention gauge, per process)",
    "eval_seconds": "the final test-set evaluation (speedrun: final_eval_seconds), outside the epochs",
    "speedrun_over_plain": "per network: median speedrun seconds_per_epoch / median plain seconds_per_epoch "
                           "(below 1: speedrun's epoch is faster); per_round: the same within each round",
}


class Refusal(argparse.ArgumentParser):
    """An argument parser whose refusals are one line, ``any_network: error: ...``, exit code 2."""

    def error(self, message):
        raise SystemExit(f"any_network: error: {message}")


def parse(argv):
    p = Refusal(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--out", type=Path, required=True, help="the JSON record to write (never an existing file)")
    a("--data-dir", default=os.environ.get("SPEEDRUN_DATA") or str(REPO.parent / "shared" / "datasets"),
      help="the folder holding cifar-10-batches-py/ ($SPEEDRUN_DATA)")
    a("--train-images", type=int, default=10000, help="the first N training images")
    a("--test-images", type=int, default=10000, help="the first N test images")
    a("--epochs", type=int, default=2)
    a("--runs", type=int, default=3, help="rounds; each round trains every network with every system once")
    a("--batch-size", type=int, default=128)
    a("--lr", type=float, default=2e-3, help="AdamW's per-step LR at the schedule's peak")
    a("--weight-decay", type=float, default=0.05)
    a("--threads", type=int, default=2, help="torch threads in every process")
    a("--networks", default=",".join(NETWORKS), help=f"which, in order, from {', '.join(NETWORKS)}")
    a("--narrow", action="store_true", help="the narrowest widths (a smoke run)")
    a("--seed", type=int, default=0)
    a("--note", default="", help="a note kept in the record (e.g. that the machine was shared)")
    a("--child", choices=["plain"], help=argparse.SUPPRESS)
    a("--network", help=argparse.SUPPRESS)
    a("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.network_list = [n for n in args.networks.split(",") if n]
    if any(n not in NETWORKS for n in args.network_list) or len(set(args.network_list)) != len(args.network_list) \
            or not args.network_list:
        p.error(f"--networks {args.networks}: give names from {', '.join(NETWORKS)}, each once")
    for name in ("runs", "epochs", "batch_size", "threads", "test_images"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if not 0 < args.batch_size <= args.train_images <= 50000 or args.test_images > 10000:
        p.error(f"--train-images {args.train_images}: give at least --batch-size ({args.batch_size}) and at most "
                f"50,000 (and --test-images at most 10,000)")
    if args.lr <= 0:
        p.error(f"--lr {args.lr}: give a positive LR")
    if not args.child and args.out.exists():            # (before any import: speedrun's own check follows)
        p.error(f"--out {args.out}: already exists; choose another name so that it is not overwritten")
    return args


def model_spec(args, network: str) -> dict:
    return MODELS[network][1 if args.narrow else 0]


def lr_multiplier(progress: float) -> float:
    """The schedule both systems follow (speedrun's piecewise one, knots 0, 0.2, 1): linear from 0.1 to 1 over
    the first fifth of the steps, then linearly down to 0; ``progress`` = steps done / all steps."""
    return 0.1 + 0.9 * progress / 0.2 if progress < 0.2 else max(0.0, (1 - progress) / 0.8)


# --- speedrun ----------------------------------------------------------------------------------

def speedrun_recipe(args, network: str, work: Path) -> Path:
    spec = model_spec(args, network)
    model = {"name": "timm", "arch": spec["arch"]} if network != "custom" else \
        {"name": "custom", "factory": f"{work / 'plain_net.py'}:make"}
    lines = ['name = "any-network"', f'description = "{network} on CIFAR-10 at 32 px"', "target = 1.0", "",
             "[data]", 'dataset = "npz"', f"batch_size = {args.batch_size}", "",
             "[augment]", 'flip = "random"', 'crop = "translate"', "translate = 2", "",
             "[optim]", 'name = "adamw"', f"lr = {args.lr!r}", f"ref_batch = {args.batch_size}",
             f"weight_decay = {args.weight_decay!r}", "",
             "[schedule]", 'kind = "piecewise"', "knots = [0.0, 0.2, 1.0]", "values = [0.1, 1.0, 0.0]", "",
             "[train]", f"epochs = {args.epochs}", "label_smoothing = 0.1", f"seed = {args.seed}", "",
             "[eval]", "every = 0", "batch_size = 500", 'tta = "none"', "",
             "[runtime]", f"threads = {args.threads}", "",
             "[model]", *(f"{k} = {json.dumps(v)}" for k, v in model.items())]
    if spec.get("args"):
        lines.append("args = {" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in spec["args"].items()) + "}")
    path = work / f"{network}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def child_cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_process(cmd: list[str], threads: int, log: Path) -> tuple[float, float]:
    """``cmd`` with ``threads`` OpenMP threads, its output in ``log``: its wall seconds, start to exit, and the
    CPU seconds (user + system) it and its children used (one process at a time, so the difference of this
    script's children's usage)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(log, "w") as out:
        t, cpu = time.perf_counter(), child_cpu_seconds()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent).returncode
        wall, cpu = time.perf_counter() - t, child_cpu_seconds() - cpu
    if rc:
        raise SystemExit(f"any_network: error: {' '.join(cmd)} failed with exit code {rc}; the end of its output "
                         f"({log}):\n" + log.read_text()[-3000:])
    return wall, cpu


def run_speedrun(args, network: str, work: Path, tag: str) -> dict:
    folder = work / f"speedrun-{tag}"
    cmd = [sys.executable, "-m", "speedrun", "train", str(speedrun_recipe(args, network, work)), "--data-dir",
           str(work / "slice.npz"), "--device", "cpu", "--out", str(folder)]
    wall, cpu = run_process(cmd, args.threads, work / f"speedrun-{tag}.log")
    s = json.loads((folder / "summary.json").read_text())
    epochs = [json.loads(line)["seconds"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    start = [line for line in (work / f"speedrun-{tag}.log").read_text().splitlines() if line.startswith("speedrun: ")]
    return figures("speedrun", epochs, s["steps"], s["batch_size"], s["test_acc"], s["final_eval_seconds"], wall,
                   cpu, precision=s["precision"], threads=s["torch_threads"], compile=s["compile"],
                   compile_seconds=s["compile_seconds"], channels_last=s["channels_last"],
                   train_seconds=s["train_seconds"], start_lines=start, command=" ".join(cmd))


def figures(system, epochs, steps, batch, acc, eval_s, wall, cpu, **extra) -> dict:
    seconds = sum(epochs)
    return {"system": system, "seconds_per_epoch": seconds / len(epochs), "epoch_seconds": epochs,
            "images_per_s": steps * batch / seconds, "process_seconds": wall, "process_cpu_seconds": cpu,
            "core_share": cpu / (wall * extra["threads"]) if wall else None, "test_acc": acc, "eval_seconds": eval_s, "steps": steps,
            "batch_size": batch, **extra}


# --- the plain loop, in its own process -------------------------------------------------------

def augment(x, torch, F):
    """A random horizontal flip and a random shift of up to 2 pixels (reflect-padded), per image of the batch."""
    n, _, h, w = x.shape
    x = torch.where(torch.rand(n, 1, 1, 1) < 0.5, x.flip(3), x)
    padded = F.pad(x, (2, 2, 2, 2), mode="reflect")
    dy, dx = torch.randint(0, 5, (n, 1, 1)), torch.randint(0, 5, (n, 1, 1))
    rows, cols = dy + torch.arange(h).view(1, h, 1), dx + torch.arange(w).view(1, 1, w)
    return padded[torch.arange(n).view(n, 1, 1), :, rows, cols].permute(0, 3, 1, 2)


def plain(args, work: Path) -> dict:
    """Train and test ``args.network`` as a user would with PyTorch alone; its figures."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from speedrun.compat import cpu_bf16_units

    torch.set_num_threads(args.threads)
    arrays = np.load(work / "slice.npz")
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    xtr, xte = ((torch.from_numpy(arrays[k]).float() - mean) / std for k in ("x_train", "x_test"))
    ytr, yte = (torch.from_numpy(arrays[k]).long() for k in ("y_train", "y_test"))
    spec, bf16 = model_spec(args, args.network), bool(cpu_bf16_units())
    torch.manual_seed(args.seed)
    if args.network == "custom":
        sys.path.insert(0, str(work))
        from plain_net import make
        model = make(3, 10, **spec.get("args", {}))
    else:
        import timm
        model = timm.create_model(spec["arch"], pretrained=False, num_classes=10, **spec.get("args", {}))
    model = model.to(memory_format=torch.channels_last)
    decay = [p for p in model.parameters() if p.ndim > 1]              # no decay on biases and norms
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr)
    loader = DataLoader(TensorDataset(xtr, ytr), batch_size=args.batch_size, shuffle=True, drop_last=True)
    total = len(loader) * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_multiplier(step / total))
    epochs, steps = [], 0
    for _ in range(args.epochs):
        model.train()
        t = time.perf_counter()
        for x, y in loader:
            x = augment(x, torch, F).contiguous(memory_format=torch.channels_last)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
        epochs.append(time.perf_counter() - t)
    model.eval()
    t, right = time.perf_counter(), 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for i in range(0, len(xte), 500):
            x = xte[i:i + 500].contiguous(memory_format=torch.channels_last)
            right += int((model(x).argmax(1) == yte[i:i + 500]).sum())
    return figures("plain", epochs, steps, args.batch_size, right / len(xte), time.perf_counter() - t, None, None,
                   precision="bf16" if bf16 else "fp32", threads=torch.get_num_threads(), compile=False,
                   channels_last=True, optimizer="torch.optim.AdamW", loader="DataLoader(TensorDataset, shuffle=True, "
                   "drop_last=True), no workers")


def run_plain(args, argv, network: str, work: Path, tag: str) -> dict:
    result = work / f"plain-{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", "plain", "--network", network,
           "--work", str(work)]
    wall, cpu = run_process(cmd + ["--out", str(result)], args.threads, work / f"plain-{tag}.log")
    return {**json.loads(result.read_text()), "process_seconds": wall, "process_cpu_seconds": cpu,
            "core_share": cpu / (wall * args.threads), "command": " ".join(cmd)}


# --- the record --------------------------------------------------------------------------------

def write_slice(args, work: Path) -> None:
    """The first --train-images and --test-images of CIFAR-10, as the npz both systems read."""
    import numpy as np

    from speedrun.data import load_dataset
    ds = load_dataset("cifar10", args.data_dir, fetch=False)
    np.savez(work / "slice.npz", x_train=ds.train_x[:args.train_images].numpy(),
             y_train=ds.train_y[:args.train_images].numpy(), x_test=ds.test_x[:args.test_images].numpy(),
             y_test=ds.test_y[:args.test_images].numpy())
    (work / "plain_net.py").write_text(FACTORY)


def summarise(rounds: list[dict], networks: list[str]) -> dict:
    out = {}
    for net in networks:
        row = out[net] = {}
        for system in SYSTEMS:
            runs = [r[net][system] for r in rounds if system in r.get(net, {})]
            if runs:
                row[system] = {k: statistics.median(p[k] for p in runs) for k in
                               ("seconds_per_epoch", "images_per_s", "process_seconds", "process_cpu_seconds",
                                "core_share", "test_acc", "eval_seconds")}
                row[system]["runs"] = len(runs)
        if len(row) == 2:
            row["speedrun_over_plain"] = row["speedrun"]["seconds_per_epoch"] / row["plain"]["seconds_per_epoch"]
            row["per_round"] = [r[net]["speedrun"]["seconds_per_epoch"] / r[net]["plain"]["seconds_per_epoch"]
                                for r in rounds if len(r.get(net, {})) == 2]
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.child:
        from speedrun.files import atomic_write_json
        atomic_write_json(args.out, plain(args, args.work))
        return 0
    from speedrun.compat import cpu_bf16_units
    from speedrun.errors import SpeedrunError
    from speedrun.files import atomic_write_json, check_output_file
    from speedrun.report.environment import machine
    try:
        check_output_file(args.out, "--out")
    except SpeedrunError as err:
        raise SystemExit(f"any_network: error: {err}")
    if not (Path(args.data_dir) / "cifar-10-batches-py").is_dir():
        raise SystemExit(f"any_network: error: --data-dir {args.data_dir}: no cifar-10-batches-py/ there; give "
                         "the folder that holds CIFAR-10 ($SPEEDRUN_DATA)")
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec("timm") is None or importlib.util.find_spec("torchvision") is None:
        raise SystemExit("any_network: error: timm is not installed beside this torch; run with the Python of a "
                         "venv that has timm and torchvision (.venv-2.14)")
    import torch
    child_argv = [a for i, a in enumerate(argv) if a != "--out" and (i == 0 or argv[i - 1] != "--out")]
    child_argv = [a for a in child_argv if not a.startswith("--out=")]
    record = {"benchmark": "speedrun train against a plain PyTorch loop on networks speedrun did not design",
              "note": args.note, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "networks": args.network_list, "narrow": args.narrow,
              "models": {n: model_spec(args, n) for n in args.network_list},
              "train_images": args.train_images, "test_images": args.test_images, "epochs": args.epochs,
              "batch_size": args.batch_size, "lr": args.lr, "weight_decay": args.weight_decay,
              "schedule": "piecewise linear: 0.1x at step 0, 1x at 20% of the steps, 0 at the end",
              "augmentation": "random horizontal flip, random 2-pixel shift (reflect-padded), per image",
              "label_smoothing": 0.1, "threads": args.threads, "seed": args.seed,
              "bf16_units": list(cpu_bf16_units()), "timm_version": importlib.metadata.version("timm"), "torch": torch.__version__,
              "data": args.data_dir, "definitions": DEFINITIONS, "environment": machine(), "rounds": []}
    with tempfile.TemporaryDirectory(prefix="any-network-") as tmp:
        work = Path(tmp)
        write_slice(args, work)
        for r in range(args.runs):
            done = {"order": list(SYSTEMS) if r % 2 == 0 else list(reversed(SYSTEMS))}
            record["rounds"].append(done)
            for net in args.network_list:
                done[net] = {}
                for system in done["order"]:
                    print(f"any_network: round {r + 1}/{args.runs}: {net}, {system} ...", flush=True)
                    tag = f"{net}-{r}"
                    res = (run_speedrun(args, net, work, tag) if system == "speedrun"
                           else run_plain(args, child_argv, net, work, tag))
                    done[net][system] = res
                    record["summary"] = summarise(record["rounds"], args.network_list)
                    atomic_write_json(args.out, record)
                    print(f"any_network: {net}, {system}: {res['seconds_per_epoch']:.2f} s/epoch, "
                          f"{res['images_per_s']:.0f} images/s, test_acc {res['test_acc']:.4f}, "
                          f"process {res['process_seconds']:.1f} s", flush=True)
    print(json.dumps(record["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
