"""The plain records of a run: one epoch's figures, one epoch's steps for the metric logs,
and a finished run's result. The loop writes them, checkpoints keep the history, and the
commands and loggers read them; this module imports no other part of the engine."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EpochRecord:
    """One epoch's figures: a line of the run's metrics.jsonl and an entry of its history."""
    epoch: int
    train_loss: float
    train_acc: float
    test_acc: float | None
    lr: float
    seconds: float                        # this epoch's training seconds
    skipped_steps: int = 0
    seconds_total: float = 0.0            # the run's training seconds so far (the last: with the final evaluation)


@dataclass
class EpochSteps:
    """One epoch's training steps as host values, for metric logs: the losses from the
    epoch's one read-back, the weight group's learning rate and the momentum (when the
    schedule sets it) from the precomputed schedule. Steps are numbered from 1."""
    epoch: int
    first_step: int
    loss: list[float]
    lr: list[float]
    momentum: list[float] | None


@dataclass
class RunResult:
    """What one training run of a :class:`~speedrun.engine.loop.Session` gives back."""
    seed: int
    test_acc: float
    test_acc_no_tta: float
    epochs: float
    steps: int
    train_seconds: float
    monitor_seconds: float
    bookkeeping_seconds: float = 0.0
    final_eval_seconds: float = 0.0             # the final evaluation with TTA (inside train_seconds)
    recompiles: int = 0
    history: list[EpochRecord] = field(default_factory=list)
    state_dict: dict | None = None
    skipped_images: int = 0
    skipped_files: dict[str, str] = field(default_factory=dict)   # unreadable images skipped: path -> why
    resumed_from_step: int | None = None
    normalisation: tuple[list[float], list[float]] = ((), ())   # per-channel mean, std (0..255)
    test_images: int = 0
    pass_images: list[int] = field(default_factory=list)   # data.prune: training images visited per pass
