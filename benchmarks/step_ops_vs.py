"""ATen ops dispatched per eager training step of fashion-mnist (forward, backward and update),
for this tree or for 18b0e9f's (whose step was ``Objective.step``), run with PYTHONPATH at
the tree's src/; prints a JSON line {"tree", "ops_per_step", "by_op"}.

    PYTHONPATH=/tmp/base/src python benchmarks/step_ops_vs.py base
    python benchmarks/step_ops_vs.py this

benchmarks/results/step-ops-eager-fashion-mnist-vs-18b0e9f-*.json holds both, with the
machine; it shows that the eager step's time is not spent in op overhead (fewer ops here).
"""
from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from speedrun.data.pipeline.dataset import open_source
from speedrun.engine.loop import Session
from speedrun.engine.runtime import resolve_runtime
from speedrun.recipe import load_recipe


class Count(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    tree = sys.argv[1] if len(sys.argv) > 1 else "this"
    data = os.environ.get("SPEEDRUN_DATA") or str(Path(__file__).resolve().parents[2] / "shared" / "datasets")
    recipe, ds = open_source(load_recipe("fashion-mnist"), data)
    session = Session(recipe, ds, resolve_runtime(recipe.runtime, torch.device("cpu")), warm_up=True)
    counts, on = collections.Counter(), [False]

    def counted(f):
        def g(*a, **k):
            if not on[0]:
                return f(*a, **k)
            with Count(counts):
                return f(*a, **k)
        return g

    if tree == "base":
        import speedrun.engine.step as old
        old.Objective.step = counted(old.Objective.step)
        split = session.time_split
    else:
        from speedrun.bench import flops_command
        flops_command.timed_step = counted(flops_command.timed_step)
        split = lambda n: flops_command.time_split(session, n)  # noqa: E731
    split(3)
    on[0] = True
    steps = 10
    split(steps)
    print(json.dumps({"tree": tree, "ops_per_step": sum(counts.values()) / steps,
                      "by_op": {k: v / steps for k, v in counts.most_common()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
