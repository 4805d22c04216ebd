"""runtime.hold_memory on and off, side by side: whole `speedrun` processes, alternating.

Each round runs the same command twice, once with `--set runtime.hold_memory=off` (glibc's
defaults: blocks of 32 MiB or more mapped afresh and handed back) and once with it on (the
default on CPUs), in an order that alternates between rounds. Each process is measured from
outside: wall seconds from start to exit, minor page faults and peak resident memory (from
the kernel's accounting of the child, ``os.wait4``). With `flops` the model's FLOP/s over its
timed steps is read from its --json figures; with `train`, the summary's train seconds and
accuracy. Usage:

    .venv/bin/python benchmarks/hold_memory.py --rounds 3 --out benchmarks/results/hold-memory-....json \\
        -- flops cifar10-94 --steps 6 --set model.norm.fp32=false
    .venv/bin/python benchmarks/hold_memory.py --rounds 3 --out ... -- train fashion-mnist
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

from speedrun.files import atomic_write_json
from speedrun.report.environment import environment


def one(args: list[str], hold: str, folder: Path) -> dict:
    """One process of ``speedrun ARGS`` with runtime.hold_memory = ``hold``: its figures."""
    figures = folder / "figures.json"
    cmd = [sys.executable, "-m", "speedrun", *args, "--set", f"runtime.hold_memory={hold}"]
    cmd += ["--json", str(figures)] if args[0] == "flops" else ["--out", str(folder / "run")]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    row = {"hold_memory": hold, "process_seconds": wall, "minor_page_faults": usage.ru_minflt,
           "max_rss_mib": usage.ru_maxrss / 1024}
    if args[0] == "flops":
        f = json.loads(figures.read_text())
        row["model_flops_per_s"] = f["model_flops_per_s"]
        row["model_seconds_per_step"] = f["split"]["model_seconds_per_step"]
    else:
        s = json.loads((folder / "run" / "summary.json").read_text())
        row.update(train_seconds=s["train_seconds"], final_eval_seconds=s.get("final_eval_seconds"),
                   test_acc=s["test_acc"])
    return row


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv[:cut])
    env = environment()      # (the commit that runs, read before it runs)
    command = argv[cut + 1:]
    if not command or command[0] not in ("flops", "train"):
        p.error("after --: a `speedrun flops ...` or `speedrun train ...` command line (without `speedrun`)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for hold in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
                folder = Path(tmp) / f"{r}-{hold}"
                folder.mkdir()
                row = one(command, hold, folder)
                row["round"] = r
                rows.append(row)
                print(json.dumps(row), flush=True)
    keys = [k for k in rows[0] if k not in ("hold_memory", "round")]
    medians = {h: {k: statistics.median(x[k] for x in rows if x["hold_memory"] == h)
                   for k in keys if all(isinstance(x.get(k), (int, float)) for x in rows)}
               for h in ("off", "auto")}
    record = {
        "benchmark": "runtime.hold_memory off and on (auto), whole speedrun processes, alternating order",
        "command": "speedrun " + " ".join(command),
        "timed": "process_seconds: interpreter start to exit, from outside; minor_page_faults and max_rss_mib: "
                 "the kernel's accounting of the child (os.wait4); model_flops_per_s: `speedrun flops`'s timed "
                 "training steps",
        "rounds": args.rounds,
        "runs": rows,
        "medians": medians,
        "environment": env,
    }
    atomic_write_json(args.out, record)
    print(json.dumps(medians, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
