"""How many threads torch's CPU operators use (``runtime.threads``), chosen from the cores that
other work leaves idle when the run starts.

torch runs each CPU operator on a team of OpenMP threads, one per core by default, that meet at
a barrier at the end of the operator. When another process is busy on one of those cores, every
barrier waits for the thread that shares the core with it to be scheduled again: a step made of
hundreds of small operators waits hundreds of times a step, and the run slows far more than the
share of the machine it lost. With one thread per idle core, a run beside busy work slows in
proportion to the cores it lost.
"""
from __future__ import annotations

import os
import time

import torch

SAMPLES = 10
"""Readings of the count of running threads, over :data:`SAMPLE_SECONDS`."""
SAMPLE_SECONDS = 0.2


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and ``taskset`` set)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def running_threads() -> int | None:
    """Threads running or ready to run on the whole machine now (``procs_running`` in /proc/stat,
    this one included), or None where the kernel does not say."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def busy_cores(samples: int = SAMPLES, seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores kept busy by other work: the mean count of running threads over ``seconds``, less
    this process's reading thread; None where it cannot be read."""
    counts = []
    for i in range(samples):
        n = running_threads()
        if n is None:
            return None
        counts.append(n)
        if i + 1 < samples:
            time.sleep(seconds / max(1, samples - 1))
    return max(0.0, sum(counts) / len(counts) - 1)


def omp_threads(omp_env: str | None) -> int | None:
    """The thread count $OMP_NUM_THREADS (``omp_env``) sets, or None where it sets none."""
    text = (omp_env or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def choose_threads(setting: int | str, cores: int, busy: float | None, omp_env: str | None) -> tuple[int, str]:
    """(threads, why) for ``runtime.threads = setting`` on a CPU with ``cores`` usable cores of
    which ``busy`` are busy with other work (None: unknown). A number is taken as it is; with
    "auto", $OMP_NUM_THREADS (``omp_env``) wins where it is set, else one thread per core left
    idle, at least one."""
    if setting != "auto":
        return int(setting), f"threads {setting}: runtime.threads"
    omp = omp_threads(omp_env)
    if omp is not None:
        return omp, f"threads {omp}: $OMP_NUM_THREADS (runtime.threads=auto)"
    if busy is None:
        return cores, f"threads {cores}: one per usable core (how busy the machine is could not be read)"
    taken = min(cores - 1, int(busy + 0.5))
    if taken <= 0:
        return cores, f"threads {cores}: one per usable core, none busy with other work at start (runtime.threads=auto)"
    left = cores - taken
    return left, (f"threads {left}: {taken} of {cores} usable cores busy with other work at start, and threads that "
                  f"share a core with it stall every operator (runtime.threads=auto; set a number to override)")


def apply_threads(n: int) -> None:
    """Set the operator threads of this process (a no-op where it already has ``n``)."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
