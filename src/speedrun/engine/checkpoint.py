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

from ..errors import CheckpointError
from ..files import atomic_torch_save

FORMAT = 2
NAME = "checkpoint.pt"
KEYS = {"recipe": dict, "recipe_hash": str, "seed": int, "step": int, "epoch": int, "batch_in_epoch": int,
        "model": dict, "optimizer": dict, "scaler": dict, "epoch_gen_state": torch.Tensor, "host_rng": dict,
        "cpu_rng": torch.Tensor, "losses": torch.Tensor, "correct": torch.Tensor, "history": list,
        "elapsed": float, "paused": dict}


def save(folder: Path, state: dict) -> Path:
    path = Path(folder) / NAME
    atomic_torch_save(path, {"format": FORMAT, **state})
    return path


def read_torch_file(path: Path, what: str, where: str | None = None):
    """``torch.load`` of a file of tensors (weights_only: no code runs), any failure a
    CheckpointError naming the file (or ``where``) and ``what`` it should have held."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:                              # a truncated or foreign file
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise CheckpointError(f"{where or path}: cannot read the {what} ({first}); the file is damaged or not "
                              "speedrun's") from None


def read_weights(path: Path, where: str | None = None) -> dict[str, torch.Tensor]:
    """A model's weights (a run's model.pt): a non-empty dict of tensors."""
    state = read_torch_file(path, "weights", where)
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{where or path}: holds no model weights (a dict of tensors is expected); it is "
                              "not a speedrun run's model.pt")
    return state


def load(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint to resume from (runs write one when "
                              "checkpoint.every_steps or checkpoint.every_epochs is set)")
    state = read_torch_file(path, "checkpoint")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a speedrun checkpoint (it holds a {type(state).__name__})")
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, this speedrun reads format "
                              f"{FORMAT}; finish it with the speedrun version that wrote it, or start again")
    wrong = [k for k, kind in KEYS.items() if not isinstance(state.get(k), kind)]
    if wrong:
        raise CheckpointError(f"{path}: incomplete checkpoint (missing or damaged: {', '.join(wrong)})")
    return state
