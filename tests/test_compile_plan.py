"""What a compiled run says it compiles and what that pays. (The compiled code kept for the
next process, in speedrun's visible folder: the inductor entry of tests/test_recipe_matrix.py.)"""
from __future__ import annotations


import pytest
import torch

from speedrun.engine.compiling import SHAPE_COSTS, CompilePlan, compile_plan_line
from speedrun.engine.loop import Session
from speedrun.engine.plan import compile_plan, plan_run
from speedrun.recipe import load_recipe



def test_the_start_line_counts_the_shapes_and_weighs_the_estimate_against_the_steps():
    plan = CompilePlan((96, 112, 128), (64, 21), 740)
    line = compile_plan_line(plan, "cuda", "resnet", "/home/u/.cache/speedrun/compiled")
    cost = SHAPE_COSTS[("cuda", "resnet")]
    seconds = cost.per_shape * 5
    assert line.startswith("compiling the training step at 3 image sizes (96, 112, 128 px) and the evaluation "
                           "at 2 batch sizes")
    assert f"about {seconds:.0f} s cold (estimate:" in line and cost.where in line
    assert "/home/u/.cache/speedrun/compiled holds them" in line
    assert f"each of the 740 steps runs {1000 * seconds / 740:.0f} ms faster compiled" in line
    # a model family with no measurement: the shapes and the cache only, no invented seconds
    other = compile_plan_line(CompilePlan((32,), (256,), 10), "cpu", "vit", None)
    assert other == "compiling the training step at 1 image size (32 px) and the evaluation at 1 batch size"


def test_the_plan_counts_the_progressive_sizes_and_evaluation_batches(cifar_small):
    """cifar10-94-cpu trains at 24, 28 and 32 px; 256 test images in batches of 200 are one
    evaluation shape, the short last batch padded to 200. Said at start when the run compiles,
    not when it runs eager."""
    recipe = load_recipe("cifar10-94-cpu", ["data.dataset=npz", "runtime.compile=on", "runtime.precision=fp32",
                                            "eval.batch_size=200", "data.batch_size=256"])
    plan = plan_run(recipe, cifar_small, torch.device("cpu"), fit_batch=False)
    shapes = compile_plan(plan.recipe, plan.source, plan.runtime)
    assert shapes.train_sides == (24, 28, 32) and shapes.eval_batches == (200,)
    # inductor on a CPU specializes the sizes: one graph each
    assert not shapes.shared and shapes.train_graphs == 3
    assert any(line.startswith("compiling the training step at 3 image sizes (24, 28, 32 px)") for line in plan.choices)
    eager = plan_run(recipe.with_values({"runtime.compile": "off"}), cifar_small, torch.device("cpu"), fit_batch=False)
    assert not any(line.startswith("compiling") for line in eager.choices)


def _graphs_of(recipe, data, monkeypatch) -> tuple[int, object]:
    """(graphs dynamo compiled for a session's warm-up, the session) of ``recipe`` on ``data``,
    compiled by aot_eager: dynamo's graph capture as inductor gets it, without code generation."""
    from speedrun.engine.runtime import compiled_graphs
    monkeypatch.setenv("SPEEDRUN_COMPILE_BACKEND", "aot_eager")
    plan = plan_run(recipe, data, torch.device("cpu"), fit_batch=False)
    torch._dynamo.reset()
    before = compiled_graphs()
    session = Session(plan.recipe, plan.source, plan.runtime)
    return compiled_graphs() - before, session


@pytest.mark.slow
def test_progressive_sizes_share_one_compiled_step(cifar_small, monkeypatch):
    """cifar10-94-cpu trains at 24, 28 and 32 px: resized in the data pipeline, its step is
    one graph for the three sizes (height and width dynamic) where the compiler keeps them so
    (dynamo's capture and AOTAutograd, here without inductor's code generation, which on a CPU
    specializes them again; see sizes_share_one_graph), so the warm-up compiles exactly
    as many graphs as the same recipe at one size; resized inside the step (bilinear_in_step)
    each side is a constant of the graph, one more graph a side. The shared graph trains as
    eager does (same losses, within float reordering), beyond chance, and never recompiles."""
    base = ["data.dataset=npz", "runtime.compile=on", "runtime.precision=fp32", "model.widths=[8,16,16]",
            "data.batch_size=256", "eval.batch_size=200", "train.epochs=6", "eval.tta=none"]
    progressive, session = _graphs_of(load_recipe("cifar10-94-cpu", base), cifar_small, monkeypatch)
    assert session.image_sides == [24, 28, 32] and session.step.dynamic_sides
    compiled = session.run(seed=0)
    one_size, _ = _graphs_of(load_recipe("cifar10-94-cpu", base + ["data.progressive=[[0.0, 1.0]]"]), cifar_small,
                             monkeypatch)
    in_step, _ = _graphs_of(load_recipe("cifar10-94-cpu", base + ["augment.low_res=bilinear_in_step"]), cifar_small,
                            monkeypatch)
    assert progressive == one_size and in_step == one_size + 2, (progressive, one_size, in_step)
    assert compiled.recompiles == 0
    eager = plan_run(load_recipe("cifar10-94-cpu", base + ["runtime.compile=off"]), cifar_small, torch.device("cpu"),
                     fit_batch=False)
    plain = Session(eager.recipe, eager.source, eager.runtime).run(seed=0)
    assert [h.train_loss for h in compiled.history] == pytest.approx([h.train_loss for h in plain.history], abs=0.02)
    n = compiled.test_images
    assert compiled.test_acc > 0.1 + 3 * (0.1 * 0.9 / n) ** 0.5, compiled.test_acc


def test_which_devices_and_compilers_share_one_graph_across_sizes():
    from speedrun.engine.sizes import sizes_share_one_graph
    progressive = load_recipe("cifar10-94-cpu")
    assert sizes_share_one_graph(progressive, "cuda", "inductor")
    assert sizes_share_one_graph(progressive, "cpu", "aot_eager")
    assert not sizes_share_one_graph(progressive, "cpu", "inductor")          # specialized again there
    in_step = progressive.with_values({"augment.low_res": "bilinear_in_step"})
    assert not sizes_share_one_graph(in_step, "cuda", "inductor")             # the side is a constant of the graph
    assert not sizes_share_one_graph(load_recipe("cifar10-94-fast"), "cuda", "inductor")
    line = compile_plan_line(CompilePlan((112, 128, 144), (64,), 700, shared=True), "cuda", "resnet", None)
    assert line.startswith("compiling the training step once for 3 image sizes (112, 128, 144 px)")
    assert f"about {SHAPE_COSTS[('cuda', 'resnet')].per_shape * 2:.0f} s cold" in line


def test_a_compiled_evaluation_pads_short_batches_to_one_shape_and_keeps_every_images_logits():
    """250 images in batches of 100 end in a batch of 50: padded to 100 with zero images whose
    outputs are dropped, the compiled model sees one batch shape (and, with partial TTA, one
    re-evaluated share) where unpadded it sees two (and two). Each image's logits are its own
    either way; partial TTA re-evaluates at least as many of the short batch's images."""
    from torch import nn
    from speedrun.engine.evaluate import evaluate
    from speedrun.engine.runtime import compiled_graphs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10)).eval()
    x, y = torch.randn(250, 3, 16, 16), torch.randint(0, 10, (250,))
    batches = [(x[i:i + 100], y[i:i + 100]) for i in range(0, 250, 100)]
    results = {}
    for pad in (None, 100):
        for tta, fraction in (("none", 1.0), ("flip", 1.0), ("flip", 0.3)):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="aot_eager", dynamic=False)
            before = compiled_graphs()
            seen = []
            c_tta, c_plain, n = evaluate(compiled, batches, tta, fraction=fraction, pad_to=pad,
                                         on_batch=lambda total, plain, yb: seen.append((total, plain)))
            results[pad, tta, fraction] = (compiled_graphs() - before, int(c_tta), int(c_plain), n, seen)
    for tta, fraction, graphs_padded, graphs_unpadded in (("none", 1.0, 1, 2), ("flip", 1.0, 1, 2),
                                                          ("flip", 0.3, 2, 4)):
        padded, plain = results[100, tta, fraction], results[None, tta, fraction]
        assert (padded[0], plain[0]) == (graphs_padded, graphs_unpadded), (tta, fraction, padded[0], plain[0])
        assert padded[3] == plain[3] == 250 and padded[2] == plain[2]
        assert [len(t) for t, _ in padded[4]] == [100, 100, 50]
        for (tp, pp), (tu, pu) in zip(padded[4], plain[4]):
            torch.testing.assert_close(pp, pu, rtol=1e-5, atol=1e-5)
            if fraction == 1.0:
                torch.testing.assert_close(tp, tu, rtol=1e-5, atol=1e-5)
        if fraction == 1.0:
            assert padded[1] == plain[1]
    # the short batch under partial TTA: 30 of its 50 images re-evaluated padded, 15 unpadded
    short_padded, short_plain = results[100, "flip", 0.3][4][2], results[None, "flip", 0.3][4][2]
    changed = lambda total, plain: int((total - plain).abs().amax(1).gt(0).sum())  # noqa: E731
    assert changed(*short_padded) == 30 and changed(*short_plain) == 15
