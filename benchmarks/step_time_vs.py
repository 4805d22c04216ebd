"""CPU seconds per training step of this checkout against another checkout of speedrun (an
earlier commit), on the same machine in the same session, alternating between them.

Each sample is one `speedrun flops RECIPE --steps N` process (the data/model time split: the
model part is the training step, synchronised, after the warm-up), run with PYTHONPATH at
either tree's src/. Both trees run the recipe's CPU default (fp32, eager) unless --set says
otherwise.

    git archive BASE_COMMIT src | tar -x -C /tmp/base        # the other tree
    python benchmarks/step_time_vs.py /tmp/base BASE_COMMIT --recipe cifar10-94 --recipe fashion-mnist \
        --rounds 3 --steps 10 --out benchmarks/results/step-time-eager-vs-BASE-<cpu>.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from speedrun.files import atomic_write_json
from speedrun.report.environment import environment

HERE = Path(__file__).resolve().parents[1]


def sample(src: Path, recipe: str, steps: int, sets: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "flops.json"
        env = {**os.environ, "PYTHONPATH": str(src)}
        cmd = [sys.executable, "-m", "speedrun", "flops", recipe, "--device", "cpu", "--steps", str(steps),
               "--json", str(out), *sum((["--set", s] for s in sets), [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode:
            raise SystemExit(f"{src}: {proc.stderr[-2000:]}")
        split = json.loads(out.read_text())["split"]
    return {"model_seconds_per_step": split["model_seconds_per_step"],
            "data_seconds_per_step": split["data_seconds_per_step"]}


def ratio_interval(this: list[float], base: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 90% bootstrap interval of median(this) / median(base), resampling each side's
    processes (which differ from one another by more than the trees do on a shared 2-core VM)."""
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(this, k=len(this))) /
                    statistics.median(rng.choices(base, k=len(base))) for _ in range(draws))
    return ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base_tree", type=Path, help="the other checkout (its src/ is used)")
    p.add_argument("base_commit", help="the commit that tree holds (recorded)")
    p.add_argument("--recipe", action="append", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], dest="sets")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    trees = {"base": args.base_tree.resolve() / "src", "this": HERE / "src"}
    record = {"what": "seconds per training step (speedrun flops' data/model split, model part: the synchronised "
                      "training step after the warm-up), this checkout vs base_commit, alternating, one process "
                      "per sample", "base_commit": args.base_commit, "steps_per_sample": args.steps,
              "overrides": args.sets, "environment": environment(), "recipes": {}}
    for recipe in args.recipe:
        runs = {"base": [], "this": []}
        for r in range(args.rounds):
            for name in (("base", "this") if r % 2 == 0 else ("this", "base")):
                runs[name].append(sample(trees[name], recipe, args.steps, args.sets))
                print(recipe, name, f"{runs[name][-1]['model_seconds_per_step'] * 1000:.1f} ms/step", flush=True)
        times = {k: [x["model_seconds_per_step"] for x in v] for k, v in runs.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        low, high = ratio_interval(times["this"], times["base"])
        record["recipes"][recipe] = {"runs": runs, "median_model_seconds_per_step": med,
                                     "mean_model_seconds_per_step": {k: statistics.fmean(v) for k, v in times.items()},
                                     "this_over_base": med["this"] / med["base"],
                                     "this_over_base_90pct_bootstrap": [low, high]}
        print(f"{recipe}: this/base = {med['this'] / med['base']:.3f} (90% bootstrap interval {low:.3f}-{high:.3f})",
              flush=True)
        atomic_write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
