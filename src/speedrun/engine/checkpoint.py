"""Checkpoints: everything needed to continue a run so that, on the CPU, the final weights
equal an uninterrupted run's bit for bit.

A checkpoint holds the model, the optimizer (momentum buffers), the loss scaler, the
weight average, the step and the position in the epoch, the random-number states that
decide the data order and augmentation (as they were when the epoch began, so the epoch's
permutation can be drawn again), the host generator used for mixing, the partial metrics
of the current epoch, the history so far and the clock. It is written whole to a
temporary file and renamed into place.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..data.download import DataError
from ..report.record import atomic_torch_save

FORMAT = 1
NAME = "checkpoint.pt"


def save(folder: Path, state: dict) -> Path:
    path = Path(folder) / NAME
    atomic_torch_save(path, {"format": FORMAT, **state})
    return path


def load(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / NAME
    if not path.is_file():
        raise DataError(f"{path}: no checkpoint to resume from (runs write one when "
                        "checkpoint.every_steps or checkpoint.every_epochs is set)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:                              # a truncated or foreign file
        raise DataError(f"{path}: cannot read the checkpoint ({err})") from None
    if state.get("format") != FORMAT:
        raise DataError(f"{path}: checkpoint format {state.get('format')} is not {FORMAT}")
    return state
