"""The plan of a run: what a recipe becomes on given data and a given device, settled once, in
one order, before anything trains.

1. the data is opened (``open_source``): found or fetched, verified, decoded into its cache;
   the values the recipe leaves to the data (``auto``) are filled in from it;
2. the runtime is resolved for the device (``resolve_runtime``), now that the run's length
   and model are known: precision, compilation, memory format;
3. the batch is fitted to the device (``fit_batch_to_device``) where ``runtime.find_batch`` asks for it.

``speedrun train``, ``bench``, ``ablate`` and ``flops``, the step-structure probe and the
benchmark scripts all start from :func:`plan_run`, so a recipe runs the same way under each.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..data.pipeline.dataset import open_source, start_workers_early
from ..data.sources.holdout import holdout_images
from ..models.custom import recorded
from ..models.network_check import check_network, network_line
from ..optim.orthogonal import ns_dtype
from ..recipe import Recipe, init_is_weights, steps_per_epoch, total_steps
from .batch_finder import fit_batch as fit_batch_to
from .build import build_for_run, snapshot, teacher_for, train_step_for
from .compiling import CompilePlan, compile_cache_location, compile_plan_line
from .distributed import World
from .runtime import Runtime, resolve_runtime
from .sizes import run_image_sides, sizes_share_one_graph
from .warmup import eval_pad
from .weights import loaded_lines, normalise_as_trained, settle_model, start_of, weights_for


def fit_batch_to_device(recipe: Recipe, source, runtime: Runtime, say=print) -> Recipe:
    """The recipe with its batch fitted to the device (``runtime.find_batch``): the largest
    ``data.batch_size``, halving from the recipe's, whose real training step fits. The probe
    builds the run's model (the run then gets the same compiled model back) and tries one
    step of each candidate recipe on random data at LR 0, putting the weights back after."""
    if not recipe.runtime.find_batch:
        return recipe
    runtime = runtime.activate(hold_memory=False)       # a failed probe's memory handed back before the next
    built = build_for_run(recipe, source, runtime, World(), recipe.train.seed)
    teacher = teacher_for(recipe, source, runtime)

    def probe(candidate: Recipe) -> None:
        step = train_step_for(candidate, source, runtime, built, teacher)
        step.idle()
        batch = candidate.data.batch_size
        x = torch.randn(batch, source.in_channels, *source.image_size, device=runtime.device, dtype=runtime.dtype)
        y = torch.randint(0, source.num_classes, (batch,), device=runtime.device)
        saved = snapshot(built.model)
        try:
            step(x.contiguous(memory_format=runtime.memory_format), y)
            runtime.synchronize()
        finally:
            built.model.load_state_dict(saved)
            for p in built.model.parameters():
                p.grad = None
    return fit_batch_to(recipe, probe, runtime, say)


@dataclass
class Plan:
    """A recipe settled for its data and device: ``recipe`` (the data's choices and the fitted
    batch filled in), the opened ``source``, the resolved ``runtime``; ``choices`` says what
    the data and the device chose and why, one line each; ``open_seconds`` is the time the
    data took to open (reading, verifying, decoding into the cache)."""

    recipe: Recipe
    source: object
    runtime: Runtime
    choices: list[str] = field(default_factory=list)
    open_seconds: float = 0.0


def compile_plan(recipe: Recipe, source, runtime: Runtime) -> CompilePlan:
    """The shapes a compiled run of ``recipe`` on ``source`` compiles in its warm-up (one
    process's share of the evaluation)."""
    steps = total_steps(recipe, len(source.train_y))
    epochs = math.ceil(steps / steps_per_epoch(len(source.train_y), recipe.data.batch_size))
    held = holdout_images(source)                   # (train.stop_at_target's validation split)
    evaluated = (eval_pad([len(source.test_y), held], recipe.eval.batch_size),)      # padded to one size
    return CompilePlan(tuple(run_image_sides(recipe, source.image_size[0], epochs)), evaluated, steps,
                       sizes_share_one_graph(recipe, runtime.device.type, runtime.compile_backend))


def target_stop_line(recipe: Recipe, source) -> str:
    """What train.stop_at_target will do, said at the start of the run."""
    every = recipe.train.stop_check_every
    when = "after each epoch" if every == 1 else f"every {every} epochs"
    return (f"stopping at the target {recipe.target:.2%} on a validation split of {holdout_images(source):,} training "
            f"images held out (data.holdout={recipe.data.holdout:g}, never trained on; the test set is not read for "
            f"it), checked {when} with the averaged weights, no TTA; the checks' time counts in the run's")


def newton_schulz_dtype(recipe: Recipe, runtime: Runtime) -> str | None:
    """'bf16' or 'fp32' for a run with orthogonalised filter updates (optim.ns_precision as
    resolved for this runtime), None without them."""
    if recipe.optim.filters != "orthogonal":
        return None
    return "bf16" if ns_dtype(recipe.optim.ns_precision, runtime.device.type,
                              runtime.precision) == torch.bfloat16 else "fp32"


def run_sides(recipe: Recipe, source) -> tuple[list[int], int]:
    """(every image side the run trains at, the side it evaluates at)."""
    steps = total_steps(recipe, len(source.train_y))
    epochs = math.ceil(steps / steps_per_epoch(len(source.train_y), recipe.data.batch_size))
    evaluated = (getattr(source, "eval_size", None) or source.image_size)[0]
    return run_image_sides(recipe, source.image_size[0], epochs), evaluated


def checked_network(recipe: Recipe, source) -> tuple[Recipe, list[str]]:
    """A network speedrun does not build itself (timm's, your factory), checked against the
    data before anything of the run is written: built (shapes only) and run on two images of
    each side the run uses, it must answer one logit per class. Your factory's file is recorded
    in the recipe (its absolute path and SHA-256). The line that says which network it is, from
    which weights, at which sizes."""
    if recipe.model.name == "custom":
        recipe = recipe.with_values(recorded(recipe.model))
    trained, evaluated = run_sides(recipe, source)
    model = check_network(recipe.model, source.in_channels, source.num_classes, [*trained, evaluated])
    if model is None:
        return recipe, []
    weights = "" if init_is_weights(recipe.model.init) else "; from random weights (" + (
        "timm's own initialisation)" if recipe.model.name == "timm" else "your factory's initialisation)")
    size = f"; trained at {'/'.join(map(str, trained))} px, evaluated at {evaluated} px"
    ft = recipe.finetune
    tuned = "" if not ft.active else "; fine-tuned" + (
        f": the classifier alone for {ft.head_epochs:g} epochs" if ft.head_epochs else "") + (
        f", then each block's LR from {ft.lr_first:g}x (its first) to 1x (the classifier)" if ft.lr_first < 1 else "")
    return recipe, [network_line(recipe.model, model) + weights + size + tuned]


def plan_run(recipe: Recipe, data_dir, device: torch.device, say: Callable[[str], None] | None = None,
             announce: bool = False, fit_batch: bool = True) -> Plan:
    """Open the data, resolve the runtime and fit the batch, once, in that order.

    ``say`` hears what is being done (a cache being made, a batch being fitted; without it the
    cache is made silently and the batch finder prints); with ``announce`` it also hears the
    plan's choices as they are made (what the data chose, what the runtime chose, the
    Newton-Schulz precision). ``fit_batch=False`` leaves the batch as the recipe has it (for
    callers that fit it themselves)."""
    t0 = time.perf_counter()
    if init_is_weights(recipe.model.init):
        start_workers_early(recipe)                 # (its start overlaps the weights' opening)
    recipe, source = open_source(recipe, data_dir, say, start_of(recipe))
    recipe, started = settle_model(recipe)
    recipe, network = checked_network(recipe, source)
    started += normalise_as_trained(source, weights_for(recipe)) + loaded_lines(recipe, source) + network
    opened = time.perf_counter() - t0
    choices = []
    if getattr(source, "choices", None):
        choices.append("from the data: " + "; ".join(source.choices))
    choices += started
    if recipe.train.stop_at_target:
        choices.append(target_stop_line(recipe, source))
    # resolved once the run's length is known: on a CPU, "auto" compiles only where that pays
    runtime = resolve_runtime(recipe.runtime, device, recipe.model.name, total_steps(recipe, len(source.train_y)),
                              recipe.model.norm.fp32)
    choices += list(runtime.choices)
    if runtime.compile:
        cache = compile_cache_location() if runtime.compile_backend == "inductor" else None
        choices.append(compile_plan_line(compile_plan(recipe, source, runtime), device.type, recipe.model.name, cache))
    ns = newton_schulz_dtype(recipe, runtime)
    if ns:
        choices.append(f"orthogonalised filter updates: Newton-Schulz products in {ns} "
                       f"(optim.ns_precision={recipe.optim.ns_precision})")
    if announce and say is not None:
        for line in choices:
            say(line)
    if fit_batch:
        recipe = fit_batch_to_device(recipe, source, runtime, say or print)
    return Plan(recipe, source, runtime, choices, opened)
