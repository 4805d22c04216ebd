"""speedrun's training engine against the plain PyTorch loop of ``peers.py``, in one process,
alternating blocks of steps, so that the VM's drift (±10% over minutes on a shared 2-core
machine) falls on both alike.

Both train the same cifar10-94 network (``speedrun.models``, channels_last, the same seed and
whitening) on the same CIFAR-10 images at the same precision; a block is ``--block`` training
steps of one engine, each step including the making of its batch (gather, normalise,
translate, flip), as an epoch does:

- speedrun: ``Session``'s resident pipeline batches and its ``TrainStep`` (the engine as
  ``speedrun train`` runs it);
- plain: ``peer_algorithm``'s ``TrainBatches`` and the loop body of ``peers.train_plain``
  (``torch.optim.SGD`` + ``LambdaLR``, lookahead, autocast).

Records every block's seconds per step, the medians, their ratio and a bootstrap interval.

    .venv/bin/python benchmarks/engine_vs_plain.py --data-dir ../shared/datasets --blocks 6 --block 4 \\
        --set model.norm.fp32=false --out benchmarks/results/engine-vs-plain-<cpu>.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_algorithm import Algorithm, autocast_for, load_cifar10, make_lookahead, make_optimizer  # noqa: E402
from peers import first_touch, peer_model  # noqa: E402
from speedrun.data.pipeline.dataset import open_pipeline  # noqa: E402
from speedrun.engine.loop import Session  # noqa: E402
from speedrun.engine.plan import plan_run  # noqa: E402
from speedrun.files import atomic_write_json  # noqa: E402
from speedrun.recipe import load_recipe  # noqa: E402
from speedrun.report.environment import environment  # noqa: E402


def speedrun_engine(recipe, data_dir: str, precision: str):
    """A function running n speedrun training steps (batches from its pipeline), endlessly
    cycling epochs."""
    plan = plan_run(recipe.with_values({"runtime.precision": precision, "runtime.compile": "off"}), data_dir,
                    torch.device("cpu"), fit_batch=False)
    recipe, source, runtime = plan.recipe, plan.source, plan.runtime
    session = Session(recipe, source, runtime)
    seed = recipe.train.seed
    session.reset(seed)
    data = open_pipeline(session.source, recipe, runtime, seed, session.shard)
    session.model.whiten.fit(data.whitening_sample(recipe.model.whiten.samples))
    session.step.reset(seed)
    st = session._run_state(data, seed)
    session.model.train()

    def batches():
        epoch = 0
        while True:
            yield from data.epoch(epoch, recipe.data.batch_size, st.augment, st.gen)
            epoch += 1
    it = batches()

    def run(n: int) -> None:
        for _ in range(n):
            x, y = next(it)
            if session.step.steps_done == session.step.total:
                session.step.rewind()
            session.step(x, y)
    return run


def plain_engine(recipe, data_dir: str, precision: str):
    """The same for the plain loop of peers.py (its loop body, step for step)."""
    data = load_cifar10(data_dir)
    algo = Algorithm.from_recipe(recipe, len(data.train_y))
    model = peer_model(recipe, algo.seed)
    opt, schedule = make_optimizer(model, algo)
    _, batches = first_touch(model, data, algo)
    lookahead = make_lookahead(model, algo)
    model.train()
    state = {"step": 0}

    def endless():
        while True:
            yield from batches
    it = endless()

    def run(n: int) -> None:
        for _ in range(n):
            x, y = next(it)
            with autocast_for(precision):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=algo.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            state["step"] += 1
            if lookahead is not None:
                lookahead.update(state["step"] % algo.total_steps or algo.total_steps)
    return run


def bootstrap_ratio(a: list[float], b: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """90% bootstrap interval of median(a) / median(b)."""
    rng = random.Random(seed)
    r = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
               for _ in range(draws))
    return r[int(0.05 * draws)], r[int(0.95 * draws) - 1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="cifar10-94")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--blocks", type=int, default=6, help="timed blocks per engine")
    p.add_argument("--block", type=int, default=4, help="steps per block")
    p.add_argument("--set", action="append", default=[], dest="sets")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    env = environment()      # (the commit that runs, read before it runs)
    recipe = load_recipe(args.recipe, args.sets)
    engines = {"speedrun": speedrun_engine(recipe, args.data_dir, args.precision),
               "plain": plain_engine(recipe, args.data_dir, args.precision)}
    for run in engines.values():                     # one untimed block each: kernel selection, first touch
        run(args.block)
    seconds = {k: [] for k in engines}
    for i in range(args.blocks):
        for name in (("speedrun", "plain") if i % 2 == 0 else ("plain", "speedrun")):
            t = time.perf_counter()
            engines[name](args.block)
            seconds[name].append((time.perf_counter() - t) / args.block)
            print(f"block {i} {name}: {seconds[name][-1]:.3f} s/step", flush=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    low, high = bootstrap_ratio(seconds["speedrun"], seconds["plain"])
    record = {"what": "seconds per training step (batch making included), speedrun's engine against peers.py's "
                      "plain loop, in one process, alternating blocks", "recipe": args.recipe, "overrides": args.sets,
              "precision": args.precision, "threads": torch.get_num_threads(), "steps_per_block": args.block,
              "blocks": args.blocks, "seconds_per_step": seconds, "median_seconds_per_step": med,
              "speedrun_over_plain": med["speedrun"] / med["plain"],
              "speedrun_over_plain_90pct_bootstrap": [low, high], "environment": env}
    atomic_write_json(args.out, record)
    print(f"speedrun/plain = {med['speedrun'] / med['plain']:.3f} (90% bootstrap {low:.3f}-{high:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
