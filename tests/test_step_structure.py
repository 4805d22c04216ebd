"""The training step's structure, counted as benchmarks/step_structure.py counts it: compiled,
a step is at most three compiled regions (forward + loss, its backward, the update) with no
graph breaks, at most ten eager compute ops between them and no host sync, in fp32, bf16
and fp16 with loss scaling; eager, it has no host sync either. These fail when an eager op
or a sync creeps back into the step.

Compiled with aot_eager (dynamo's capture and AOTAutograd's joint graph, as inductor gets
them, without code generation), on narrow nets, batches of 64 (fp16: 32) and 64 test images:
the counts do not depend on width or batch size (on a CPU without native bf16 and fp16,
half-precision convolutions run a slow reference kernel, and these sizes keep the tests short
there). Some
steps are counted as a CPU runs them, others as CUDA runs them with CUDA graphs on (the GPU
record recipe's way), where the compiled graphs' inputs are checked in the same compile."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from speedrun.engine.loop import Session
from speedrun.engine.precision import NONFINITE_PATIENCE, NonFiniteLoss
from speedrun.engine.runtime import BACKEND_VARIABLE, Runtime
from speedrun.profiling.step_structure import as_on_cuda, cuda_graph_inputs, measure, profiled
from speedrun.recipe import load_recipe

from matrix import CUDA_GRAPH_ROWS, STEP_ROWS, STRUCTURE_BATCHES, structure_slice

CPU = torch.device("cpu")
SRC = Path(__file__).resolve().parents[1] / "src" / "speedrun"


@pytest.fixture(scope="module")
def cifar_slice(cifar10):
    return structure_slice(cifar10)


def _structure(name, data, precision, compiled, monkeypatch, *sets):
    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    recipe = load_recipe(name, [*STRUCTURE_BATCHES, *sets])
    return measure(recipe, data, Runtime(CPU, precision, compiled, True, "default", "aot_eager"), steps=4)


@pytest.mark.parametrize("name, precision, sets, on_cuda", STEP_ROWS)
def test_a_compiled_step_is_three_regions_with_no_breaks_few_eager_ops_and_no_sync(
        name, precision, sets, on_cuda, cifar_slice, fashion, monkeypatch):
    """Counted as a CPU runs the step, or (``on_cuda``) as CUDA runs it with CUDA graphs on,
    whose graphs' inputs are then checked too (see the test below)."""
    data = structure_slice(fashion) if name == "fashion-mnist" else cifar_slice
    if on_cuda:
        runtime, graphs = as_on_cuda(precision)
        s = measure(load_recipe(name, [*STRUCTURE_BATCHES, *sets]), data, runtime, steps=4)
        _check_cuda_graph_inputs(graphs)
    else:
        s = _structure(name, data, precision, True, monkeypatch, *sets)
    assert s["graph_breaks"] == 0 and s["graph_breaks_during_steps"] == 0 and s["recompiles_during_steps"] == 0, s
    assert s["compiled_regions_per_step"] <= 3, s
    assert s["eager_ops_per_step"] <= 10, s["eager_op_names_worst_step"]
    assert s["host_syncs_per_step"] == 0, s["sync_ops_worst_step"]


def test_an_eager_step_has_no_host_sync_either(cifar_slice, monkeypatch):
    s = _structure("cifar10-94-fast", cifar_slice, "fp32", False, monkeypatch, "model.widths=[16,32,32]")
    assert s["compiled_regions_per_step"] == 0 and s["host_syncs_per_step"] == 0, s["sync_ops_worst_step"]
    assert s["eager_ops_per_step"] > 100            # the count sees an eager step's work
    # the pipeline's batch is counted apart, without the run's set-up (whitening fit, resets)
    assert 5 < s["pipeline_eager_ops_per_batch"] <= 40, s["pipeline_eager_ops_per_batch"]


def test_the_counter_sees_syncs_eager_ops_and_compiled_regions():
    """The negative controls: what the step must not do is counted when it happens."""
    t = torch.randn(8)
    assert profiled(lambda: t.sum().item())["host_syncs"] == 1
    assert profiled(lambda: bool(t.any()))["host_syncs"] == 1
    assert profiled(lambda: t.tolist())["host_syncs"] == 1
    assert profiled(lambda: t.nonzero())["host_syncs"] == 1
    eager = profiled(lambda: (t * 2 + 1).view(2, 4).exp())
    assert eager["eager_ops"] == 3 and eager["eager_op_names"] == ["aten::add", "aten::exp", "aten::mul"]
    f = torch.compile(lambda x: (x * 2 + 1).exp(), backend="aot_eager")
    f(t)
    compiled = profiled(f, t)
    assert compiled["compiled_regions"] == 1 and compiled["eager_ops"] == 0


def test_one_place_in_the_training_code_runs_backward():
    """The step reads top to bottom in engine/step.py, the one caller of backward (FLOP
    counting, which measures a backward pass, aside)."""
    calls = [(p.relative_to(SRC).as_posix(), n) for p in SRC.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\.backward\(", line)]
    assert [c[0] for c in calls if c[0] != "engine/flops.py"] == ["engine/step.py"], calls


class InfGradients:
    """A gradient hook that makes one parameter's gradient infinite on every backward pass:
    an fp16 overflow in the gradients while the loss itself stays finite."""

    def __call__(self, grad):
        return grad * math.inf


def test_fp16_gradient_overflow_with_a_finite_loss_is_skipped_on_the_device_and_counted(fashion):
    """The loss scale collapses when every step's gradients overflow, though each loss is
    finite: the steps are undone on the device (weights unchanged), counted as skipped, and
    after NONFINITE_PATIENCE of them in a row the run stops, saying why."""
    # 16 steps of 32 an epoch (fp16 is slow on a CPU: a quarter of the work of 2,048 images in
    # batches of 128, the same steps)
    small = dataclasses.replace(fashion, train_x=fashion.train_x[:512], train_y=fashion.train_y[:512],
                                test_x=fashion.test_x[:64], test_y=fashion.test_y[:64])
    recipe = load_recipe("fashion-mnist", ["model.widths=[8,16,16]", "data.batch_size=32", "train.epochs=2",
                                           "eval.every=0", "eval.batch_size=64", "averaging.kind=none"])
    session = Session(recipe, small, Runtime(CPU, "fp16", False, True))
    head = session.model.head.weight
    handle = head.register_hook(InfGradients())
    start = head.detach().clone()
    with pytest.raises(NonFiniteLoss) as err:
        session.run()
    handle.remove()
    assert err.value.step == NONFINITE_PATIENCE and math.isfinite(err.value.value)
    assert "overflowed" in str(err.value) and "loss scale" in str(err.value)
    assert torch.equal(err.value.last_good["head.weight"], start)      # epoch 1: every step undone
    # the epochs' 32 steps all ran (the loop looks at an epoch's flags once, at its end): 32 halvings
    assert float(session.step.precision.scaler.scale) == 2.0 ** (16 - 32)


def _check_cuda_graph_inputs(graphs: list[dict]) -> None:
    update = max(graphs, key=lambda g: g["mutated"])
    assert update["mutated"] > 40 and update["static"] >= update["mutated"], graphs    # the update: seen
    for g in graphs:
        assert g["shared_storage"] == [] and g["mutated_not_static"] == 0, g


@pytest.mark.parametrize("name, precision, sets", CUDA_GRAPH_ROWS)
def test_under_cuda_graphs_every_input_a_compiled_graph_mutates_is_static(name, precision, sets, cifar_slice):
    """Inductor runs a graph that mutates an input which is not a static address without CUDA
    graphs. The optimizer update mutates every parameter, optimizer state and averaged tensor;
    the step marks them static, and no two of them may share a storage (AOTAutograd's synthetic
    base for such aliases drops the marks: the averaged weights were state_dict()'s detached
    views of the parameters, and the whole update ran without CUDA graphs on an H200). The
    gradients, new tensors every step, are read and never written (fp16 included: checked with
    the rows of the test above that run as on CUDA)."""
    recipe = load_recipe(name, [*STRUCTURE_BATCHES, *sets])
    _check_cuda_graph_inputs(cuda_graph_inputs(recipe, cifar_slice, precision)["graphs"])


def test_the_fp16_overflow_flag_reads_the_gradients_without_writing_them():
    from speedrun.engine.precision import LossScale
    scaler = LossScale(CPU)
    finite = [torch.randn(5, 3) * 1e4, torch.randn(7)]
    for bad, flagged in [(None, 0.0), (math.nan, 1.0), (math.inf, 1.0), (-math.inf, 1.0)]:
        grads = [g.clone() for g in finite]
        if bad is not None:
            grads[1][3] = bad
        kept = [g.clone() for g in grads]
        flag = scaler.overflowed(grads)
        assert flag.shape == (1,) and float(flag) == flagged, bad
        for a, b in zip(grads, kept):                                   # untouched, to the bit
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert float(scaler.overflowed([])) == 0.0
    assert float(scaler.inverse()) == 2.0 ** -16
