"""What a run compiles and what that pays: torch.compile's options from the recipe's two
choices (the kernel search, ``runtime.compile_mode``, and CUDA graphs, ``runtime.cuda_graphs``),
their cost in compile seconds, the shapes a run compiles against what compiling must save per
step, and the persistent caches that let the next process reuse the compiled code.

Every figure here is a measurement named where it was made, or an estimate said as such.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor keeps its FX-graph and AOTAutograd caches (torch's own variable): where the
user set it, speedrun leaves it; otherwise speedrun points it at :func:`compiled_cache_dir`."""

_USER_CACHE_DIR = os.environ.get(CACHE_VARIABLE)      # (read before any compile in this process sets it)


# ------------------------------------------------------------------------------------------
# The two choices
# ------------------------------------------------------------------------------------------

def auto_cuda_graphs(mode: str) -> bool:
    """``runtime.cuda_graphs = "auto"``: on with ``max-autotune``, as torch's mode of that name
    does, off with the default kernels (what every speedrun recipe has been measured with)."""
    return mode == "max-autotune"


def uses_cuda_graphs(device_type: str, compile_: bool, mode: str, backend: str, graphs: str = "auto") -> bool:
    """Whether compiled code replays as CUDA graphs, so that each training step must begin
    with ``cudagraph_mark_step_begin()``: on CUDA, compiled by inductor (other backends take
    no options), where ``graphs`` is on, or auto and :func:`auto_cuda_graphs` says so."""
    wanted = graphs == "on" or (graphs == "auto" and auto_cuda_graphs(mode))
    return device_type == "cuda" and compile_ and backend == "inductor" and wanted


def inductor_options(mode: str, cuda_graphs: bool) -> dict | None:
    """inductor's options for a kernel search ``mode`` with or without CUDA graphs: torch's own
    table for the mode (``list_mode_options``), its CUDA-graph entry replaced by ours; None
    where that is inductor's defaults. (default + graphs is torch's "reduce-overhead";
    max-autotune without graphs its "max-autotune-no-cudagraphs".)"""
    from torch._inductor import list_mode_options
    options = {k: v for k, v in list_mode_options(mode).items() if k != "triton.cudagraphs"}
    if cuda_graphs:
        options["triton.cudagraphs"] = True
    return options or None


MAX_AUTOTUNE_ON_CPU = ("runtime.compile_mode='max-autotune' searches GPU kernel templates; on a CPU inductor "
                       "fails in its matrix-multiply template: set runtime.compile_mode=default (or runtime.compile=off)")
"""The refusal of a kernel search on a CPU (torch 2.13's inductor wrote a crash file in the update
graph's matrix-multiply template)."""


def choice_costs(device_type: str, mode: str, graphs: bool) -> list[str]:
    """What the two choices cost in compile seconds, one line each, from the records named."""
    if device_type != "cuda":
        return []
    lines = ["kernel search: max-autotune, minutes more compiling (estimate: airbench94_muon's warm-up with it "
             "took 141 s on an H100, speedrun's default-kernel warm-up of cifar10-94-fast 27 s)" if mode == "max-autotune"
             else "kernel search: inductor's default kernels (cifar10-94-fast: 27 s of compiling and warm-up, measured "
             "on an H100)"]
    lines.append("CUDA graphs: on, recording them adds no measurable compile time (cifar10-94-fast: 24 s of warm-up "
                 "with them, 27 s without, on an H100)" if graphs else
                 "CUDA graphs: off (runtime.cuda_graphs=on replays each compiled graph in one launch)")
    return lines


# ------------------------------------------------------------------------------------------
# What a run compiles, against what it must save
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShapeCost:
    """Cold compile seconds per compiled shape (a training size or an evaluation batch size),
    derived from one measured warm-up: ``seconds`` over ``shapes`` shapes, ``where``."""
    seconds: float
    shapes: int
    where: str

    @property
    def per_shape(self) -> float:
        return self.seconds / self.shapes


SHAPE_COSTS = {
    ("cuda", "resnet"): ShapeCost(126.0, 5, "imagenette on an H200: 126 s for 3 training sizes and 2 evaluation "
                                            "batch sizes"),
    ("cuda", "speednet"): ShapeCost(27.0, 3, "cifar10-94-fast on an H100: 27 s for 1 training size and the "
                                             "evaluation at 2 shapes, its batch and its TTA subset"),
    ("cpu", "resnet"): ShapeCost(106.0, 3, "ResNet-50 in bf16 on a 2-core Zen 4: 106 s more warm-up for 1 "
                                           "training size and 2 evaluation batch sizes"),
    ("cpu", "speednet"): ShapeCost(42.0, 3, "cifar10-94-fast in bf16 on a 2-core Zen 4: 40-45 s for 1 training "
                                            "size and the evaluation at 2 shapes, its batch and its TTA subset"),
}
"""Cold compile seconds by device kind and model family (records in benchmarks/results/)."""

CPU_RESNET_BF16_STEP_MS = (704.0, 549.0)
"""A ResNet step in bf16 with fp32 batch norm, eager and compiled, on a 2-core Zen 4
(benchmarks/results/step-structure-amd-epyc-25-17.json: ResNet-50 at 64 px, batch 64): 22%
faster compiled, so its compiling (:data:`SHAPE_COSTS`) pays after about 700 steps."""


def cpu_resnet_pays_after() -> int:
    """Steps after which a compiled bf16 ResNet has paid for its cold compile on a CPU."""
    eager, compiled = CPU_RESNET_BF16_STEP_MS
    return round(SHAPE_COSTS[("cpu", "resnet")].seconds / ((eager - compiled) / 1000))


@dataclass(frozen=True)
class CompilePlan:
    """The shapes a compiled run compiles: its training image sides (one graph for all of
    them where ``shared``: their height and width marked dynamic) and its evaluation batch
    sizes."""
    train_sides: tuple[int, ...]
    eval_batches: tuple[int, ...]
    steps: int
    shared: bool = False

    @property
    def train_graphs(self) -> int:
        return 1 if self.shared else len(self.train_sides)

    @property
    def shapes(self) -> int:
        return self.train_graphs + len(self.eval_batches)


def compile_plan_line(plan: CompilePlan, device_type: str, model: str | None, cache: str | None) -> str:
    """One start line: what the run compiles, a cold estimate of its seconds (said as such,
    from :data:`SHAPE_COSTS`), where the compiled code is cached for the next process, and
    what each step must save for the compiling to pay."""
    sides, n = ", ".join(str(s) for s in plan.train_sides), len(plan.train_sides)
    what = (f"compiling the training step {'once for' if plan.shared and n > 1 else 'at'} {n} image "
            f"size{'s' if n > 1 else ''} ({sides} px) and the evaluation at "
            f"{len(plan.eval_batches)} batch size{'s' if len(plan.eval_batches) > 1 else ''}")
    cost = SHAPE_COSTS.get((device_type, model or ""))
    if cost is None:
        return what + (f"; compiled code cached in {cache}" if cache else "")
    seconds = cost.per_shape * plan.shapes
    line = (f"{what}: about {seconds:.0f} s cold (estimate: {cost.per_shape:.0f} s a shape, from {cost.where})")
    if cache:
        line += f", less where {cache} holds them from an earlier run"
    if plan.steps:
        line += f"; pays if each of the {plan.steps} steps runs {1000 * seconds / plan.steps:.0f} ms faster compiled"
    return line


# ------------------------------------------------------------------------------------------
# Compiled code kept for the next process
# ------------------------------------------------------------------------------------------

def compiled_cache_dir(cache_root: Path | None = None) -> Path:
    """speedrun's folder for inductor's persistent caches: ``compiled/`` in the data cache's
    root (``$SPEEDRUN_CACHE``, else ``~/.cache/speedrun``); deleting it costs one cold compile."""
    from ..data.sources.cache import cache_root as data_cache_root
    return (cache_root or data_cache_root()) / "compiled"


def compile_cache_location(cache_root: Path | None = None) -> str:
    """Where this process's compiled code is kept: the user's ``$TORCHINDUCTOR_CACHE_DIR`` where
    set before speedrun started, else :func:`compiled_cache_dir`."""
    return _USER_CACHE_DIR or str(compiled_cache_dir(cache_root))


COMPILE_CACHE_BYTES = 16 << 20
"""Free space the compile cache's folder needs at least: inductor writes the code it generates
there (and builds it there on a CPU) before the run can use it, a few MiB for a small model."""


def keep_compiled_code(cache_root: Path | None = None) -> str:
    """Point inductor's FX-graph and AOTAutograd caches (on by default in torch) at
    :func:`compile_cache_location`, and make sure both are on; returns the folder. Inductor
    cannot compile without writing there, so a folder that cannot be written (full, read-only)
    stops the run here in one line, before anything is compiled."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config
    from ..data.sources.cache import check_cache_folder
    where = compile_cache_location(cache_root)
    named = f"${CACHE_VARIABLE}" if _USER_CACHE_DIR else "$SPEEDRUN_CACHE"
    check_cache_folder(Path(where), "the compile cache", COMPILE_CACHE_BYTES,
                       f"set {named} to a folder on another disk, or runtime.compile=off to train without compiling")
    os.environ[CACHE_VARIABLE] = where
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return where


def cache_counts() -> dict[str, int]:
    """Inductor's FX-graph cache hits and misses in this process so far (torch's counters): none
    before dynamo is imported (an eager run need not import it, about a second of start-up)."""
    if "torch._dynamo.utils" not in sys.modules:
        return {"hits": 0, "misses": 0}
    from torch._dynamo.utils import counters
    return {"hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "misses": int(counters["inductor"]["fxgraph_cache_miss"])}
