"""The recipe matrix on a GPU, in one device call: does every recipe run with the CUDA defaults
(bf16, compiled), and is its step host-bound?

    python benchmarks/gpu_smoke.py prepare DIR            # on the CPU: small real data sets, from $SPEEDRUN_DATA
    python benchmarks/gpu_smoke.py run DIR --out OUT      # on the GPU: every entry; writes OUT/gpu-smoke.json

The entries are the recipe/data pairs of tests/matrix.py (every shipped recipe on each pipeline
it supports, small widths, a few epochs of small slices), run here with the CUDA defaults (bf16,
compiled with inductor), plus cifar10-94 with CUDA graphs (runtime.cuda_graphs = on) and at its
real widths, and a resume from a mid-run checkpoint on the device. For each entry the record
holds: the warm-up (compile) seconds, graphs compiled during the timed run (must be 0), whether
every loss was finite, the accuracy, ms per training step from CUDA events (median of
consecutive steps), and, over 10 more steps profiled after the timed run, the GPU-busy time:
the union of the kernels' own intervals (each kernel once; overlapping streams once) over the
profiled window, which starts and ends with the device synchronised. A step whose GPU is busy
well under 80% of its wall time is host-bound.

Options: --only TEXT (entries whose id contains it), --device cpu (check the script itself on
a CPU), --budget SECONDS (start no entry after this; the record says which were left out).
The record is rewritten after every entry, so a call cut off by its time limit keeps what ran.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from matrix import MATRIX, Entry  # noqa: E402
from speedrun.data import load_dataset  # noqa: E402
from speedrun.data.prepare import export, prepare  # noqa: E402
from speedrun.engine import checkpoint as ckpt  # noqa: E402
from speedrun.engine.loop import Session  # noqa: E402
from speedrun.engine.plan import plan_run  # noqa: E402
from speedrun.recipe import load_recipe, steps_per_epoch  # noqa: E402
from speedrun.report.environment import environment  # noqa: E402
from throughput_common import busy_fraction, covered  # noqa: E402

MIN_STEPS = 24
"""Entries are run for at least this many steps, so that step times can be taken."""

# data set name in tests/matrix.py -> path under the data folder
DATA = {"cifar_small": "cifar.npz", "fashion_small": "fashion.npz", "jpeg32": "jpeg32", "npz32": "c32.npz",
        "tiny64": "tiny64", "tiny_npz32": "t32.npz", "imagenet224": "imagenet224"}


# ------------------------------------------------------------------------------------------
def prepare_data(out: Path) -> None:
    """The data sets of tests/conftest.py, with a larger CIFAR-10 slice (5,000 / 1,000) so
    that full-width steps can be timed."""
    src = os.environ.get("SPEEDRUN_DATA") or str(ROOT.parent / "shared" / "datasets")
    out.mkdir(parents=True, exist_ok=True)
    for name, spec, n_train, n_test in (("cifar.npz", "cifar10", 5000, 1000), ("fashion.npz", "fashion-mnist", 1024, 256)):
        ds = load_dataset(spec, src, fetch=False)
        np.savez(out / name, x_train=ds.train_x[:n_train].numpy(), y_train=ds.train_y[:n_train].numpy(),
                 x_test=ds.test_x[:n_test].numpy(), y_test=ds.test_y[:n_test].numpy(), classes=np.array(ds.classes))
    export("cifar10", "jpeg", out / "jpeg32", src, limit=512, workers=2)
    export("cifar10", "jpeg", out / "tiny64", src, limit=256, size=64, layout="tiny-imagenet", workers=2)
    export("cifar10", "jpeg", out / "imagenet224", src, limit=256, size=224, workers=2)
    prepare(out / "jpeg32", 32, out / "c32.npz", workers=2)
    prepare(out / "tiny64", 32, out / "t32.npz", workers=2)
    print(f"prepared {out}: {sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 2**20:.1f} MiB")


# ------------------------------------------------------------------------------------------
class StepTimer:
    """The loop's progress protocol, recording a CUDA event after every step (wall time on a
    CPU); it reads nothing back during the run."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events, self.wall = [], []

    def start(self, total_steps, epochs, batch_size):
        self.done = 0

    def step(self):
        self.done += 1
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
        self.wall.append(time.perf_counter())

    def epoch(self, record):
        pass

    def step_ms(self) -> float | None:
        """Median time between consecutive steps after the first two (CUDA events on a GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            gaps = [a.elapsed_time(b) for a, b in zip(self.events[2:], self.events[3:])]
        else:
            gaps = [(b - a) * 1000 for a, b in zip(self.wall[2:], self.wall[3:])]
        return statistics.median(gaps) if gaps else None


WINDOW = "speedrun.profiled_window"


def profile_steps(session, device: torch.device, steps: int = 10) -> dict:
    """GPU-busy time over ``steps`` training steps after the timed run, on fresh batches of
    the run's own pipeline: the device is synchronised before the profiler starts and before
    it stops, and busy time is the union of the kernels' own intervals (the profiler's
    device-side events; each kernel once, not also under the CPU op that launched it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from speedrun.profiling.step_structure import real_batches
    cuda = device.type == "cuda"
    batches = real_batches(session, seed=1)
    x, y, size = next(batches)
    session.step(x, y, size)                              # one step outside the window
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=acts) as prof:
        with record_function(WINDOW):            # the window, in the profiler's own clock
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                x, y, size = next(batches)
                session.runtime.mark_step()
                session.step(x, y, size)
            sync()
            wall = time.perf_counter() - t0
    out = {"steps": steps, "wall_ms_per_step": wall / steps * 1000}
    if cuda:
        kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
        window = next(e.time_range for e in prof.events() if e.name == WINDOW)
        if kernels:
            frac = busy_fraction(kernels, (window.start, window.end))
            out.update(kernel_ms_per_step=covered(kernels) / 1000 / steps, busy_fraction=frac,
                       host_bound=frac < 0.8)
    return out


def run_entry(entry: Entry, data_root: Path, device: torch.device, extra: list[str], label: str,
              resume_check: bool = False) -> dict:
    sets = [s for s in entry.sets] + ["runtime.precision=auto" if device.type == "cuda" else "runtime.precision=bf16",
                                      "runtime.compile=on", *extra]
    data = data_root / DATA[entry.data]
    row = {"id": label, "recipe": entry.recipe, "data": entry.data, "overrides": sets}
    t0 = time.perf_counter()
    from torch._dynamo.utils import counters
    skips = counters["inductor"]["cudagraph_skips"]      # graphs inductor ran without CUDA graphs
    try:
        recipe = load_recipe(entry.recipe, sets)
        plan = plan_run(recipe, data, device, fit_batch=False)
        recipe, source, runtime = plan.recipe, plan.source, plan.runtime
        spe = steps_per_epoch(len(source.train_y), recipe.data.batch_size)
        if recipe.train.epochs * spe < MIN_STEPS:       # enough steps to time (a GPU step takes ms)
            recipe = recipe.with_values({"train.epochs": MIN_STEPS / spe})
        session = Session(recipe, source, runtime)
        steps = session.total_steps
        timer = StepTimer(device)
        ckpt_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"smoke-{label}" if resume_check else None
        result = session.run(progress=timer, checkpoint_dir=ckpt_dir)
        losses = [h.train_loss for h in result.history]
        row.update(ok=True, precision=runtime.precision, compile_mode=runtime.compile_mode,
                   cuda_graphs=runtime.cuda_graphs,
                   compile_seconds=session.compile_seconds, recompiles=result.recompiles,
                   finite_losses=all(math.isfinite(v) for v in losses), losses=losses, steps=result.steps,
                   test_acc=result.test_acc, train_seconds=result.train_seconds, step_ms=timer.step_ms(),
                   batch_size=recipe.data.batch_size,
                   cudagraph_skips=counters["inductor"]["cudagraph_skips"] - skips)
        row["gpu_busy"] = profile_steps(session, device, min(10, steps))
        if resume_check:
            state = ckpt.load(ckpt_dir)
            resumed = session.run(resume=state)
            diff = max(float((resumed.state_dict[k].float() - result.state_dict[k].float()).abs().max())
                       for k in result.state_dict if result.state_dict[k].is_floating_point())
            row["resume"] = {"from_step": state["step"], "steps": resumed.steps, "test_acc": resumed.test_acc,
                             "max_abs_weight_diff_vs_uninterrupted": diff,
                             "finite_losses": all(math.isfinite(h.train_loss) for h in resumed.history)}
    except Exception as err:                                  # recorded, and the next entry runs
        row.update(ok=False, error=f"{type(err).__name__}: {str(err)[:2000]}")
    row["seconds"] = time.perf_counter() - t0
    return row


def clocks() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,"
                               "temperature.gpu", "--format=csv"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def plan() -> list[tuple[str, Entry, list[str], bool]]:
    """(label, entry, extra overrides, resume check) for every run, in order: cifar10-94 at its
    real widths first (the step whose speed matters; a call cut short by --budget still has it),
    then the matrix."""
    runs, seen = [], set()
    base = next(e for e in MATRIX if e.recipe == "cifar10-94" and e.backend and e.precision == "bf16")
    full = dataclasses.replace(base, sets=("data.dataset=npz", "train.epochs=2"))
    runs.append(("cifar10-94/cifar_small/real-widths", full, [], False))
    runs.append(("cifar10-94/cifar_small/real-widths/cuda-graphs", full, ["runtime.cuda_graphs=on"],
                 False))
    for e in MATRIX:                                      # each recipe on each of its pipelines, with the
        label = f"{e.recipe}/{e.data}"                    # CUDA defaults (run_entry sets them)
        if label in seen:
            continue
        seen.add(label)
        runs.append((label, e, [], "checkpoint.every_steps=2" in e.sets))
    runs.append(("cifar10-94/cifar_small/cuda-graphs", base, ["runtime.cuda_graphs=on"], False))
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prepare")
    q.add_argument("data", type=Path)
    q = sub.add_parser("run")
    q.add_argument("data", type=Path)
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("--only", default="")
    q.add_argument("--device", default="cuda")
    q.add_argument("--budget", type=float, default=420.0, help="start no entry after this many seconds")
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare_data(args.data)
        return 0
    device = torch.device(args.device)
    started = time.perf_counter()
    record = {"script": "benchmarks/gpu_smoke.py", "commit": os.environ.get("SPEEDRUN_COMMIT"),
              "what": "each matrix entry once with the CUDA defaults (bf16, inductor); step_ms = median of "
                      "CUDA-event gaps between training steps; gpu_busy over 10 profiled steps",
              "environment": {**environment(), "device": str(device),
                              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "clocks_as_found": clocks()},
              "entries": [], "left_out": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu-smoke.json"
    for label, entry, extra, resume in plan():
        if args.only not in label:
            continue
        if time.perf_counter() - started > args.budget:
            record["left_out"].append(label)
            continue
        row = run_entry(entry, args.data, device, extra, label, resume)
        record["entries"].append(row)
        record["total_seconds"] = time.perf_counter() - started
        path.write_text(json.dumps(record, indent=2) + "\n")
        busy = row.get("gpu_busy") or {}
        print(f"{label:48s} {'ok' if row.get('ok') else 'FAILED'} compile {row.get('compile_seconds', 0):6.1f}s "
              f"recompiles {row.get('recompiles')} finite {row.get('finite_losses')} step {row.get('step_ms') or 0:8.2f} ms "
              f"busy {busy.get('busy_fraction', float('nan')):.2f} cudagraph skips {row.get('cudagraph_skips')} "
              f"{row.get('error', '')[:200]}", flush=True)
    failed = [r["id"] for r in record["entries"] if not (r.get("ok") and r.get("finite_losses")
                                                         and r.get("recompiles") == 0)]
    print(f"{len(record['entries'])} entries in {time.perf_counter() - started:.0f} s; failed: {failed or 'none'}; "
          f"left out: {record['left_out'] or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
