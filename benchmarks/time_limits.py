"""Time limits for ``gpu_record.py``'s systems and variants: each child process runs in its own
process group and is stopped (the whole group) at its limit, and a call's ``--budget`` starts a
child only if the child's limit still fits in what is left, so that the call ends inside its
budget and what finished before a stop is kept.

A limit is given for every child (``--limit SECONDS``) or for one, after its spec:
``speedrun:cifar10-94-fast#70``, ``peer:airbench94_muon.py#210``, ``--variant base#60``.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

LIMIT_SUFFIX = re.compile(r"#([0-9]+(?:\.[0-9]*)?)$")
GRACE_SECONDS = 3.0
"""After SIGTERM at the limit, how long the group has before SIGKILL."""


def split_limit(spec: str) -> tuple[str, float | None]:
    """(the spec without its ``#SECONDS`` suffix, the seconds or None). A ``#`` followed by
    anything but a positive number raises ValueError naming the expected form."""
    at = spec.rfind("#")
    if at < 0:
        return spec, None
    m = LIMIT_SUFFIX.search(spec)
    if not m or m.start() != at or float(m.group(1)) <= 0:
        raise ValueError(f"{spec!r}: a time limit is written SPEC#SECONDS with SECONDS above 0 "
                         f"(e.g. {spec[:at]}#60)")
    return spec[:at], float(m.group(1))


@dataclass
class Slot:
    """Whether a child may start now, and when it must stop (seconds after its start)."""
    start: bool
    stop_after: float | None         # None: no limit
    stopped_by: str | None           # "its limit" or "the budget": what stop_after comes from
    reason: str = ""                 # why it is not started


class Budget:
    """The call's budget in seconds from ``started`` (perf_counter), or none."""

    def __init__(self, seconds: float | None, started: float):
        self.seconds, self.started = seconds, started

    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - (time.perf_counter() - self.started)

    def slot(self, limit: float | None) -> Slot:
        """A child with ``limit`` starts only if the limit fits in what is left of the budget; a
        child without one starts while any budget is left and is stopped where it ends."""
        left = self.left()
        if left is None:
            return Slot(True, limit, "its limit" if limit else None)
        if limit is not None:
            if limit > left:
                return Slot(False, None, None, f"its limit of {limit:.0f} s is more than the {max(left, 0):.0f} s "
                                                f"left of --budget {self.seconds:.0f}")
            return Slot(True, limit, "its limit")
        if left <= 0:
            return Slot(False, None, None, f"--budget {self.seconds:.0f} s is spent")
        return Slot(True, left, "the budget")


@dataclass
class ChildRun:
    rc: int
    wall: float                      # seconds from before its start to its exit
    tail: str                        # its last lines of output
    cut: bool                        # stopped at stop_after


def _stop_group(proc: subprocess.Popen, stopped: threading.Event) -> None:
    """SIGTERM to the child's process group, SIGKILL after a grace period if it lives on."""
    stopped.set()
    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait or None)
            return
        except subprocess.TimeoutExpired:
            continue


def run_limited(cmd: list[str], log: Path, env: dict, stop_after: float | None = None,
                cwd: Path | None = None) -> ChildRun:
    """Run ``cmd`` in a new process group, echoing its output (indented) and keeping it in
    ``log``; the whole group is stopped ``stop_after`` seconds after the start."""
    tail: deque[str] = deque(maxlen=40)
    stopped = threading.Event()
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                env=env, bufsize=1, start_new_session=True)
        timer = threading.Timer(stop_after, _stop_group, (proc, stopped)) if stop_after is not None else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            for line in proc.stdout:
                out.write(line)
                tail.append(line.rstrip("\n"))
                print("    " + line.rstrip("\n"), flush=True)
            rc = proc.wait()
        finally:
            if timer:
                timer.cancel()
            if proc.poll() is None:                 # (interrupted: the group goes with us)
                _stop_group(proc, threading.Event())
    wall = time.perf_counter() - t0
    if stopped.is_set():
        line = f"stopped at {stop_after:.0f} s (its process group killed)"
        tail.append(line)
        print("    " + line, flush=True)
    return ChildRun(rc, wall, "\n".join(tail), stopped.is_set())
