"""The structure of a training step, counted on the CPU: what a GPU would have to launch and
wait for. For one recipe in one runtime it measures

- **graph breaks** and graphs dynamo compiled (its counters, over the warm-up, which runs
  every step shape of the run);
- **compiled regions per step**: calls into compiled code (``Torch-Compiled Region`` events
  of the profiler) plus compiled backward graphs (``CompiledFunctionBackward``);
- **eager ops per step**: ATen ops the profiler sees outside compiled regions, counted at the
  outermost level (an op's own sub-ops are not counted again) and leaving out views and other
  aliasing or metadata ops (:data:`NOT_COMPUTE`), which launch no kernel;
- **host syncs per step**: ops that make the host wait for the device on a GPU
  (:data:`SYNC_OPS`: reading a scalar back, data-dependent output sizes), wherever they run,
  plus reads of a tensor's values from Python (``tolist``, ``numpy``).

The step is the run's own :class:`~speedrun.engine.step.TrainStep`, called on the batches of
a real epoch from the run's pipeline; every step is profiled and the maximum is reported. The
pipeline's work per batch (gather, augment) is counted apart: it is not part of the step.

The profiler, unlike a TorchDispatchMode, lets compiled code run compiled (dynamo skips
frames while a dispatch mode is active).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

NOT_COMPUTE = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::detach", "aten::detach_", "aten::alias",
    "aten::_reshape_alias", "aten::reshape", "aten::expand", "aten::t", "aten::transpose", "aten::permute",
    "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze", "aten::split", "aten::split_with_sizes",
    "aten::tensor_split", "aten::chunk", "aten::unbind", "aten::narrow", "aten::flatten", "aten::view_as",
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh", "aten::resolve_conj",
    "aten::resolve_neg", "aten::is_nonzero", "aten::result_type", "aten::contiguous", "aten::_has_compatible_shallow_copy_type",
    "aten::set_", "aten::to",
})
"""ATen ops that only make a new view or metadata (or allocate without writing, or convert
to the dtype/layout a tensor already has: ``aten::to`` and ``contiguous`` that copy show
their ``_to_copy``/``clone`` child, which is then counted as the outermost compute op)."""

SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique",
                      "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                      "aten::repeat_interleave"})
"""Ops that wait for the device on a GPU: a scalar read back (``.item()``, ``bool()``,
``int()`` of a tensor), or an output whose size depends on the data."""

PY_READS = ("tolist", "numpy")
COMPILED = ("Torch-Compiled Region", "CompiledFunction")


@contextmanager
def _python_reads(calls: list):
    """Count ``Tensor.tolist``/``numpy`` calls (reads that bypass the dispatcher)."""
    saved = {name: getattr(torch.Tensor, name) for name in PY_READS}

    def spy(name):
        def read(self, *a, **k):
            calls.append(name)
            return saved[name](self, *a, **k)
        return read
    for name in PY_READS:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _inside(event, markers) -> bool:
    e = event.cpu_parent
    while e is not None:
        if any(m in e.name for m in markers):
            return True
        e = e.cpu_parent
    return False


def _outermost_op(event) -> bool:
    e = event.cpu_parent
    while e is not None:
        if e.name.startswith("aten::"):
            return False
        e = e.cpu_parent
    return True


def count_events(events, python_reads: int = 0) -> dict:
    """Regions, eager compute ops (with their names) and syncs in one profiled step."""
    regions = sum(1 for e in events if e.name.startswith("Torch-Compiled Region") or e.name == "CompiledFunctionBackward")
    eager = [e.name for e in events if e.name.startswith("aten::") and e.name not in NOT_COMPUTE
             and _outermost_op(e) and not _inside(e, COMPILED)]
    syncs = [e.name for e in events if e.name in SYNC_OPS]
    return {"compiled_regions": regions, "eager_ops": len(eager), "eager_op_names": sorted(eager),
            "host_syncs": len(syncs) + python_reads, "sync_ops": sorted(syncs)}


def profiled(fn, *args) -> dict:
    reads: list = []
    with profile(activities=[ProfilerActivity.CPU]) as prof, _python_reads(reads):
        fn(*args)
    return count_events(prof.events(), len(reads))


def _dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters
    return int(sum(counters["graph_break"].values())), int(counters["stats"]["unique_graphs"])


def real_batches(session, seed: int = 0):
    """Batches of a fresh run of ``session`` (model and step reset from ``seed``, whitening
    fitted, both before this returns), epoch after epoch, from the run's own pipeline and
    augmentation, as ``(x, y, size)``: ``size`` is the side the step shrinks the batch to where
    progressive resizing happens inside the step (``augment.low_res = "bilinear_in_step"``; the
    batch then comes at full size), else None. The caller drives the step as the run does:
    ``session.step(x, y, size)``."""
    from ..data.augment.batch import BatchAugment
    from ..data.pipeline.dataset import open_pipeline, place_source
    from ..engine.sizes import epoch_image_side, resized_in_step
    rt, recipe = session.runtime, session.recipe
    session.reset(seed)
    data = open_pipeline(place_source(session.source, rt), recipe, rt, seed, session.shard)
    whiten = getattr(session.model, "whiten", None)
    if whiten is not None:
        whiten.fit(data.whitening_sample(recipe.model.whiten.samples))
    session.step.reset(seed)
    gen = torch.Generator(device=rt.device)
    gen.manual_seed(seed)
    augment = BatchAugment(recipe.augment, data.n_train, data.image_size, gen, rt.device, data.mean, data.std,
                           resized_crop=not data.crops_in_workers, input_size=getattr(data, "stored_size", None))
    session.model.train()
    in_step = resized_in_step(recipe)

    def epochs():                 # (the set-up above runs now, not inside the first batch's count)
        epoch = 0
        while True:
            size = epoch_image_side(recipe, min(epoch, session.n_epochs - 1), data.image_size[0])
            for x, y in data.epoch(epoch, recipe.data.batch_size, augment, gen, size=None if in_step else size):
                yield x, y, size if in_step else None
            epoch += 1
    return epochs()


def timed_step(session, x, y, size=None) -> float:
    """Seconds of one training step on (x, y) (shrunk to ``size`` inside the step where the
    run does that), with the device synchronised before and after."""
    rt = session.runtime
    rt.synchronize()
    t = time.perf_counter()
    rt.mark_step()
    session.step(x, y, size)
    rt.synchronize()
    return time.perf_counter() - t


def measure(recipe, source, runtime, steps: int | None = None, timed_steps: int = 0, seed: int = 0,
            world=None) -> dict:
    """Structure (and, with ``timed_steps``, milliseconds) of the training step of ``recipe``
    on ``source`` in ``runtime``: every step of the first epoch (or the first ``steps``).
    ``world``: this process's place in a data-parallel job whose process group is started
    (the step is then DistributedDataParallel's, with its gradient buckets); default one process."""
    from ..engine.loop import Session
    from ..world import World
    import torch._dynamo as dynamo
    dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    t0 = time.perf_counter()
    session = Session(recipe, source, runtime, warm_up=True, world=world or World())
    build_seconds = time.perf_counter() - t0
    breaks, graphs = _dynamo_counts()
    rt = runtime
    n = min(steps or session.steps_per_epoch, session.steps_per_epoch)
    batches = real_batches(session, seed)
    per_step, pipeline = [], []
    for _ in range(n):
        box = []
        pipeline.append(profiled(lambda: box.append(next(batches))))
        x, y, size = box[0]
        rt.mark_step()
        per_step.append(profiled(session.step, x, y, size))
    ms = [timed_step(session, *next(batches)) * 1e3 for _ in range(timed_steps)]
    breaks_after, graphs_after = _dynamo_counts()
    worst = max(per_step, key=lambda c: (c["eager_ops"], c["host_syncs"], c["compiled_regions"]))
    return {
        "graph_breaks": breaks, "graphs_compiled": graphs, "recompiles_during_steps": graphs_after - graphs,
        "graph_breaks_during_steps": breaks_after - breaks,
        "steps_counted": n,
        "compiled_regions_per_step": max(c["compiled_regions"] for c in per_step),
        "eager_ops_per_step": max(c["eager_ops"] for c in per_step),
        "host_syncs_per_step": max(c["host_syncs"] for c in per_step),
        "eager_op_names_worst_step": worst["eager_op_names"], "sync_ops_worst_step": worst["sync_ops"],
        "pipeline_eager_ops_per_batch": max(c["eager_ops"] for c in pipeline),
        "pipeline_host_syncs_per_batch": max(c["host_syncs"] for c in pipeline),
        "build_and_warm_up_seconds": build_seconds,
        "ms_per_step": ms,
    }


def as_on_cuda(precision: str = "fp32"):
    """A CPU runtime that builds a run as on CUDA with CUDA graphs on (the step marks every
    parameter, optimizer and averaging tensor as a static address, and warms up as cudagraph
    trees would), compiled through AOTAutograd without code generation, and the list its
    compiler fills, graph by graph, with what CUDA graph trees would be given: for each
    forward or inference graph, in compile order, its inputs, the static ones (AOTAutograd's
    ``static_input_indices``, what inductor hands cudagraph trees), the inputs it mutates, and
    the mutated ones that are not static. Inductor runs a graph with any of those last
    without CUDA graphs ("skipping cudagraphs due to mutated inputs"). ``shared_storage``:
    groups of the graph's inputs that are different tensors over one storage (AOTAutograd then
    merges them into a synthetic base and its static marks are lost: the update's averaged
    weights did this while they were ``state_dict()``'s detached views of the parameters).

    Build a :class:`~speedrun.engine.loop.Session` on the runtime (or :func:`measure` the step
    on it) after ``torch._dynamo.reset()``; the list then holds the run's graphs."""
    import dataclasses
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._guards import TracingContext
    from ..engine.runtime import Runtime

    graphs: list[dict] = []

    def forward_compiler(gm, example_inputs):
        meta = TracingContext.try_get().fw_metadata
        static = set(meta.static_input_indices)
        mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data]
        graphs[-1].update(inputs=len(example_inputs), static=len(static), mutated=len(mutated),
                          mutated_not_static=len([i for i in mutated if i not in static]))
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))

    def backend(gm, example_inputs):
        by_storage: dict[int, list[str]] = {}
        for node, t in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            if isinstance(t, torch.Tensor):
                source_ = getattr(node, "_dynamo_source", None)
                by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(
                    source_.name if source_ is not None else node.name)
        graphs.append({"shared_storage": [names for names in by_storage.values() if len(names) > 1]})
        return aot(gm, example_inputs)

    @dataclasses.dataclass(frozen=True)
    class AsOnCuda(Runtime):
        @property
        def cuda_graphs(self) -> bool:
            return True

    return AsOnCuda(torch.device("cpu"), precision, True, True, "default", backend), graphs


def cuda_graph_inputs(recipe, source, precision: str = "fp32") -> dict:
    """What CUDA graph trees would be given, graph by graph, for ``recipe``'s compiled step
    and evaluation, measured on this CPU (:func:`as_on_cuda`): ``graphs``, with the count of
    the step's ``parameters``."""
    import torch._dynamo as dynamo
    from ..engine.loop import Session
    runtime, graphs = as_on_cuda(precision)
    dynamo.reset()
    session = Session(recipe, source, runtime, warm_up=True)   # the warm-up compiles every graph of a run
    return {"graphs": graphs, "parameters": len(session.step.params)}
