"""Building what a run trains, for a runtime: the model (placed on the device, its batch norm
joined to its process group, checked identical on every rank, wrapped for data parallelism,
compiled once per process), the teacher of a distillation, and the training step around
them. The run's :class:`~speedrun.engine.loop.Session` and the batch finder's probe
(:func:`speedrun.engine.plan.fit_batch_to_device`) both build through here."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from ..errors import CheckpointError, RecipeError
from ..models import build_model
from ..models.norm import BatchNorm
from ..recipe import Recipe, load_recipe, steps_per_epoch, total_steps
from . import distributed
from .batch_finder import check_model_memory
from .checkpoint import read_weights
from .distributed import World
from .runtime import Runtime, compiled_model
from .sizes import step_image_shapes
from .weights import load_into
from .step import TrainStep


@dataclass
class BuiltModel:
    """``model``: the parameters, on the device; ``module``: what the training step calls (the
    model, or its data-parallel wrapper); ``forward``: what evaluation calls (``module``
    compiled where the runtime compiles)."""
    model: nn.Module
    module: nn.Module
    forward: Callable


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the model's weights and buffers (to put back after steps that must not train)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fresh_model(recipe: Recipe, source, seed: int) -> nn.Module:
    """The recipe's model for the data of ``source``, initialised from ``seed`` (on the CPU),
    then loaded from the weights ``model.init`` names where it names some."""
    torch.manual_seed(seed)
    model = build_model(recipe.model, source.in_channels, source.num_classes)
    load_into(model, recipe, source.in_channels, source.num_classes, list(source.classes))
    return model


def build_for_run(recipe: Recipe, source, runtime: Runtime, world: World, seed: int) -> BuiltModel:
    """The run's model, built from ``seed`` (see the module docstring). A process compiles a
    given model once: a later build with the same model and runtime gets the same module and
    compiled graphs back, re-initialised from ``seed`` in the same tensors. A model that cannot
    fit on the device is refused naming its fields, before any of it is allocated."""
    check_model_memory(recipe.model, source.in_channels, source.num_classes, runtime.device)

    def build() -> nn.Module:
        model = runtime.place(fresh_model(recipe, source, seed))
        group = distributed.norm_group(recipe.model.norm.sync_ranks, world)
        for m in model.modules():
            if isinstance(m, BatchNorm):
                m.group = group
        distributed.check_same_start(model, world, runtime.device)
        return model
    distributed.check_compiled_buckets(recipe.distributed.bucket_mb, world, runtime.compile)
    wrap = lambda model: distributed.wrap(model, recipe.distributed, world, runtime.device)
    if not runtime.compile:
        model = build()
        module = wrap(model)
        return BuiltModel(model, module, module)
    key = (recipe.model.model_dump_json(), source.in_channels, source.num_classes, str(runtime.device),
           runtime.precision, runtime.cast, runtime.channels_last, runtime.compile_mode, runtime.cuda_graphs, runtime.compile_backend,
           world.size)
    model, forward, reused = compiled_model(key, build, runtime, wrap)
    if reused:                                      # as built from the seed, but in the same tensors
        model.load_state_dict(fresh_model(recipe, source, seed).state_dict())
        model.zero_grad(set_to_none=True)
    return BuiltModel(model, getattr(forward, "_orig_mod", forward), forward)


def load_teacher(path: str | Path, runtime: Runtime, in_channels: int, num_classes: int) -> nn.Module:
    """A teacher model from a run's ``model.pt`` and the ``config.toml`` beside it, on the
    runtime's device and in its memory layout (compiled with the step where the step is);
    any problem is a :class:`CheckpointError` naming ``distill.teacher``."""
    path = Path(path).expanduser()
    config = path.parent / "config.toml"
    where = f"distill.teacher={path}"
    if not path.is_file():
        raise CheckpointError(f"{where}: no such file; give the model.pt of a finished run (its folder "
                              "holds config.toml too)")
    if not config.is_file():
        raise CheckpointError(f"{where}: no config.toml beside it; the teacher must be a run folder's model.pt")
    try:
        teacher_recipe = load_recipe(str(config))
    except RecipeError as err:
        raise CheckpointError(f"{where}: its run's config.toml cannot be used ({err})") from None
    state = read_weights(path, where)
    heads = [v for v in state.values() if v.ndim == 2]
    convs = [v for v in state.values() if v.ndim == 4]
    if not heads or not convs:
        raise CheckpointError(f"{where}: these weights are not those of a speedrun image classifier")
    classes, channels = heads[-1].shape[0], convs[0].shape[1]
    if (classes, channels) != (num_classes, in_channels):
        raise CheckpointError(f"{where}: the teacher classifies {classes} classes of {channels}-channel images; "
                              f"this run's data has {num_classes} classes of {in_channels}-channel images")
    model = build_model(teacher_recipe.model, in_channels, num_classes)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(f"{where}: the weights do not fit the model of its config.toml "
                              f"({str(err).splitlines()[0][:200]})") from None
    return runtime.place(model).eval().requires_grad_(False)


def teacher_for(recipe: Recipe, source, runtime: Runtime) -> nn.Module | None:
    """The run's teacher (``distill.teacher``), or None."""
    if not recipe.distill.teacher:
        return None
    return load_teacher(recipe.distill.teacher, runtime, source.in_channels, source.num_classes)


def train_step_for(recipe: Recipe, source, runtime: Runtime, built: BuiltModel, teacher: nn.Module | None = None,
                   no_sync=nullcontext) -> TrainStep:
    """The training step of ``recipe`` on the data of ``source``, for the built model: its run
    length, epoch length and every step's image shape follow from the data."""
    n = len(source.train_y)
    total, spe = total_steps(recipe, n), steps_per_epoch(n, recipe.data.batch_size)
    return TrainStep(recipe, runtime, built.model, built.module, total, spe,
                     step_image_shapes(recipe, source.image_size, total, spe), teacher, no_sync)
