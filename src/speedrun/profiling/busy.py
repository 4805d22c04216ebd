"""How busy the device is while it trains: the union of its kernels' intervals over the wall
time of a few steps under torch.profiler (``benchmarks/throughput.py`` reports it beside each
images/s figure). On a CPU the union of this process's ATen ops and compiled regions stands in
for it: input workers are other processes, so what is left is waiting for batches, Python and
the profiler's own cost. The profiler slows the host, so where the host is the limit the
figure is a lower bound of the unprofiled one."""
from __future__ import annotations

import time

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from .step_structure import COMPILED

WINDOW = "speedrun.profiled_window"
CPU_WORK = ("aten::", *COMPILED)


def covered(intervals) -> float:
    """Length of the union of (start, end) intervals: overlaps (kernels on several streams,
    nested ops) count once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def busy_fraction(intervals, window: tuple[float, float]) -> float:
    """The share of ``window`` that ``intervals`` cover (each clipped to it); NaN for an empty window."""
    lo, hi = window
    clipped = [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]
    return covered(clipped) / (hi - lo) if hi > lo else float("nan")


def profiled_busy(runtime, step_once, steps: int) -> dict:
    """``steps`` calls of ``step_once`` under torch.profiler, the device synchronised at both
    ends of the window: the busy fraction, the window's wall seconds and what was counted."""
    cuda = runtime.device.type == "cuda"
    runtime.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        with record_function(WINDOW):
            runtime.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step_once()
            runtime.synchronize()
            wall = time.perf_counter() - t0
    events = prof.events()
    window = next(e.time_range for e in events if e.name == WINDOW)
    if cuda:
        spans = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        what = "CUDA kernels, copies and sets (device time)"
    else:
        spans = [(e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == DeviceType.CPU and e.name != WINDOW and e.name.startswith(CPU_WORK)]
        what = "this process's ATen ops and compiled regions (CPU time; no GPU)"
    frac = busy_fraction(spans, (window.start, window.end))
    return {"steps": steps, "wall_seconds": wall, "busy_fraction": frac, "busy_seconds": frac * wall, "what": what}
