"""The largest batch that fits: try a training step at ``data.batch_size``; on out-of-memory
halve it and try again. The LR and weight decay follow by the recipe's own rule
(``optim.lr_scaling`` from ``optim.ref_batch``), so the recipe keeps its meaning."""
from __future__ import annotations

import gc
import os

import torch

from ..models import build_model
from ..optim.params import step_lr
from ..recipe import Recipe, RecipeError


OUT_OF_MEMORY_TEXTS = ("can't allocate memory",          # the CPU allocator
                       "could not create a primitive",    # oneDNN (CPU convolutions) when its buffers fail
                       "cuda out of memory",              # the caching allocator's text, re-raised as RuntimeError
                       "cuda error: out of memory",       # a kernel launch or cudaMalloc outside the caching allocator
                       "cublas_status_alloc_failed",      # cuBLAS's workspace
                       "cudnn_status_alloc_failed",       # cuDNN's workspace
                       "cufft_alloc_failed", "cusolver_status_alloc_failed")
"""Texts of out-of-memory errors that do not arrive as torch.OutOfMemoryError: the libraries
CUDA kernels call allocate their own workspaces and report failure in their own words.
(``CUDNN_STATUS_NOT_SUPPORTED`` and ``CUDNN_STATUS_EXECUTION_FAILED`` are not memory.)
oneDNN says "could not create a primitive" whatever failed; for shapes that ran before or run
at a smaller batch that is its scratch memory. With freed memory held in the process
(``runtime.hold_memory``) it is often the first allocation to fail under an address-space limit."""


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
    new = recipe.with_values({"data.batch_size": batch})
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
            candidate = recipe.with_values({"data.batch_size": batch})
    return recipe if batch == recipe.data.batch_size else _with_batch(recipe, batch, runtime, say)


# ------------------------------------------------------------------------------------------
# A model too large for the device: refused before anything is allocated
# ------------------------------------------------------------------------------------------

BYTES_PER_PARAMETER = 16
"""What each parameter needs at the least while training: four fp32 copies (4 bytes each) -
the weights, their gradients, the optimizer's state (momentum) and the averaged copy. The
activations, the second moment of LAMB and AdamW and compiled graphs come on top, so a model
refused on this count cannot train on the device at any batch size; one that passes may still
need ``--find-batch``."""


def count_parameters(cfg, in_channels: int, num_classes: int) -> int:
    """Parameters of the recipe's model, built on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        model = build_model(cfg, in_channels, num_classes)
    return sum(p.numel() for p in model.parameters())


def device_memory(device: torch.device) -> int:
    """Bytes the device can hold: for CUDA its free memory plus what this process's caching
    allocator already holds (a model built earlier in the process is no obstacle); for the CPU
    the machine's RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _size_fields(cfg) -> str:
    """The model fields that set its size, with their values."""
    if cfg.name == "resnet":
        return f"model.width={cfg.width} with model.depth={cfg.depth}"
    if cfg.name in ("timm", "custom"):
        return f"model.arch={cfg.arch}" if cfg.name == "timm" else f"model.factory={cfg.factory}"
    return f"model.widths={list(cfg.widths)}" + (f" with model.stem_width={cfg.stem_width}" if cfg.stem_width else "")


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:,.1f} GiB"


def check_model_fits(cfg, parameters: int, available: int, device) -> None:
    """Refuse a model whose ``parameters`` need more than ``available`` bytes on ``device``
    (:data:`BYTES_PER_PARAMETER` each), naming the model fields that size it."""
    needed = parameters * BYTES_PER_PARAMETER
    if needed <= available:
        return
    fields = _size_fields(cfg)
    fix = ("lower model.width or model.depth" if cfg.name == "resnet" else "choose a smaller network"
           if cfg.name in ("timm", "custom") else "lower model.widths" + (" or model.stem_width" if cfg.stem_width else ""))
    raise RecipeError(f"{fields} makes a model of {parameters:,} parameters, which needs at least {_gib(needed)} "
                      f"to train ({BYTES_PER_PARAMETER} bytes per parameter: weights, gradients, optimizer state "
                      f"and the averaged copy) but {device} has {_gib(available)}; {fix} so that it fits")


def check_model_memory(cfg, in_channels: int, num_classes: int, device: torch.device) -> None:
    """:func:`check_model_fits` for the recipe's model on ``device``, before it is built."""
    check_model_fits(cfg, count_parameters(cfg, in_channels, num_classes), device_memory(device), device)
