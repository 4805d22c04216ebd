"""Metric logs for other tools (``speedrun train --log tensorboard,csv``): TensorBoard event
files in ``tensorboard/`` and two CSV files, ``steps.csv`` and ``epochs.csv``, in the run folder.

Only rank 0 logs, from values already on the host: each epoch's per-step losses arrive after
the loop's one read-back per epoch, and the learning rates and momenta come from the
precomputed schedule, so logging never waits for the device inside a step. The loop calls
these with its clock paused (bookkeeping). A resumed run keeps what was logged up to the start
of the epoch it continues, and logs the rest: CSV rows past that point are dropped (the file
is rewritten atomically, once), and TensorBoard is told to discard later events
(``purge_step``), so no step is logged twice.

CSV rows are appended, one write per epoch, and flushed; a killed run can leave at most a torn
last line, which belongs to steps that a resume drops and logs again.
"""
from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path

from ..errors import RunFolderError, UsageError
from ..files import atomic_write_text, disk_error, make_folder, read_text
from .record import LOG_FILES, RunRecord

KINDS = ("tensorboard", "csv")

EPOCH_COLUMNS = ["epoch", "step", "train_loss", "train_acc", "test_acc", "test_acc_tta", "lr", "seconds",
                 "seconds_total", "skipped_steps", "holdout_acc"]
INSTALL = "pip install tensorboard (or pip install 'speedrun[tensorboard]')"


def parse(values: list[str] | None) -> tuple[str, ...] | None:
    """The loggers named by ``--log`` options (each a name or a comma list); None when none
    was given. ``none`` alone turns logging off."""
    if values is None:
        return None
    names = [n.strip().lower() for v in values for n in str(v).split(",")]
    for n in names:
        if n not in (*KINDS, "none"):
            raise UsageError(f"--log {n!r}: choose tensorboard, csv or none (several as --log tensorboard,csv)")
    if "none" in names and len(set(names)) > 1:
        raise UsageError(f"--log {','.join(names)}: 'none' cannot be combined with a logger")
    return tuple(k for k in KINDS if k in names)


def found_in(folder: Path) -> tuple[str, ...]:
    """The loggers a run folder already holds (a resumed run continues them by default)."""
    return tuple(k for k, name in zip(KINDS, ("tensorboard", "steps.csv")) if (Path(folder) / name).exists())


def require(kinds: tuple[str, ...]) -> None:
    """Check, before any work, that the chosen loggers can be used."""
    if "tensorboard" not in kinds:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as err:
        raise UsageError(f"--log tensorboard needs the tensorboard package, which is not installed ({err}): "
                         f"{INSTALL}") from None
    except Exception as err:                        # installed but broken (e.g. a protobuf it cannot use)
        raise UsageError(f"--log tensorboard: the tensorboard package cannot be imported ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:200] if str(err) else ''}); reinstall it: {INSTALL}") from None


class CsvLog:
    """One CSV file, appended a chunk of rows at a time, with the columns of its first row (or
    of the header it already has). Rows past ``keep`` in the ``key`` column, which an earlier
    attempt of the run wrote, are dropped when it is opened."""

    def __init__(self, record: RunRecord, name: str, key: str, keep: int):
        self.record, self.name, self.path, self.columns = record, name, record.folder / name, None
        if self.path.exists():
            self._trim(key, keep)

    def _trim(self, key: str, keep: int) -> None:
        rows = csv.DictReader(io.StringIO(read_text(self.path, "CSV log", RunFolderError)))
        self.columns = list(rows.fieldnames or []) or None
        kept = [r for r in rows if None not in r and None not in r.values() and _at_most(r.get(key), keep)]
        atomic_write_text(self.record.path_for(self.name), self._text(kept, header=True) if self.columns else "")

    def _text(self, rows: list[dict], header: bool) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, self.columns, extrasaction="ignore", lineterminator="\n")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()

    def write(self, rows: list[dict]) -> None:
        header = self.columns is None
        self.columns = self.columns or list(rows[0])
        text = self._text(rows, header)
        self.record.path_for(self.name)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text)
        except OSError as err:
            raise disk_error(self.path, err) from None


def _at_most(text: str | None, keep: int) -> bool:
    """Whether a row's step (or epoch) number is a whole number up to ``keep``."""
    try:
        return int(text) <= keep
    except (TypeError, ValueError):
        return False


class TensorBoardLog:
    """Scalars in TensorBoard event files, written with TensorBoard's own writer (through
    ``torch.utils.tensorboard``); the writer, and its file, is made at the first value."""

    def __init__(self, record: RunRecord, keep: int):
        self.record, self.folder = record, record.folder / "tensorboard"
        # a resumed (or restarted) run: the reader discards earlier events from this step on
        self.purge = keep + 1 if any(self.folder.glob("events.out.tfevents.*")) else None
        self.writer = None

    def _writer(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            make_folder(self.record.path_for("tensorboard"))
            self.writer = SummaryWriter(str(self.folder), purge_step=self.purge, flush_secs=60)
        return self.writer

    def scalars(self, step: int, values: dict[str, float]) -> None:
        w = self._writer()
        for tag, value in values.items():
            if value is not None:
                w.add_scalar(tag, value, step)

    def flush(self, close: bool = False) -> None:
        if self.writer is not None:
            try:
                self.writer.close() if close else self.writer.flush()
            except OSError as err:
                raise disk_error(self.folder, err) from None
            if close:
                self.writer = None


class MetricLogs:
    """The run's chosen loggers, writing into ``record``'s folder, fed by the loop's
    ``on_steps`` and ``on_epoch`` callbacks and by :meth:`finish`; ``epochs``: how many the
    run has. ``resume``: the checkpoint the run continues from, if any."""

    def __init__(self, record: RunRecord, kinds: tuple[str, ...], epochs: int, resume: dict | None = None):
        self.folder, self.epochs = record.folder, epochs
        keep_step = resume["step"] - resume["batch_in_epoch"] if resume else 0
        keep_epoch = resume["epoch"] if resume else 0
        self.tb = TensorBoardLog(record, keep_step) if "tensorboard" in kinds else None
        self.csv = None
        if "csv" in kinds:
            self.csv = (CsvLog(record, "steps.csv", "step", keep_step),
                        CsvLog(record, "epochs.csv", "epoch", keep_epoch))
        self.step = keep_step
        self.last_row: dict | None = None

    def steps(self, s) -> None:
        """One epoch's steps (a :class:`~speedrun.engine.records.EpochSteps`)."""
        rows = [{"step": s.first_step + i, "epoch": s.epoch, "loss": loss, "lr": lr}
                for i, (loss, lr) in enumerate(zip(s.loss, s.lr))]
        if s.momentum is not None:
            for row, mom in zip(rows, s.momentum):
                row["momentum"] = mom
        if self.tb is not None:
            for row in rows:
                self.tb.scalars(row["step"], {f"step/{k}": v for k, v in row.items() if k not in ("step", "epoch")})
        if self.csv is not None:
            self.csv[0].write(rows)
        self.step = s.first_step + len(s.loss) - 1

    def epoch(self, rec) -> None:
        """One epoch's record (an :class:`~speedrun.engine.records.EpochRecord`), at the step it ended on."""
        if self.tb is not None:
            self.tb.scalars(self.step, {"epoch/train_loss": rec.train_loss, "epoch/train_acc": rec.train_acc,
                                        "epoch/test_acc": rec.test_acc, "epoch/train_seconds": rec.seconds,
                                        **({"epoch/holdout_acc": rec.holdout_acc} if rec.holdout_acc is not None
                                           else {})})
            self.tb.flush()
        if self.csv is not None:
            row = {k: vars(rec).get(k) for k in EPOCH_COLUMNS} | {"step": self.step}
            if rec.epoch < self.epochs:
                self.csv[1].write([row])
            else:
                self.last_row = row          # written by finish, with the accuracy with TTA

    def finish(self, test_acc: float, test_acc_no_tta: float) -> None:
        """The final accuracy, with the recipe's test-time augmentation and without."""
        if self.tb is not None:
            self.tb.scalars(self.step, {"final/test_acc": test_acc, "final/test_acc_no_tta": test_acc_no_tta})
        if self.last_row is not None:
            self.last_row["test_acc_tta"] = test_acc
        self.close()

    def close(self) -> None:
        if self.last_row is not None:
            self.csv[1].write([self.last_row])
            self.last_row = None
        if self.tb is not None:
            self.tb.flush(close=True)

    def remove(self) -> None:
        """Close and delete the logs (an attempt the batch finder abandons)."""
        self.last_row = None
        self.close()
        for name in LOG_FILES:
            path = self.folder / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
