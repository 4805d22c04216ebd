"""What imagenet_throughput.py and photo_throughput.py share: synthetic photo folders written
with Pillow, the model step timed alone on device-resident random tensors, the GPU-busy
fraction of a profiled window, the machine and commit a record names, and one-line refusals.
torch is imported where it is needed, so that a bad argument is refused in a fraction of a second.
"""
from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

BOUND_SHARE = 0.9
"""A pipeline whose fed steps reach this share of the model step's images/s alone is called
model-bound; below it, pipeline-bound."""


# ------------------------------------------------------------------------------------------
# Refusals: one line, exit code 2, nothing written
# ------------------------------------------------------------------------------------------

class Refused(Exception):
    """A bad argument or value: said in one line, exit code 2, before anything is written."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (no usage block) and exit code 2."""

    def error(self, message):
        raise Refused(message)


def refusal(prog: str, err: Exception) -> int:
    print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------------------------------
# The machine and the commit
# ------------------------------------------------------------------------------------------

def read_commit(given: str | None) -> tuple[str | None, str]:
    """(commit, where it was read): --commit, else $SPEEDRUN_COMMIT, else git rev-parse HEAD
    (a GPU machine without .git needs one of the first two). Read when the script starts."""
    if given:
        return given, "--commit"
    if os.environ.get("SPEEDRUN_COMMIT"):
        return os.environ["SPEEDRUN_COMMIT"], "$SPEEDRUN_COMMIT"
    unknown = (None, "unknown (no git; pass --commit)")
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return unknown
    return (out.stdout.strip(), "git rev-parse HEAD") if out.returncode == 0 else unknown


def machine(commit: str | None, commit_source: str) -> dict:
    """speedrun's environment record (torch, CUDA, CPU, GPU name and clocks as found, git
    state) with triton's and cuDNN's versions and the commit as given."""
    import torch
    from speedrun.report.environment import environment
    env = environment()
    try:
        import triton
        triton_version = triton.__version__
    except Exception:                                   # (not in CPU builds)
        triton_version = None
    env.update(triton_version=triton_version,
               cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
               commit=commit, commit_source=commit_source)
    if commit and commit_source != "git rev-parse HEAD":
        env["git_commit"] = commit
    return env


def device_label(device) -> str:
    from speedrun.engine.runtime import device_name
    return device_name(device)


def slug(text: str) -> str:
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    return "-".join(p for p in out.split("-") if p)[:40] or "device"


# ------------------------------------------------------------------------------------------
# Synthetic photo folders
# ------------------------------------------------------------------------------------------

_NOISE: dict = {}


def photo_bytes(seed: int, width: int, height: int, quality: int) -> bytes:
    """A JPEG that compresses about as a photograph does: a flat colour, smooth random colour
    fields (coarse blobs and finer texture, upsampled bicubically) and per-pixel noise
    (sigma 12 grey levels, one array per process, a window of it per image). At 500 x 375 and
    quality 90 the files are about 95 kB, at 224 x 224 and quality 75 about 13 kB; noise alone
    would make them several times larger and slower to decode than photographs."""
    rng = np.random.default_rng(seed)

    def field(cells: int, amplitude: int) -> np.ndarray:
        gh, gw = max(2, height // cells), max(2, width // cells)
        small = rng.integers(128 - amplitude, 128 + amplitude + 1, (gh, gw, 3), dtype=np.uint8)
        big = Image.fromarray(small, "RGB").resize((width, height), Image.BICUBIC)
        return np.asarray(big).astype(np.int16) - 128

    key = (height, width)
    if key not in _NOISE:
        _NOISE[key] = np.random.default_rng(0).normal(0, 12, (2 * height, 2 * width, 3)).astype(np.int16)
    oy, ox = rng.integers(0, height), rng.integers(0, width)
    img = rng.integers(60, 190, 3).astype(np.int16) + field(96, 90) + field(4, 60)
    img += _NOISE[key][oy:oy + height, ox:ox + width]
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _write(job) -> int:
    path, seed, width, height, quality = job
    data = photo_bytes(seed, width, height, quality)
    Path(path).write_bytes(data)
    return len(data)


def photo_folder(root: Path, classes: int, train_per_class: int, val_per_class: int, sizes: list[tuple[int, int]],
                 quality: int, processes: int | None = None) -> dict:
    """train/cNNNN/*.jpg and val/cNNNN/*.jpg under ``root`` (the layout of ImageNet's folders
    and speedrun's ``folder`` data set): image i takes its (width, height) from ``sizes`` in
    turn. Written by ``processes`` forked workers (default: every core). Returns what was
    written and how long it took."""
    jobs = []
    for split, per in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"c{c:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per):
                w, h = sizes[(c * per + i) % len(sizes)]
                jobs.append((str(folder / f"{split}_{c:04d}_{i:05d}.jpg"), len(jobs), w, h, quality))
    t0 = time.perf_counter()
    processes = processes or os.cpu_count() or 1
    if len(jobs) < 64 or processes == 1:
        written = [_write(j) for j in jobs]
    else:                                  # forked before this process has run any torch op
        with mp.get_context("fork").Pool(processes) as pool:
            written = pool.map(_write, jobs, chunksize=max(1, len(jobs) // (processes * 8)))
    seconds = time.perf_counter() - t0
    return {"root": str(root), "classes": classes, "train_images": classes * train_per_class,
            "val_images": classes * val_per_class, "sizes_wxh": [f"{w}x{h}" for w, h in sizes],
            "jpeg_quality": quality, "mean_bytes": float(np.mean(written)) if written else 0.0,
            "total_bytes": int(sum(written)), "write_seconds": seconds, "write_processes": processes}


def parse_wxh(text: str, option: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise Refused(f"{option} {text!r}: expected WIDTHxHEIGHT in pixels, e.g. 500x375") from None
    if w < 8 or h < 8:
        raise Refused(f"{option} {text}: each side must be at least 8 pixels")
    return w, h


# ------------------------------------------------------------------------------------------
# Timing on the device
# ------------------------------------------------------------------------------------------

def random_batch(session, side: int, seed: int = 0):
    """A device-resident random batch as the step receives it: normalised-looking values in
    the compute dtype and the runtime's memory layout, labels of the data set's classes."""
    import torch
    rt, src = session.runtime, session.source
    gen = torch.Generator(device=rt.device)
    gen.manual_seed(seed)
    batch = session.local_batch
    x = torch.randn(batch, src.in_channels, side, side, generator=gen, device=rt.device)
    x = x.to(rt.dtype).contiguous(memory_format=rt.memory_format)
    y = torch.randint(0, src.num_classes, (batch,), generator=gen, device=rt.device)
    return x, y


def timed_blocks(rt, step_once, steps: int, repeats: int, warm: int, before_block=None) -> list[float]:
    """Seconds of each of ``repeats`` blocks of ``steps`` calls of ``step_once`` (the device
    synchronised before and after each block), after ``warm`` untimed calls.
    ``before_block()`` runs untimed before the warm calls and before each block."""
    if before_block:
        before_block()
    for _ in range(warm):
        step_once()
    out = []
    for _ in range(repeats):
        if before_block:
            before_block()
        rt.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step_once()
        rt.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def model_step(session, side: int, steps: int, repeats: int, warm: int, profile_steps: int = 0,
               in_step_size: int | None = None) -> dict:
    """The training step alone (the session's own TrainStep: forward, loss, backward,
    optimizer, averaging) on one device-resident random batch of ``side`` px, called
    ``steps`` times per block; the counter is rewound before each block so that a block never
    runs past the schedule's end. With ``profile_steps``, the busy fraction of that many more
    (:func:`profiled_busy`). ``in_step_size``: the size a step that resizes inside itself
    shrinks the batch to."""
    from speedrun.engine.runtime import compiled_graphs
    rt, step = session.runtime, session.step
    graphs = compiled_graphs()
    x, y = random_batch(session, side)
    session.reset(0)
    step.reset(0)

    def once():
        rt.mark_step()
        step(x, y, in_step_size)
    seconds = timed_blocks(rt, once, steps, repeats, warm, before_block=step.rewind)
    batch = session.local_batch
    rates = [steps * batch / s for s in seconds]
    out = {"side": side, "batch": batch, "steps_per_block": steps, "warm_steps": warm, "block_seconds": seconds,
           "seconds_per_step": [s / steps for s in seconds], "images_per_second": rates,
           "images_per_second_median": float(np.median(rates)),
           "seconds_per_step_median": float(np.median(seconds)) / steps}
    if profile_steps:
        step.rewind()
        out["busy"] = profiled_busy(rt, once, profile_steps)
    out["graphs_compiled_during"] = compiled_graphs() - graphs
    return out


# ------------------------------------------------------------------------------------------
# Busy fraction, from torch.profiler
# ------------------------------------------------------------------------------------------

WINDOW = "speedrun.profiled_window"


def covered(intervals) -> float:
    """Length of the union of (start, end) intervals (overlaps, e.g. several streams or nested
    ops, count once); gpu_smoke.py uses it too."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def busy_fraction(intervals, window: tuple[float, float]) -> float:
    lo, hi = window
    clipped = [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]
    return covered(clipped) / (hi - lo) if hi > lo else float("nan")


CPU_WORK = ("aten::", "Torch-Compiled Region", "CompiledFunction")


def profiled_busy(rt, step_once, steps: int) -> dict:
    """Over ``steps`` calls of ``step_once`` under torch.profiler (the device synchronised
    before the window opens and before it closes): on CUDA, the union of the kernels' own
    intervals (memory copies and sets included) over the window's wall time; on a CPU, the
    union of this process's ATen ops and compiled regions over it (input workers are other
    processes: what is left is waiting for batches, Python and the profiler's own cost).
    The profiler slows the host, so the figure is a lower bound of the unprofiled one where
    the host is the limit."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    cuda = rt.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rt.synchronize()
    with profile(activities=acts) as prof:
        with record_function(WINDOW):
            rt.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step_once()
            rt.synchronize()
            wall = time.perf_counter() - t0
    events = prof.events()
    window = next(e.time_range for e in events if e.name == WINDOW)
    if cuda:
        spans = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        source = "CUDA kernels, copies and sets (device time)"
    else:
        spans = [(e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == DeviceType.CPU and e.name != WINDOW and e.name.startswith(CPU_WORK)]
        source = "this process's ATen ops and compiled regions (CPU time; no GPU)"
    frac = busy_fraction(spans, (window.start, window.end))
    return {"steps": steps, "wall_seconds": wall, "busy_fraction": frac, "busy_seconds": frac * wall,
            "what": source}


def bound(pipeline_rate: float, model_rate: float) -> dict:
    """Which side bounds pipeline-fed steps: their images/s against the model step's alone."""
    ratio = pipeline_rate / model_rate
    return {"pipeline_over_model": ratio, "bound_by": "model" if ratio >= BOUND_SHARE else "pipeline",
            "rule": f"model-bound where the pipeline-fed steps reach {BOUND_SHARE:.0%} of the model step's "
                    "images/s alone, else pipeline-bound"}
