"""FLOP accounting: how much arithmetic a run needs and how close to the hardware it ran.

FLOPs are counted with the formulas of torch's FLOP counter (``torch.utils.flop_counter``'s
registry: matrix products and convolutions, forward and backward) for one forward and one
forward+backward pass of two images. Page's series used the same yardstick: the time the run
would take at 100% of the device's peak rate. The passes run on a CPU copy of the model (a few
hundred MFLOP for the CIFAR-10 nets, about 70 GFLOP for a ResNet-50 at 224 px), or on the meta
device (no memory, no compute) for a timm or user network of over :data:`REAL_COUNT_PARAMS`
parameters. On the meta device, torch's shape functions import its compiler and sympy first:
1.5-2.5 s of a process's start on a 2-core Intel Xeon 6/207 (torch 2.13.0+cpu), against 0.1 s
for the CPU passes of a CIFAR-10 speed net, compiler not imported.

The figures a run's summary needs are kept in ``counts.json`` in speedrun's cache folder
(``$SPEEDRUN_CACHE``, else ``~/.cache/speedrun``), and the next process with the same model
code, sizes, torch and machine reads them there: a measured peak costs 0.4 s in fp32 and 2.5 s
in emulated bf16 (2-core AMD EPYC Zen 3, one thread).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import sys
import time
from collections import Counter
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .evaluate import TTA_VIEWS, chunk_images
from .sizes import step_image_shapes
from ..compat import cpu_bf16_units
from ..errors import SpeedrunError
from ..files import atomic_write_json
from ..models import build_model
from ..recipe import Recipe, steps_per_epoch

KEPT_FILE = "counts.json"
"""Where :func:`kept` keeps FLOP counts and measured peaks, in speedrun's cache folder."""

# Dense (no sparsity) tensor-core peaks in FLOP/s from the vendors' datasheets, for the
# precisions a recipe runs in, keyed by the tokens of the name torch.cuda.get_device_name
# gives (split at spaces and hyphens, upper case). A name matches an entry when it holds all
# of the entry's tokens as whole tokens ("A1000" is not "A100", "L40S" is not "L4"), and the
# entry with the most tokens wins ("H100 NVL" over "H100"). An unknown GPU gets no peak.
KNOWN_PEAKS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("H200",), {"bf16": 989.4e12, "fp16": 989.4e12}),            # H200 SXM (1,979 with sparsity)
    (("H200", "NVL"), {"bf16": 835.5e12, "fp16": 835.5e12}),     # H200 NVL (1,671 sparse)
    (("H100",), {"bf16": 989.4e12, "fp16": 989.4e12}),            # H100 SXM, "NVIDIA H100 80GB HBM3"
    (("H100", "PCIE"), {"bf16": 756.0e12, "fp16": 756.0e12}),    # H100 PCIe (1,513 sparse)
    (("H100", "NVL"), {"bf16": 835.5e12, "fp16": 835.5e12}),     # H100 NVL, per GPU (1,671 sparse)
    (("A100",), {"bf16": 312.0e12, "fp16": 312.0e12}),            # A100 SXM4 and PCIe
    (("V100",), {"fp16": 125.0e12}),                              # V100 SXM2 (no bf16 tensor cores)
    (("V100", "PCIE"), {"fp16": 112.0e12}),
    (("V100S",), {"fp16": 130.0e12}),                             # V100S PCIe
    (("GH200",), {"bf16": 989.4e12, "fp16": 989.4e12}),           # Grace Hopper: its H100 is the SXM part
    (("A10",), {"bf16": 125.0e12, "fp16": 125.0e12}),             # (250 sparse)
    (("A40",), {"bf16": 149.7e12, "fp16": 149.7e12}),             # (299.4 sparse)
    (("T4",), {"fp16": 65.0e12}),
    (("L4",), {"bf16": 121.0e12, "fp16": 121.0e12}),              # (242 sparse)
    (("L40",), {"bf16": 181.0e12, "fp16": 181.0e12}),             # (362 sparse)
    (("L40S",), {"bf16": 362.0e12, "fp16": 362.0e12}),            # (733 sparse)
    (("RTX", "4090"), {"bf16": 165.2e12, "fp16": 165.2e12}),      # fp16 accumulate; 82.6 with fp32
]


def name_tokens(device_name: str) -> frozenset[str]:
    return frozenset(t for t in re.split(r"[\s\-_/]+", device_name.upper()) if t)


def known_peak(device_name: str, precision: str) -> float | None:
    """The datasheet peak of the GPU called ``device_name`` in ``precision``, or None for a
    GPU (or precision) not in :data:`KNOWN_PEAKS`."""
    tokens = name_tokens(device_name)
    matches = [(len(key), peaks) for key, peaks in KNOWN_PEAKS if tokens.issuperset(key)]
    if not matches:
        return None
    return max(matches, key=lambda m: m[0])[1].get(precision)


@functools.lru_cache(maxsize=None)
def measured_peak(device_type: str, precision: str, size: int | None = None, reps: int = 5,
                  trials: int = 2) -> float:
    """Achieved FLOP/s of a large square matrix product in ``precision`` on the device
    (the best of a few trials, so that a momentary stall does not lower it). It is a lower
    bound of the true peak: on CPUs tuned convolution kernels can outrun it, so a utilisation
    above 100% against it is possible there."""
    device = torch.device(device_type)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # On a CPU without native bf16/fp16 arithmetic (no AVX-512 BF16 or AMX) a 2048-wide half
    # product is emulated and took minutes here at every run's end; 1024 (fp32) and 512 (half)
    # still fill the caches' worth of work a lower bound needs.
    n = size or (8192 if device.type == "cuda" else (1024 if precision == "fp32" else 512))
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


# ------------------------------------------------------------------------------------------
# Figures kept for the next process
# ------------------------------------------------------------------------------------------

def _read_kept(path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def kept(kind: str, key: dict, compute):
    """``compute()``, or the value an earlier process computed for the same ``kind`` and ``key``
    and kept in :data:`KEPT_FILE`. A file that is missing, unreadable or not speedrun's only
    means computing again; a cache folder that cannot be written (full, read-only) means not
    keeping, said once per process, and nothing is left there (the atomic write undoes itself)."""
    from ..data.sources.cache import cache_root
    path = cache_root() / KEPT_FILE
    name = hashlib.sha256(json.dumps([kind, key], sort_keys=True).encode()).hexdigest()[:32]
    found = _read_kept(path).get(name)
    if isinstance(found, dict) and found.get("kind") == kind:
        return found["value"]
    value = compute()
    try:
        atomic_write_json(path, {**_read_kept(path), name: {"kind": kind, "value": value}})
    except (OSError, SpeedrunError) as err:
        if not _NOT_KEPT:                           # the cache is optional: a note, once per process
            _NOT_KEPT.append(path)
            print(f"speedrun: note: FLOP counts are not kept in {path} for the next run: "
                  f"{getattr(err, 'reason', err)}; set $SPEEDRUN_CACHE to a folder that can be written to keep them",
                  file=sys.stderr, flush=True)
    return value


_NOT_KEPT: list = []
"""Where :func:`kept` could not keep its figures in this process (said once)."""


@functools.lru_cache(maxsize=None)
def models_digest() -> str:
    """A digest of the model code (speedrun.models' source): a kept FLOP count is for this code."""
    from .. import models
    root = os.path.dirname(models.__file__)
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def kept_peak(device_type: str, device_name: str, precision: str) -> float:
    """:func:`measured_peak`, kept per machine (the device's name and thread count, the CPU's
    native half-precision units), torch release and precision."""
    key = {"device": device_name, "torch": torch.__version__, "precision": precision, "cores": os.cpu_count(),
           "arch": platform.machine(), "bf16_units": list(cpu_bf16_units()) if device_type == "cpu" else None}
    return kept("measured_peak", key, lambda: measured_peak(device_type, precision))


def per_image_flops(recipe: Recipe, in_channels: int, num_classes: int,
                    image_size: tuple[int, int], whiten_frozen: bool = False) -> dict[str, float]:
    """FLOPs per image of a forward pass and of a training step (forward + backward);
    ``whiten_frozen``: a step after the whitening bias has left the backward (nothing before
    the first convolution needs a gradient, so its input gradient is not computed). Kept
    (:func:`kept`) for this model code, model recipe, channels, classes, size and torch."""
    key = {"models": models_digest(), "torch": torch.__version__, "model": recipe.model.model_dump(mode="json"),
           "in_channels": in_channels, "num_classes": num_classes, "size": list(image_size),
           "whiten_frozen": whiten_frozen}
    return kept("per_image_flops", key,
                lambda: count_per_image_flops(recipe, in_channels, num_classes, image_size, whiten_frozen))


REAL_COUNT_PARAMS = 50_000_000
"""timm's and users' networks with more parameters than this are counted on the meta device,
not on a CPU copy (speedrun's own families are always counted on the CPU: building one on the
meta device draws its initial weights through torch's compiler too)."""
OWN_FAMILIES = ("speednet", "resnet")


class FlopCount(TorchDispatchMode):
    """The FLOPs of the operators run under it, by the formulas of torch's FLOP counter
    (``flop_registry``); an operator without one is first decomposed into those it is made of,
    as ``torch.utils.flop_counter.FlopCounterMode`` does, so the two totals are the same. Not
    wrapped in dynamo's ``disable``, as torch wraps its own modes: nothing here is compiled,
    and that wrapper imports torch's compiler on first use."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet not in flop_registry and func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if packet in flop_registry:
            self.total += flop_registry[packet](*args, **kwargs, out_val=out)
        return out


def count_flops(model, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """FLOPs per image of ``model``'s forward pass and of a training step (forward, cross
    entropy, backward) on the batch ``x``, ``y`` (on any device, the meta device included)."""
    n = x.shape[0]
    with FlopCount() as fwd:
        model(x)
    with FlopCount() as train:
        F.cross_entropy(model(x), y).backward()
    return {"forward": fwd.total / n, "train": train.total / n}


def count_per_image_flops(recipe: Recipe, in_channels: int, num_classes: int,
                          image_size: tuple[int, int], whiten_frozen: bool = False) -> dict[str, float]:
    """:func:`per_image_flops`, counted here: on a CPU copy of the model (its weights drawn
    without touching the run's random numbers), or on the meta device for a large one."""
    n = 2
    device = "cpu"
    if recipe.model.name not in OWN_FAMILIES:        # (speedrun's own: at most a ResNet-152's 60M)
        with torch.device("meta"):
            model = build_model(recipe.model, in_channels, num_classes)
        if sum(p.numel() for p in model.parameters()) > REAL_COUNT_PARAMS:
            device = "meta"
    with torch.random.fork_rng(devices=[]):
        if device == "cpu":
            with torch.device("cpu"):
                model = build_model(recipe.model, in_channels, num_classes)
        model.train()
        whiten = getattr(model, "whiten", None)
        if whiten_frozen and whiten is not None:
            whiten.requires_grad_(False)
        x = torch.zeros(n, in_channels, *image_size, device=device)
        y = torch.zeros(n, dtype=torch.long, device=device)
        return count_flops(model, x, y)


def run_flops(recipe: Recipe, in_channels: int, num_classes: int, image_size: tuple[int, int],
              step_sizes: Sequence[tuple[int, int]], test_images: int,
              eval_size: tuple[int, int] | None = None, frozen_from: int | None = None) -> dict:
    """Total FLOPs of a run: its training steps, each of ``data.batch_size`` images at the size
    it trains at (``step_sizes``, one per step: progressive resizing makes early steps
    cheaper), plus the final evaluation at ``eval_size`` (default: the full training size)
    with its TTA views. ``frozen_from``: the first step whose backward leaves out the frozen
    whitening bias (eager steps in one process: see ``engine.step.drop_frozen_grads``); None
    = every step computes it (the LR-0 freeze)."""
    eval_size = tuple(eval_size or image_size)
    sizes = {tuple(s) for s in step_sizes} | {tuple(image_size), eval_size}
    per_size = {s: per_image_flops(recipe, in_channels, num_classes, s) for s in sorted(sizes)}
    full = per_size[tuple(image_size)]
    steps_at = Counter(tuple(s) for s in step_sizes)
    frozen_at = Counter(tuple(s) for s in step_sizes[frozen_from:]) if frozen_from is not None else Counter()
    frozen = {s: per_image_flops(recipe, in_channels, num_classes, s, whiten_frozen=True) for s in sorted(frozen_at)}
    train = sum(per_size[s]["train"] * (n - frozen_at[s]) for s, n in steps_at.items())
    train = (train + sum(frozen[s]["train"] * n for s, n in frozen_at.items())) * recipe.data.batch_size
    extra_views = len(TTA_VIEWS[recipe.eval.tta]) - 1          # only tta_fraction of images get them
    evaluate = per_size[eval_size]["forward"] * test_images * (1 + extra_views * recipe.eval.tta_fraction)
    return {"flops_per_train_image": full["train"], "flops_per_forward_image": full["forward"],
            "train_steps_by_size": {f"{h}x{w}": n for (h, w), n in sorted(steps_at.items())},
            "steps_without_whitening_gradient": sum(frozen_at.values()),
            "train_flops": train, "eval_flops": evaluate, "total_flops": train + evaluate}



def flops_of_run(recipe: Recipe, source, steps: int, frozen_from: int | None = None) -> dict:
    """:func:`run_flops` for ``steps`` training steps of ``recipe`` on the data of ``source``
    (each step at the size progressive resizing gives it) and the final evaluation at the
    data's evaluation size; ``frozen_from``: the training step's ``frozen_from``."""
    spe = steps_per_epoch(len(source.train_y), recipe.data.batch_size)
    shapes = step_image_shapes(recipe, source.image_size, steps, spe)
    return run_flops(recipe, source.in_channels, source.num_classes, source.image_size, shapes, len(source.test_y),
                     eval_size=source.eval_size, frozen_from=frozen_from)

def efficiency(total_flops: float, seconds: float, device_type: str, device_name: str,
               precision: str, measure: bool | None = None) -> dict:
    """Achieved FLOP/s, the peak it is compared with, utilisation and the ideal time.

    The peak is the datasheet value where the device is known, else (or with measure=True)
    a measured matrix-product rate."""
    peak = None if measure else known_peak(device_name, precision)
    source = "datasheet"
    if peak is None and measure is not False:
        peak, source = kept_peak(device_type, device_name, precision), "measured matmul"
    achieved = total_flops / seconds if seconds > 0 else None
    return {
        "achieved_flops_per_s": achieved,
        "peak_flops_per_s": peak,
        "peak_source": source if peak else None,
        "utilisation": achieved / peak if (achieved and peak) else None,
        "ideal_seconds": total_flops / peak if peak else None,
    }


def eval_chunk(recipe: Recipe, in_channels: int, num_classes: int, eval_size: tuple[int, int],
               device_type: str) -> int | None:
    """Images per model call of the run's evaluations (``eval.chunk``; None: whole batches):
    on a CPU, by default, as many as make :data:`~speedrun.engine.evaluate.EVAL_CHUNK_FLOPS`
    of forward passes, counted as for the run's summary (and kept)."""
    chunk = recipe.eval.chunk
    if chunk != "auto":
        return chunk
    if device_type != "cpu":
        return None
    forward = per_image_flops(recipe, in_channels, num_classes, tuple(eval_size))["forward"]
    return chunk_images(forward)
