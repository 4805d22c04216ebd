"""What CUDA graph trees would be given for each compiled graph of a run, checked on the CPU.

For each recipe row, the run is built as on CUDA (``cuda_graphs`` on: the step marks every
parameter, optimizer and averaging tensor as a static address) and compiled through
AOTAutograd without code generation (``speedrun.profiling.step_structure.cuda_graph_inputs``). Per
graph: inputs, static inputs, mutated inputs, mutated inputs that are not static (inductor
skips CUDA graphs for a graph with any), and inputs sharing a storage. The rows are
tests/matrix.py's CUDA_GRAPH_ROWS, which tests/test_step_structure.py checks too. Narrow nets on a
1,024-image CIFAR-10 slice, batches of 64 and 64 test images: the counts do not depend on width,
batch or data size.

Usage: .venv/bin/python benchmarks/cuda_graph_inputs.py --data-dir ../shared/datasets \\
           --out benchmarks/results/cuda-graph-inputs-<commit>.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from matrix import CUDA_GRAPH_ROWS, STRUCTURE_BATCHES, structure_slice  # noqa: E402
from speedrun.data.sources.builtin import load_dataset  # noqa: E402
from speedrun.files import atomic_write_json  # noqa: E402
from speedrun.profiling.step_structure import cuda_graph_inputs  # noqa: E402
from speedrun.recipe import load_recipe  # noqa: E402
from speedrun.report.environment import environment  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default="", help="the rows whose recipe name contains this text")
    args = p.parse_args()
    env = environment()
    data = structure_slice(load_dataset("cifar10", args.data_dir))
    rows = []
    for name, precision, sets in CUDA_GRAPH_ROWS:
        if args.only not in name:
            continue
        t0 = time.perf_counter()
        recipe = load_recipe(name, [*STRUCTURE_BATCHES, *sets])
        probe = cuda_graph_inputs(recipe, data, precision)
        rows.append({"recipe": name, "precision": precision, "overrides": sets, **probe,
                     "mutated_not_static_total": sum(g["mutated_not_static"] for g in probe["graphs"]),
                     "seconds": time.perf_counter() - t0})
        print(f"{name:20s} {precision} {' '.join(sets[1:]) or '':45s} " + "; ".join(
            f"{g['inputs']} in, {g['static']} static, {g['mutated']} mutated, {g['mutated_not_static']} not static"
            for g in probe["graphs"]), flush=True)
    atomic_write_json(args.out, {
        "benchmark": "inputs of each compiled graph as CUDA graph trees would see them, on the CPU",
        "timed": "nothing: counts (seconds per row are the compile time, for scale)",
        "rows": rows, "environment": env})
    return 1 if any(r["mutated_not_static_total"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
