"""Three per-step levers of an eager CPU training step, each timed against its alternative in
one process, alternating step by step on the same batch (so the VM's drift hits both alike):

- ``whiten``: the frozen whitening bias out of the backward (requires_grad off; what an eager
  one-process step does after ``model.whiten.train_bias_epochs``) against the LR-0 freeze;
- ``norm``: batch norm reading bf16 (``model.norm.fp32 = false``, what "auto" is on a CPU)
  against the fp32 round trip (``true``);
- ``wgrad``: 3x3 weight gradients as measured per shape (``runtime.conv_weight_grad = auto``)
  against torch's kernel for all (``torch``), with the shapes' choices.

Then, per 3x3 shape of the recipe's net at each of its training sizes, the weight gradient
alone: torch's kernel against the nine products (medians of 5). Usage:

    .venv/bin/python benchmarks/cpu_step_levers.py cifar10-94-cpu --out benchmarks/results/....json [--steps 6]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from speedrun.engine.loop import Session
from speedrun.engine.plan import plan_run
from speedrun.files import atomic_write_json
from speedrun.models import weight_grad as wg
from speedrun.models.norm import BatchNorm
from speedrun.profiling.step_structure import real_batches, timed_step
from speedrun.recipe import load_recipe
from speedrun.report.environment import environment


def batches_at_each_size(session, seed=0):
    """One real batch per training image size of the run (its first batch at that size)."""
    out, batches = {}, real_batches(session, seed)
    for _ in range(session.total_steps):
        x, y, size = next(batches)
        out.setdefault(size or x.shape[-1], (x, y, size))
        if len(out) == len(session.image_sides):
            break
    return out


def alternate(session, x, y, size, a, b, steps: int) -> dict:
    """Steps alternating between setting ``a`` and ``b`` (callables that put it in place), the
    first round of each untimed; seconds per step of each."""
    times = {"a": [], "b": []}
    for i in range(2 * (steps + 1)):
        which = "a" if i % 2 == 0 else "b"
        (a if which == "a" else b)()
        session.step.steps_done = 10 ** 6            # past the whitening bias's epochs
        t = timed_step(session, x, y, size)
        if i >= 2:
            times[which].append(t)
    return {k: {"seconds": v, "median": statistics.median(v)} for k, v in times.items()}


def median_ms(f, n=5) -> float:
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=5, help="timed steps of each setting per comparison and size")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--set", dest="sets", action="append", default=[])
    args = p.parse_args()
    env = environment()      # (the commit that runs, read before it runs)
    recipe = load_recipe(args.recipe, args.sets)
    plan = plan_run(recipe, args.data_dir, torch.device("cpu"), fit_batch=False)
    recipe, source, rt = plan.recipe, plan.source, plan.runtime.activate()
    if rt.precision != "bf16":
        raise SystemExit("these levers are for bf16 steps; this CPU runs the recipe in " + rt.precision)
    session = Session(recipe, source, rt, warm_up=True)
    frozen = session.step.freezable
    norms = [m for m in session.model.modules() if isinstance(m, BatchNorm)]
    original_norm = norms[0].fp32 if norms else None

    def whiten(drop):
        def put():
            session.step.freezable = frozen if drop else []
            for q in frozen:
                q.requires_grad_(True)
        return put

    def norm(fp32):
        def put():
            for m in norms:
                m.fp32 = fp32
        return put

    def wgrad(mode):
        def put():
            wg.set_mode(mode, forget=False)         # the measured choices survive the switch back
        return put

    rows = []
    wg.set_mode("auto")
    for side, (x, y, size) in sorted(batches_at_each_size(session).items()):
        wgrad("auto")()                             # (keeps the shapes measured at earlier sizes)
        timed_step(session, x, y, size)             # the shapes at this size measured
        for lever, a, b, labels in [("whiten", whiten(True), whiten(False), ("dropped", "lr0")),
                                    ("norm", norm(False), norm(True), ("bf16", "fp32")),
                                    ("wgrad", wgrad("auto"), wgrad("torch"), ("auto", "torch"))]:
            r = alternate(session, x, y, size, a, b, args.steps)
            norm(original_norm)()
            wgrad("auto")()
            whiten(True)()
            rows.append({"size": side, "lever": lever, labels[0]: r["a"], labels[1]: r["b"],
                         "ratio": r["a"]["median"] / r["b"]["median"]})
            print(f"{side} px {lever}: {labels[0]} {r['a']['median']:.3f} s, {labels[1]} {r['b']['median']:.3f} s "
                  f"({rows[-1]['ratio']:.3f})", flush=True)
    choices = wg.choices()

    shapes = []
    for (n, c, h, w), k in wg.measured():
        xs = torch.randn(n, c, h, w).bfloat16().contiguous(memory_format=torch.channels_last)
        g = torch.randn(n, k, h, w).bfloat16().contiguous(memory_format=torch.channels_last)
        weight = torch.randn(k, c, 3, 3).bfloat16().contiguous(memory_format=torch.channels_last)
        row = {"shape": f"{n}x{c}x{h}x{w}->{k}", "torch_ms": median_ms(lambda: wg.torch_weight_grad(g, xs, weight)),
               "gemm_ms": median_ms(lambda: wg.gemm_weight_grad(g, xs)), "chosen_in_run": choices[f"{n}x{c}x{h}x{w}->{k}"]}
        shapes.append(row)
        print(f"{row['shape']}: torch {row['torch_ms']:.1f} ms, products {row['gemm_ms']:.1f} ms "
              f"(the run chose {row['chosen_in_run']})", flush=True)

    record = {"benchmark": "cpu_step_levers", "recipe": recipe.name, "overrides": args.sets,
              "timed": "seconds of one training step (forward, backward, update; device synchronised), alternating "
                       "the two settings step by step on one real batch per training size, the first of each untimed; "
                       "then the 3x3 weight gradient alone per shape, medians of 5 calls",
              "steps_per_setting": args.steps, "levers": rows, "weight_grad_shapes": shapes,
              "weight_grad_choices": choices, "environment": env}
    atomic_write_json(args.out, record)
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
