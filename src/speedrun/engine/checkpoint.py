"""Checkpoints: everything needed to continue a run so that, on the CPU, the final weights
equal an uninterrupted run's bit for bit.

A checkpoint holds the model, the training step's state (optimizer buffers, weight
average, loss scale, step counter and the metrics table of the run so far), the step and
the position in the epoch, the random-number states that decide the data order and
augmentation (as they were when the epoch began, so the epoch's permutation can be drawn
again; mixing is drawn from the seed), the history so far and the clock. It is written
whole to a temporary file and renamed into place. :func:`save_run` and :func:`restore_run`
are the two ends.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ..errors import CheckpointError, RecipeError
from ..files import atomic_torch_save
from .records import EpochRecord

FORMAT = 3                    # 3: the training step's state in one entry (2: torch.optim state, host mixing rng)
NAME = "checkpoint.pt"
KEYS = {"recipe": dict, "recipe_hash": str, "seed": int, "step": int, "epoch": int, "batch_in_epoch": int,
        "model": dict, "train_step": dict, "epoch_gen_state": torch.Tensor, "cpu_rng": torch.Tensor,
        "history": list, "elapsed": float, "paused": dict}


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


def _averaged_names(model) -> list[str]:
    """The names of the model's tensors that a weight average holds, in its order
    (:func:`speedrun.optim.averaging.state_tensors`: every floating-point entry of the state)."""
    return [name for name, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()]


def rank_state(model, step) -> dict:
    """What one process of a data-parallel run keeps apart from the others, whose weights and
    optimizer state are the same as its own: its batch-norm statistics (its own batches moved
    them), their weight average, and its per-step losses."""
    params = {name for name, _ in model.named_parameters()}
    entries = model.state_dict(keep_vars=True)
    floating = _averaged_names(model)
    shadow = step.averager.shadow if step.averager is not None else None
    averaged = None
    if shadow is not None and len(shadow) == len(floating):
        averaged = {name: shadow[i].detach().cpu().clone() for i, name in enumerate(floating) if name not in params}
    return {"buffers": {name: t.detach().cpu().clone() for name, t in entries.items() if name not in params},
            "averager": averaged, "metrics": step.metrics.detach().cpu().clone()}


@torch.no_grad()
def restore_rank_state(state: dict, rank: int, model, step) -> None:
    """Put back this process's own part of a data-parallel checkpoint (:func:`rank_state`),
    where the checkpoint holds one for ``rank`` (a run resumed on as many processes)."""
    ranks = state.get("ranks")
    if not ranks or rank >= len(ranks):
        return
    own = ranks[rank]
    model.load_state_dict(own["buffers"], strict=False)
    step.metrics.copy_(own["metrics"])
    if own["averager"] is not None and step.averager is not None:
        for i, name in enumerate(_averaged_names(model)):
            if name in own["averager"]:
                step.averager.shadow[i].copy_(own["averager"][name])


def save_run(folder: Path, recipe, seed: int, model, step, st, batch_in_epoch: int, clock: tuple[float, dict],
             ranks: list[dict] | None = None, interrupted: dict | None = None) -> Path:
    """Checkpoint a run in the middle of epoch ``st.epoch``, after ``batch_in_epoch`` of its
    batches (``step``: the :class:`~speedrun.engine.step.TrainStep`, ``st``: the loop's
    RunState, ``clock``: its clock's (elapsed, paused)); ``ranks``: each process's
    :func:`rank_state` in a data-parallel run. ``interrupted``: for a stop during an
    evaluation after the epoch's last step, which evaluation (``evaluation``) and whether the
    training was complete (``training_complete``); a resume does that epoch's end again."""
    elapsed, paused = clock
    return save(folder, {
        **({"ranks": ranks} if ranks else {}),
        **({"interrupted": interrupted} if interrupted else {}),
        "recipe": recipe.to_dict(), "recipe_hash": recipe.digest(), "seed": seed,
        "step": step.steps_done, "epoch": st.epoch, "batch_in_epoch": batch_in_epoch,
        "model": model.state_dict(), "train_step": step.state_dict(),
        "epoch_gen_state": st.epoch_gen_state.cpu(), "cpu_rng": torch.get_rng_state(),
        "history": [asdict(h) for h in st.history], "nonfinite_run": st.nonfinite_run,
        "elapsed": elapsed, "paused": dict(paused),
        **({"pruner": {**step.loss.pruner.state_dict(), "generator": st.gen.get_state().cpu()}}
           if step.loss.pruner is not None else {}),
        **({"target_checks": {"checks": st.target.checks, "seconds": st.target.seconds}}
           if st.target is not None else {}),
    })


def restore_run(state: dict, recipe, model, step, st) -> tuple[float, dict]:
    """Put a checkpoint back into the model, the training step and the loop's RunState;
    returns the clock's (elapsed, paused) to continue from."""
    if state["recipe_hash"] != recipe.digest():
        raise RecipeError("the checkpoint was written by a different recipe; resume with the run's own "
                          "config.toml (speedrun train --resume RUN_DIR)")
    model.load_state_dict(state["model"])
    step.load_state_dict(state["train_step"])
    # Generator.set_state takes a CPU byte tensor, for CUDA generators too
    st.epoch_gen_state = state["epoch_gen_state"].cpu()
    st.gen.set_state(st.epoch_gen_state)
    torch.set_rng_state(state["cpu_rng"])
    st.history = [EpochRecord(**h) for h in state["history"]]
    if step.steps_done != state["step"]:
        raise CheckpointError(f"the checkpoint's step {state['step']} and its training step's counter "
                              f"{step.steps_done} differ; it is damaged")
    st.epoch, st.skip = state["epoch"], state["batch_in_epoch"]
    st.nonfinite_run = state.get("nonfinite_run", 0)
    if st.target is not None and "target_checks" in state:     # train.stop_at_target's checks so far
        st.target.checks, st.target.seconds = state["target_checks"]["checks"], state["target_checks"]["seconds"]
    return state["elapsed"], state["paused"]
