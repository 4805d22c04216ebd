"""Terminal output: a progress bar while training (on a terminal) or plain log lines (in a
log file or a cluster job's output), and a short table at the end."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..errors import UsageError


def make_console(stderr: bool = False) -> Console:
    """A rich console; when output goes to a file or pipe, wide enough that tables do not wrap."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=200)


console = make_console(stderr=True)


@dataclass(frozen=True)
class LogEvery:
    """How often plain progress lines are printed: every ``steps`` steps or ``seconds`` seconds."""
    steps: int = 0
    seconds: float = 30.0

    @classmethod
    def parse(cls, text: str | None) -> "LogEvery":
        """'100' (steps) or '30s' (seconds); None for the default."""
        if text is None:
            return cls()
        t = str(text).strip().lower()
        try:
            if t.endswith("s"):
                value = float(t[:-1])
                if value > 0:
                    return cls(0, value)
            elif int(t) > 0:
                return cls(int(t), 0.0)
        except ValueError:
            pass
        raise UsageError(f"--log-every {text!r}: give a number of steps (e.g. 100) or of seconds (e.g. 30s), above 0")


def epochs_text(epochs: float) -> str:
    """'1 epoch', '3.5 epochs': a run's length in epochs, as its summary gives it."""
    return f"{epochs:g} epoch{'' if epochs == 1 else 's'}"


class EpochCount:
    """A run's epochs as the progress display names them: the whole ones by number, a partial
    last one by the fraction the run reaches (a run of 3.5 epochs: 1/3.5, 2/3.5, 3/3.5, 3.5/3.5),
    so that every line agrees with the summary's epochs."""

    def __init__(self, epochs: float):
        self.epochs = epochs
        self.count = max(1, math.ceil(epochs - 1e-9))      # epochs begun, the last maybe partial

    def label(self, epoch: int) -> str:
        """'k/E' for epoch ``epoch`` (from 1) of E."""
        return f"{min(epoch, self.epochs):g}/{self.epochs:g}"

    def at_step(self, done: int, steps_per_epoch: float) -> int:
        """The epoch (from 1) that runs after ``done`` steps."""
        return min(int(done // steps_per_epoch) + 1, self.count)

    def running(self, epoch: int, reached: float) -> str:
        """The label while epoch ``epoch`` trains, ``reached`` epochs done: the partial last
        epoch (all of a run shorter than one) shows how far it has come, 'k.kk/E'."""
        if epoch < self.count or self.count == self.epochs:
            return self.label(epoch)
        return f"{round(min(reached, self.epochs), 2):g}/{self.epochs:g}"


EVAL_COST = 1 / 3
"""A test image's evaluation against a training image's step, for the ETA's estimate of the final
evaluation: a forward pass of the three (forward, backward, update) a step makes."""


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class LogLines:
    """The loop's progress protocol as plain lines on stdout: one every N steps or seconds
    (step, epoch, images/s, ETA, and the last finished epoch's mean loss) and one per epoch.
    A step's own loss is never read here: that would be a host-device sync inside the timed
    region, which the loop only allows once per epoch with its clock paused."""

    def __init__(self, title: str, every: LogEvery, stream=None):
        self.title, self.every, self.stream = title, every, stream or sys.stdout

    def print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, total_steps: int, epochs: float, batch_size: int, eval_images: int = 0, done: int = 0) -> None:
        """``eval_images``: the images the final evaluation computes (TTA views counted), for
        the ETA's estimate of it; ``done``: the steps a resumed run had trained before."""
        self.total, self.epochs, self.batch = total_steps, EpochCount(epochs), batch_size
        self.steps_per_epoch, self.eval_images = total_steps / epochs, eval_images
        self.done, self.last_loss = done, None
        self.epoch_now = self.epochs.at_step(done, self.steps_per_epoch)
        self.t0 = self.last_t = time.monotonic()
        self.first = self.last_done = done
        self.print(f"{self.title}: {total_steps} steps in {epochs_text(epochs)}, batch {batch_size}")

    def step(self) -> None:
        self.done += 1
        now = time.monotonic()
        due = (self.every.steps and self.done % self.every.steps == 0) or \
              (self.every.seconds and now - self.last_t >= self.every.seconds)
        if not due or self.done == self.total:
            return
        rate = (self.done - self.last_done) * self.batch / max(now - self.last_t, 1e-9)
        per_step = (now - self.t0) / (self.done - self.first)
        final_eval = per_step / self.batch * self.eval_images * EVAL_COST
        eta = per_step * (self.total - self.done) + final_eval
        loss = "" if self.last_loss is None else f" (epoch {self.epoch_now - 1} loss {self.last_loss:.4f})"
        epoch = self.epochs.running(self.epoch_now, self.done / self.steps_per_epoch)
        self.print(f"{self.title} step {self.done}/{self.total} epoch {epoch} {rate:,.0f} img/s ETA "
                   f"{_duration(eta)} (with the final evaluation, estimated at {_duration(final_eval)}){loss}")
        self.last_t, self.last_done = now, self.done

    def epoch(self, rec) -> None:
        test = f" test acc {rec.test_acc:.4f}" if rec.test_acc is not None else ""
        held = f" validation acc {rec.holdout_acc:.4f}" if rec.holdout_acc is not None else ""
        self.print(f"{self.title} epoch {self.epochs.label(rec.epoch)} done: loss {rec.train_loss:.4f} "
                   f"train acc {rec.train_acc:.4f}{held}{test} ({rec.seconds:.1f} s, {rec.seconds_total:.1f} s in all)")
        self.epoch_now, self.last_loss = min(rec.epoch + 1, self.epochs.count), rec.train_loss

    def final_evaluation(self, images: int, tta: str) -> None:
        views = "" if tta == "none" else f", {tta} TTA"
        self.print(f"{self.title} final evaluation: {images:,} test images{views}")

    def target_reached(self, target) -> None:
        self.print(f"{self.title} {target_reached_line(target)}")

    def final_evaluation_done(self, seconds: float) -> None:
        self.print(f"{self.title} final evaluation done in {seconds:.1f} s")


def target_reached_line(target) -> str:
    """'target 90.00% reached on the validation split at epoch 3 (step 120, 14.2 s): 91.20%; stopping'
    (``target``: a run's :class:`~speedrun.engine.records.TargetStop`)."""
    r = target.reached
    return (f"target {target.target:.2%} reached on the validation split at epoch {r['epoch']} (step {r['step']}, "
            f"{r['seconds']:.1f} s): {r['holdout_acc']:.2%}; stopping ({target.checks} check"
            f"{'s' if target.checks != 1 else ''} of {target.holdout_images:,} images took {target.seconds:.2f} s)")


class ProgressBar:
    """The loop's progress protocol as a rich progress bar on stderr."""

    def __init__(self, title: str):
        self.title = title
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
        self.task = None

    def print(self, text: str) -> None:
        self.bar.console.print(text, markup=False, highlight=False)

    def start(self, total_steps: int, epochs: float, batch_size: int, eval_images: int = 0, done: int = 0) -> None:
        self.epochs = EpochCount(epochs)
        if self.task is not None:
            self.bar.remove_task(self.task)
        epoch = self.epochs.at_step(done, total_steps / epochs)
        self.task = self.bar.add_task(f"{self.title} epoch {self.epochs.label(epoch)}", total=total_steps,
                                      completed=done, info="")

    def step(self) -> None:
        self.bar.advance(self.task)

    def epoch(self, rec) -> None:
        test = f" test {rec.test_acc:.4f}" if rec.test_acc is not None else ""
        held = f" validation {rec.holdout_acc:.4f}" if rec.holdout_acc is not None else ""
        nxt = min(rec.epoch + 1, self.epochs.count)
        self.bar.update(self.task, description=f"{self.title} epoch {self.epochs.label(nxt)}",
                        info=f"loss {rec.train_loss:.3f} train {rec.train_acc:.4f}{held}{test}")

    def final_evaluation(self, images: int, tta: str) -> None:
        views = "" if tta == "none" else f", {tta} TTA"
        self.bar.update(self.task, description=f"{self.title} final evaluation ({images:,} test images{views})")

    def target_reached(self, target) -> None:
        self.print(f"{self.title} {target_reached_line(target)}")

    def final_evaluation_done(self, seconds: float) -> None:
        self.print(f"{self.title} final evaluation done in {seconds:.1f} s")


class TrainingProgress:
    """A context manager giving the progress display that suits where output goes: the bar
    when both stdout and stderr are terminals, plain log lines on stdout otherwise."""

    def __init__(self, title: str, log_every: LogEvery | None = None):
        interactive = sys.stdout.isatty() and console.is_terminal
        self.display = ProgressBar(title) if interactive else LogLines(title, log_every or LogEvery())

    def __enter__(self):
        if isinstance(self.display, ProgressBar):
            self.display.bar.start()
        return self.display

    def __exit__(self, *exc):
        if isinstance(self.display, ProgressBar):
            self.display.bar.stop()


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for k, v in rows:
        table.add_row(k, v)
    make_console().print(table)
