"""Differences between torch releases, detected once, in one place, from what the installed
torch offers (never from its version string): the rest of the code asks here.

Tested releases: 2.13.0 and 2.14.1 (CI runs both). pyproject admits nothing older, because
nothing older has run a test; on an older torch these detections pick the equivalent older
spelling where there is one (what each falls back to is said beside it)."""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch


def accepts(fn, name: str) -> bool:
    """Whether the callable ``fn`` takes a keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def ddp_options_for(init) -> dict:
    """DistributedDataParallel keyword arguments for a DDP whose ``__init__`` is ``init``:
    buffers are not synchronised at each forward (batch-norm statistics are averaged before
    each evaluation instead), and no broadcast at construction (every rank starts from the
    same seed, checked by a checksum). torch 2.13 spells the first ``forward_sync_buffers=False``
    (its ``broadcast_buffers`` is deprecated); older releases ``broadcast_buffers=False``,
    which also leaves buffers out of the construction-time sync, moot with ``init_sync=False``.
    ``init_sync`` itself is left out where DDP lacks it (then it broadcasts once at start)."""
    options = {"gradient_as_bucket_view": True}
    if accepts(init, "forward_sync_buffers"):
        options["forward_sync_buffers"] = False
    else:
        options["broadcast_buffers"] = False
    if accepts(init, "init_sync"):
        options["init_sync"] = False
    return options


@functools.cache
def ddp_options() -> dict:
    return ddp_options_for(torch.nn.parallel.DistributedDataParallel.__init__)


def set_recompile_limit(config, limit: int) -> None:
    """Dynamo's per-function graph limit (``recompile_limit``; ``cache_size_limit`` before it
    was renamed), and an error instead of a silent fall-back to eager when it is passed, where
    the release has that switch (``fail_on_recompile_limit_hit``)."""
    if hasattr(config, "recompile_limit"):
        config.recompile_limit = limit
    else:
        config.cache_size_limit = limit
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


def cpu_bf16_units() -> tuple[str, ...]:
    """The CPU's native bf16 arithmetic, as torch's own CPU feature detection reports it:
    "avx512_bf16" (AVX-512 BF16 dot products: Zen 4 and 5, Cooper Lake) and "amx" (AMX tiles:
    Sapphire Rapids and later). Empty where there is neither (bf16 is then emulated in fp32
    code, slower than fp32 itself) or where this torch cannot say (treated as neither)."""
    units = []
    for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported")):
        ask = getattr(torch.cpu, probe, None)
        try:
            if ask is not None and ask():
                units.append(name)
        except RuntimeError:
            pass
    return tuple(units)


def _is_scheduler_node_check(test) -> bool:
    """``isinstance(..., SchedulerNode)`` as an expression tree."""
    return (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance"
            and len(test.args) == 2 and isinstance(test.args[1], ast.Name) and test.args[1].id == "SchedulerNode")


@functools.cache
def fused_reorder_asserts(fused_node_cls) -> bool:
    """Whether inductor's loop reordering of an already fused node (``reorder_loops_by_dep_pair``
    of ``fused_node_cls``) asserts that each node it holds is a plain ``SchedulerNode`` without
    first declining (returning False) where one is not. torch 2.11's asserts, and a compiled
    imagenette step on an H200 stopped there (benchmarks/results/gpu-smoke-h200-torch-2.11-5a1d71f.json);
    2.13's checks ``if not isinstance(snode, SchedulerNode): return False`` first. Read from the
    method's own code, once per class (every compiled run's activation asks); False where the
    method or its source is missing."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fused_node_cls.reorder_loops_by_dep_pair)))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return False
    asserts = declines = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and _is_scheduler_node_check(node.test):
            asserts = True
        if (isinstance(node, ast.If) and isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
                and _is_scheduler_node_check(node.test.operand)):
            declines = True
    return asserts and not declines


def avoid_fused_reorder_assert(config, fused_node_cls) -> str | None:
    """Turn inductor's loop reordering after fusion off (``config.loop_ordering_after_fusion``)
    where this release's fused-node reordering asserts (``fused_reorder_asserts``): a few
    fusions are lost instead of the compile. Returns what was done, for the run record, or None
    where nothing needed doing (every tested release)."""
    if not getattr(config, "loop_ordering_after_fusion", False) or not fused_reorder_asserts(fused_node_cls):
        return None
    config.loop_ordering_after_fusion = False
    return ("inductor: loop reordering after fusion off (this torch's fused-node reordering asserts "
            "instead of declining; torch 2.13 and later decline)")
