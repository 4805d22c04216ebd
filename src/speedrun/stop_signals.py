"""Stopping a training run on a signal without losing it: SIGTERM (what SLURM sends at
preemption and at the time limit, and torchrun when it stops a job), SIGUSR1 (what a SLURM
job asks for ahead of its time limit with ``--signal=USR1@SECONDS``) and SIGINT (Ctrl-C).

The handler only records the signal; the training loop reads the record on the host at the
next step boundary, or between two batches of an evaluation (the final one, the monitoring
evaluation after an epoch, the target check), checkpoints and ends the run with
:data:`RESUMABLE_EXIT`. A signal that arrives while the checkpoint is written changes nothing
(the handler stays installed until the process has said what it did), and the file is written
to a temporary name and renamed. ``speedrun evaluate`` reads it between its batches too and
ends, writing nothing, with :data:`INTERRUPTED_EXIT`.

This module sits low in the package (the data layer's worker processes use it too): it
imports nothing from speedrun.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from contextlib import contextmanager

RESUMABLE_EXIT = 75
"""The exit code of a run stopped by a signal after writing its checkpoint: EX_TEMPFAIL of
sysexits.h ("try again later"), distinct from errors (1), refused input (2) and an
interruption that saved nothing (130)."""

INTERRUPTED_EXIT = 130
"""The exit code of a command interrupted with nothing saved: Ctrl-C before a run has started
(or a second one), and ``speedrun evaluate`` stopped by any of :data:`SIGNALS` (it has nothing
to continue from: run it again)."""

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """The first of :data:`SIGNALS` that reached this process, while installed. Until the work
    that checks the record has started (``listening``: the training loop, an evaluation that
    checks between batches), and for a second Ctrl-C, SIGINT interrupts at once, as Python's own
    handler does: there is nothing to save yet, or the user insists."""

    def __init__(self):
        self.received: int | None = None
        self.listening = False                # set once the record is read at step or batch boundaries
        self.saving = False                   # set once the stop's checkpoint is being written

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    def _handle(self, signum, frame) -> None:
        if self.saving:                       # the checkpoint is being written, or was: let it be
            return
        if signum == signal.SIGINT and (not self.listening or self.received == signal.SIGINT):
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum

    @contextmanager
    def installed(self):
        """Record the signals for the duration of the block, then put the previous handlers
        back (signals can be caught in the main thread only; elsewhere this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                # after a stop's checkpoint the process is on its way out with RESUMABLE_EXIT: a
                # launcher that saw another rank exit first (torchrun sends SIGTERM to the rest)
                # must not turn this rank's exit into a death by signal
                signal.signal(s, signal.SIG_IGN if self.saving and s != signal.SIGINT else handler)


@contextmanager
def ignored_by_children():
    """Start helper processes inside this block (a fork server, multiprocessing's resource
    tracker): they begin with the stop signals ignored, and so does every process a fork server
    forks later (a data loader's workers). A terminal's Ctrl-C and SLURM signal every process of
    a group or job step; the run's main process alone decides what a stop does, and a helper
    killed by one (the resource tracker dies of SIGUSR1, a fork server of SIGTERM, a worker of
    SIGINT before its first line runs) would fail the run instead. Ignored signals stay ignored
    across ``exec``, which is why this works for a fresh interpreter. Meanwhile this process
    holds the signals back (blocked, not lost) and takes them once the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def worker_of(owner: int, worker_id: int = 0) -> None:
    """The start of a worker process that serves the process ``owner`` (a trainer; a data
    loader's ``worker_init_fn``, with ``functools.partial``): it ignores the stop signals and ends as soon
    as ``owner`` has ended, however it ended. A worker forked by a fork server is the server's
    child, not the owner's, and the server lives as long as any child it forked: without this, a
    trainer killed outright (SIGKILL, the out-of-memory killer) would leave its workers and
    their server running, holding memory and the trainer's output pipes, for ever. (The stop
    signals are set ignored here too, for a worker started by another kind of process.)"""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)

    def watch() -> None:
        wait_until_gone(owner)
        os._exit(0)
    threading.Thread(target=watch, name="speedrun-trainer-watch", daemon=True).start()


def wait_until_gone(pid: int, poll_s: float = 1.0) -> None:
    """Return once process ``pid`` has ended: woken by the kernel through a pidfd, or, where
    there is none (Linux before 5.3, a container that forbids the call), by asking every
    ``poll_s`` seconds."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:
        return poll_until_gone(pid, poll_s)
    select.select([handle], [], [])           # readable once the process has ended
    os.close(handle)


def poll_until_gone(pid: int, poll_s: float) -> None:
    """:func:`wait_until_gone` without a pidfd: whether ``pid`` still exists, every ``poll_s`` s."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except OSError:                       # (alive, owned by another user)
            pass
        time.sleep(poll_s)


def requeue_slurm_job(signum: int | None, env=None) -> str | None:
    """Put this SLURM job back in the queue after a SIGUSR1 (the signal the shipped sbatch
    scripts ask for ahead of the time limit), so it resumes its run folder when it starts
    again; returns the job id, or None where there is nothing to requeue. SIGTERM and SIGINT
    (a cancel, the time limit itself, Ctrl-C) never requeue."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if signum != signal.SIGUSR1 or not job:
        return None
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"`scontrol requeue {job}` could not run ({err})") from None
    if done.returncode != 0:
        raise RuntimeError(f"`scontrol requeue {job}` failed: {(done.stderr or done.stdout).strip()[:300]}")
    return job
