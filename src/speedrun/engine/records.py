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
    holdout_acc: float | None = None      # train.stop_at_target: accuracy on the held-out validation split


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
class TargetStop:
    """What train.stop_at_target did in a run: the validation split it checked ``target`` on
    (``holdout_images`` held out of the training images), every ``every`` epochs; how many
    checks it made and their seconds (inside the run's training seconds); ``reached``: where
    the target was reached and the run stopped (epoch, step, the run's seconds then, the
    split's accuracy), None where it never was."""
    target: float
    holdout_images: int
    every: int
    checks: int = 0
    seconds: float = 0.0
    reached: dict | None = None

    def describe(self) -> dict:
        """For the run's records (summary.json, bench.json)."""
        return {"target": self.target, "holdout_images": self.holdout_images, "check_every_epochs": self.every,
                "checks": self.checks, "check_seconds": self.seconds,
                "seconds_per_check": self.seconds / self.checks if self.checks else None,
                "images_per_check": self.holdout_images, "reached": self.reached}


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
    clock_started: float                        # time.perf_counter() when this process started the training clock
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
    target_stop: TargetStop | None = None                   # train.stop_at_target: its checks, where it stopped
