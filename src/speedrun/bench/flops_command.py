"""The ``flops`` command: FLOPs per image and per run, the peak, the ideal time, and the data vs
model time of a few real training steps."""
from __future__ import annotations

import time
from pathlib import Path

from rich.table import Table

from ..engine import flops
from ..engine.loop import Session
from ..engine.plan import plan_run
from ..engine.runtime import device_name
from ..files import atomic_write_json, check_output_file
from ..profiling.step_structure import real_batches, timed_step
from ..report.console import make_console
from .common import recipe_and_device

out = make_console()


def time_split(session: Session, steps: int = 20, seed: int = 0) -> dict:
    """Seconds per step spent producing batches (data) and in the training step on them
    (model), with a device sync between the two, on a throw-away run of ``session``."""
    rt = session.runtime
    batches = real_batches(session, seed)
    x, y, size = next(batches)            # untimed: the run's set-up (reset, pipeline, whitening fit) is in here
    data_s = model_s = 0.0
    for _ in range(steps):
        model_s += timed_step(session, x, y, size)
        rt.synchronize()
        t0 = time.perf_counter()
        x, y, size = next(batches)
        rt.synchronize()
        data_s += time.perf_counter() - t0
    session.reset(seed)
    return {"steps": steps, "data_seconds_per_step": data_s / steps, "model_seconds_per_step": model_s / steps,
            "data_seconds_per_epoch": data_s / steps * session.steps_per_epoch,
            "model_seconds_per_epoch": model_s / steps * session.steps_per_epoch}


def flops_command(args) -> int:
    recipe, device = recipe_and_device(args, [])
    if args.json:
        check_output_file(Path(args.json), "--json", overwrite=True)
    plan = plan_run(recipe, args.data_dir, device)
    recipe, ds, runtime = plan.recipe, plan.source, plan.runtime
    session = Session(recipe, ds, runtime, warm_up=True)
    total = flops.flops_of_run(session.recipe, session.source, session.total_steps, session.step.frozen_from)
    name = device_name(runtime.device)
    peak = flops.known_peak(name, runtime.precision)
    measured = flops.measured_peak(runtime.device.type, runtime.precision)
    split = time_split(session, args.steps)
    ideal = total["total_flops"] / (peak or measured)
    model_rate = total["flops_per_train_image"] * recipe.data.batch_size / split["model_seconds_per_step"]
    record = {"recipe": recipe.name, "device_name": name, "precision": runtime.precision, **total,
              "known_peak_flops_per_s": peak, "measured_peak_flops_per_s": measured,
              "ideal_seconds": ideal, "split": split, "model_flops_per_s": model_rate,
              "model_utilisation": model_rate / (peak or measured)}
    t = Table(title=f"flops {recipe.name} on {name} ({runtime.precision})", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("forward FLOPs per image", f"{total['flops_per_forward_image'] / 1e6:,.2f} M")
    t.add_row("training FLOPs per image (fwd + bwd)", f"{total['flops_per_train_image'] / 1e6:,.2f} M")
    if len(total["train_steps_by_size"]) > 1:
        t.add_row("training steps by image size", ", ".join(f"{n} at {size}" for size, n in
                                                           total["train_steps_by_size"].items()))
    if total["steps_without_whitening_gradient"]:
        t.add_row("steps after the whitening bias froze", f"{total['steps_without_whitening_gradient']} "
                  "(no input gradient for the first convolution)")
    t.add_row("training FLOPs per run", f"{total['train_flops']:.4g}")
    t.add_row("evaluation FLOPs (with TTA)", f"{total['eval_flops']:.4g}")
    t.add_row("peak FLOP/s", (f"{peak:.4g} (datasheet); " if peak else "") + f"{measured:.4g} (measured matmul)")
    t.add_row("ideal time at 100% of peak", f"{ideal:.3g} s")
    t.add_row("data time per epoch", f"{split['data_seconds_per_epoch']:.3f} s")
    t.add_row("model time per epoch", f"{split['model_seconds_per_epoch']:.3f} s")
    t.add_row("model FLOP/s (training steps)", f"{model_rate:.4g} ({record['model_utilisation']:.1%} of peak)")
    out.print(t)
    if split["data_seconds_per_step"] > 0.2 * split["model_seconds_per_step"]:
        out.print("[yellow]the input pipeline takes over a fifth of each step: it is a bottleneck[/]")
    if args.json:
        atomic_write_json(Path(args.json), record)
    return 0
