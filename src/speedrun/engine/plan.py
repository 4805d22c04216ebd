"""The plan of a run: what a recipe becomes on given data and a given device, settled once, in
one order, before anything trains.

1. the data is opened (``open_source``): found or fetched, verified, decoded into its cache;
   the values the recipe leaves to the data (``auto``) are filled in from it;
2. the runtime is resolved for the device (``resolve_runtime``), now that the run's length
   and model are known: precision, compilation, memory format;
3. the batch is fitted to the device (``settle``) where ``runtime.find_batch`` asks for it.

``speedrun train``, ``bench``, ``ablate`` and ``flops``, the step-structure probe and the
benchmark scripts all start from :func:`plan_run`, so a recipe runs the same way under each.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..data.dataset import open_source
from ..optim.orthogonal import ns_dtype
from ..recipe import Recipe, total_steps
from .loop import settle
from .runtime import Runtime, resolve_runtime


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


def newton_schulz_dtype(recipe: Recipe, runtime: Runtime) -> str | None:
    """'bf16' or 'fp32' for a run with orthogonalised filter updates (optim.ns_precision as
    resolved for this runtime), None without them."""
    if recipe.optim.filters != "orthogonal":
        return None
    return "bf16" if ns_dtype(recipe.optim.ns_precision, runtime.device.type,
                              runtime.precision) == torch.bfloat16 else "fp32"


def plan_run(recipe: Recipe, data_dir, device: torch.device, say: Callable[[str], None] | None = None,
             announce: bool = False, fit_batch: bool = True) -> Plan:
    """Open the data, resolve the runtime and fit the batch, once, in that order.

    ``say`` hears what is being done (a cache being made, a batch being fitted; without it the
    cache is made silently and the batch finder prints); with ``announce`` it also hears the
    plan's choices as they are made (what the data chose, what the runtime chose, the
    Newton-Schulz precision). ``fit_batch=False`` leaves the batch as the recipe has it (for
    callers that fit it themselves)."""
    t0 = time.perf_counter()
    recipe, source = open_source(recipe, data_dir, say)
    opened = time.perf_counter() - t0
    choices = []
    if getattr(source, "choices", None):
        choices.append("from the data: " + "; ".join(source.choices))
    # resolved once the run's length is known: on a CPU, "auto" compiles only where that pays
    runtime = resolve_runtime(recipe.runtime, device, recipe.model.name, total_steps(recipe, len(source.train_y)),
                              recipe.model.norm.fp32)
    choices += list(runtime.choices)
    ns = newton_schulz_dtype(recipe, runtime)
    if ns:
        choices.append(f"orthogonalised filter updates: Newton-Schulz products in {ns} "
                       f"(optim.ns_precision={recipe.optim.ns_precision})")
    if announce and say is not None:
        for line in choices:
            say(line)
    if fit_batch:
        recipe = settle(recipe, source, runtime, say or print)
    return Plan(recipe, source, runtime, choices, opened)
