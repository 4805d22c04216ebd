"""Freed memory kept in the process on CPUs (``runtime.hold_memory``).

glibc's malloc serves every block of 32 MiB or more (the most its adaptive threshold reaches)
with a fresh ``mmap`` and hands it back with ``munmap`` when it is freed. A training step on
a CPU allocates and frees activations of that size dozens of times, so every step the kernel
maps them anew and faults in and zeroes each 4 KiB page on first touch: a `speedrun flops
cifar10-94 --steps 6` process made 9.3 million minor page faults, and 0.5 million with freed
memory kept (medians of three: benchmarks/results/hold-memory-flops-cifar10-94-intel-xeon-6-167.json). Two ``mallopt`` settings keep it:
``M_MMAP_MAX = 0`` (large blocks come from the heap, whose freed pages are reused) and a
``M_TRIM_THRESHOLD`` that is never reached (the heap's top is not handed back). The cost is
memory that stays with the process after its peak, and a somewhat higher peak where freed
blocks cannot be reused whole (2.11 GiB against 2.02 in that record).

The same settings can be given to any program as the environment variables
``MALLOC_MMAP_MAX_=0`` and ``MALLOC_TRIM_THRESHOLD_=<bytes>``; speedrun sets them itself, at
run time, through the C library.
"""
from __future__ import annotations

import ctypes
import platform

from ..errors import RecipeError

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2 ** 31 - 1
"""The largest value mallopt's int argument holds (2 GiB): the heap's free top is handed back
only when it exceeds this."""

_held = False


def c_library() -> str:
    """'glibc', or another C library's name as Python sees it ('' where it cannot say)."""
    return platform.libc_ver()[0]


def auto_hold_memory(setting: str, device_type: str, libc: str, find_batch: bool = False) -> tuple[bool, str]:
    """(hold?, why) for ``runtime.hold_memory`` = ``setting`` ("auto", "on", "off") on a
    ``device_type`` device in a process linked against ``libc``. "auto" holds on CPUs under
    glibc (on CUDA the activations live in the caching allocator, not in malloc), except with
    ``runtime.find_batch``: the finder's verdict is taken with glibc's defaults, and a run that
    asked to fit its memory keeps them (held memory, never trimmed, needed more address space
    than the probe that fitted: under an address-space limit the run then failed at the batch
    the finder chose). "on" under another C library is refused: there is no mallopt to set."""
    if setting == "off":
        return False, "freed memory returned to the system (runtime.hold_memory=off)"
    if setting == "auto" and find_batch and device_type == "cpu":
        return False, ("freed memory returned to the system: with runtime.find_batch the run keeps the memory "
                       "behaviour the batch was fitted under (runtime.hold_memory=auto)")
    if libc != "glibc":
        if setting == "on":
            raise RecipeError(f"runtime.hold_memory='on' needs glibc's malloc; this process uses "
                              f"{libc or 'another C library'}: use 'auto' or 'off'")
        return False, f"freed memory: left to the C library ({libc or 'unknown'}, not glibc)"
    if setting == "on" or device_type == "cpu":
        return True, ("freed memory kept in the process (glibc: no mmap for large blocks, no trimming), so "
                      "that each step reuses its pages instead of faulting fresh ones in")
    return False, "freed memory: glibc's defaults (tensors on the GPU are held by torch's caching allocator)"


def hold_freed_memory() -> bool:
    """Set glibc's ``M_MMAP_MAX`` to 0 and ``M_TRIM_THRESHOLD`` to :data:`NEVER_TRIM` for this
    process (once); True where both were accepted. Blocks mapped before stay mapped until
    freed; every later one comes from the heap."""
    global _held
    if _held:
        return True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _held = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    return _held
