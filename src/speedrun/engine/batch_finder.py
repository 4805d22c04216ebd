"""The largest batch that fits: try a training step at ``data.batch_size``; on out-of-memory
halve it and try again. The LR and weight decay follow by the recipe's own rule
(``optim.lr_scaling`` from ``optim.ref_batch``), so the recipe keeps its meaning."""
from __future__ import annotations

import gc

import torch

from ..optim.params import step_lr
from ..recipe import Recipe, RecipeError, apply_overrides, recipe_from_dict


OUT_OF_MEMORY_TEXTS = ("can't allocate memory",          # the CPU allocator
                       "cuda out of memory",              # the caching allocator's text, re-raised as RuntimeError
                       "cuda error: out of memory",       # a kernel launch or cudaMalloc outside the caching allocator
                       "cublas_status_alloc_failed",      # cuBLAS's workspace
                       "cudnn_status_alloc_failed",       # cuDNN's workspace
                       "cufft_alloc_failed", "cusolver_status_alloc_failed")
"""Texts of out-of-memory errors that do not arrive as torch.OutOfMemoryError: the libraries
CUDA kernels call allocate their own workspaces and report failure in their own words.
(``CUDNN_STATUS_NOT_SUPPORTED`` and ``CUDNN_STATUS_EXECUTION_FAILED`` are not memory.)"""


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's caching allocator raises torch.OutOfMemoryError; the CPU allocator, cuBLAS,
    cuDNN and a bare CUDA error a RuntimeError saying so (:data:`OUT_OF_MEMORY_TEXTS`)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(t in text for t in OUT_OF_MEMORY_TEXTS)


def _smaller(recipe: Recipe, batch: int, device) -> int:
    k, ghost = recipe.train.accumulate, recipe.model.norm.ghost_batch
    smaller = batch // 2
    if smaller < k or (ghost and (smaller // k) % ghost):
        raise RecipeError(f"out of memory even at data.batch_size={batch} on {device} "
                          "(the finder cannot halve further); use a smaller model or image size")
    return smaller


def _free(runtime) -> None:
    gc.collect()
    if runtime.device.type == "cuda":
        torch.cuda.empty_cache()


def _with_batch(recipe: Recipe, batch: int, runtime, say) -> Recipe:
    new = recipe_from_dict(apply_overrides(recipe.to_dict(), [f"data.batch_size={batch}"]), source=recipe.name)
    say(f"data.batch_size={recipe.data.batch_size} ran out of memory on {runtime.device}; using {batch}. "
        f"Per-step LR {step_lr(recipe.optim, recipe.data.batch_size):.4g} -> {step_lr(new.optim, batch):.4g} "
        f"({recipe.optim.lr_scaling} scaling from optim.ref_batch={recipe.optim.ref_batch})")
    return new


def halve_batch(recipe: Recipe, runtime, say=print) -> Recipe:
    """The recipe with half the batch, after an out-of-memory error during training."""
    _free(runtime)
    return _with_batch(recipe, _smaller(recipe, recipe.data.batch_size, runtime.device), runtime, say)


def fit_batch(recipe: Recipe, probe, runtime, say=print) -> Recipe:
    """The recipe with the largest data.batch_size (halving from the recipe's) whose training
    step fits: ``probe(recipe)`` runs one real training step of a recipe on random data (the
    same :class:`~speedrun.engine.step.TrainStep` the run uses, optimizer state included)."""
    batch = recipe.data.batch_size
    candidate = recipe
    while True:
        try:
            probe(candidate)
            break
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not is_out_of_memory(err):
                raise
            del err
            _free(runtime)
            batch = _smaller(recipe, batch, runtime.device)
            candidate = recipe_from_dict(apply_overrides(recipe.to_dict(), [f"data.batch_size={batch}"]),
                                         source=recipe.name)
    return recipe if batch == recipe.data.batch_size else _with_batch(recipe, batch, runtime, say)
