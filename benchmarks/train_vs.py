"""Whole-process `speedrun train RECIPE` of this checkout against another tree of speedrun (an
earlier commit), alternating between them on the same machine in the same session, so that
the VM's drift falls on both alike.

Each sample is one `python -m speedrun train` process with PYTHONPATH at either tree's src/,
timed from outside (interpreter start to exit), with its summary's train_seconds, per-epoch
seconds and accuracy. The order inside each round alternates (A B, B A, ...).

    git archive BASE_COMMIT src | tar -x -C /tmp/base
    python benchmarks/train_vs.py /tmp/base BASE_COMMIT fashion-mnist --rounds 3 \\
        --out benchmarks/results/train-vs-BASE-fashion-mnist-<cpu>.json [-- --set key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from speedrun.files import atomic_write_json
from speedrun.report.environment import environment
from train_cli import timed_train

HERE = Path(__file__).resolve().parents[1]


def one_run(tree: Path, recipe: str, extra: list[str], folder: Path, seed: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    env["SPEEDRUN_CACHE"] = str(folder / "cache")                 # cold decode cache, as a first run
    env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    cmd = [sys.executable, "-m", "speedrun", "train", recipe, "--seed", str(seed), "--out", str(folder / "run"), *extra]
    proc, wall, s, metrics = timed_train(cmd, env, folder / "run", cwd=tree)
    if proc.returncode:
        raise SystemExit(f"{tree}: speedrun train failed:\n{proc.stderr[-3000:]}")
    # the running total: seconds_total, or seconds where a tree's speedrun wrote the total under that name
    ends = [m.get("seconds_total", m.get("seconds")) for m in metrics if "seconds" in m]
    return {"process_wall_seconds": wall, "train_seconds": s["train_seconds"],
            "final_eval_seconds": s["final_eval_seconds"], "test_acc": s["test_acc"],
            "epoch_seconds": [b - a for a, b in zip([0.0] + ends, ends)], "git_commit": s.get("git_commit")}


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("other", type=Path, help="the other tree (holding src/speedrun)")
    p.add_argument("other_commit", help="the commit that tree was taken from (recorded)")
    p.add_argument("recipe")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv[:cut])
    extra = argv[cut + 1:]
    trees = {"this": HERE, "other": args.other.resolve()}
    samples: dict[str, list[dict]] = {"this": [], "other": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["other", "this"] if r % 2 == 0 else ["this", "other"]
            for name in order:
                folder = Path(tmp) / f"{name}{r}"
                sample = one_run(trees[name], args.recipe, extra, folder, seed=0)
                sample["round"], sample["position"] = r, order.index(name)
                samples[name].append(sample)
                print(f"round {r} {name}: process {sample['process_wall_seconds']:.1f} s, train "
                      f"{sample['train_seconds']:.1f} s, acc {sample['test_acc']:.4f}", flush=True)

    def med(name, key):
        return statistics.median(s[key] for s in samples[name])
    summary = {name: {k: med(name, k) for k in ("process_wall_seconds", "train_seconds", "final_eval_seconds")}
               for name in samples}
    summary["ratio_this_to_other_process"] = summary["this"]["process_wall_seconds"] / summary["other"]["process_wall_seconds"]
    record = {"benchmark": "speedrun train, whole process, this tree against another, alternating",
              "recipe": args.recipe, "extra": extra, "rounds": args.rounds,
              "other_tree_commit": args.other_commit, "medians": summary, "samples": samples,
              "environment": environment()}
    atomic_write_json(args.out, record)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
