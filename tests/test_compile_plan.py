"""What a compiled run says it compiles and what that pays, and the compiled code kept for
the next process (inductor's persistent caches in speedrun's visible folder)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from speedrun.engine.compiling import SHAPE_COSTS, CompilePlan, compile_plan_line
from speedrun.engine.plan import compile_plan, plan_run
from speedrun.recipe import load_recipe

from conftest import TINY_BENCH


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
    """cifar10-94-cpu trains at 24, 28 and 32 px; 256 test images in batches of 200 are two
    evaluation shapes. Said at start when the run compiles, not when it runs eager."""
    recipe = load_recipe("cifar10-94-cpu", ["data.dataset=npz", "runtime.compile=on", "runtime.precision=fp32",
                                            "eval.batch_size=200", "data.batch_size=256"])
    plan = plan_run(recipe, cifar_small, torch.device("cpu"), fit_batch=False)
    shapes = compile_plan(plan.recipe, plan.source)
    assert shapes.train_sides == (24, 28, 32) and shapes.eval_batches == (56, 200)
    assert any(line.startswith("compiling the training step at 3 image sizes (24, 28, 32 px)") for line in plan.choices)
    eager = plan_run(recipe.with_values({"runtime.compile": "off"}), cifar_small, torch.device("cpu"), fit_batch=False)
    assert not any(line.startswith("compiling") for line in eager.choices)


@pytest.mark.slow
def test_a_second_process_reuses_the_compiled_code_from_speedruns_folder(tmp_path, fashion_small):
    """Two processes of the same small compiled run (inductor on the CPU, fp32), with no
    $TORCHINDUCTOR_CACHE_DIR of the user's: the first compiles into $SPEEDRUN_CACHE/compiled
    and says so at start, the second finds every graph there (inductor's FX-graph cache hits,
    written into the summary). Times are not asserted; the hits are."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["SPEEDRUN_CACHE"] = str(tmp_path / "cache")
    summaries = []
    for name in ("first", "second"):
        proc = subprocess.run([sys.executable, "-m", "speedrun", "train", "fashion-mnist", "--data-dir",
                               str(fashion_small), "--device", "cpu", "--out", str(tmp_path / name), *TINY_BENCH,
                               "--set", "eval.tta=none", "--set", "runtime.compile=on", "--set",
                               "runtime.precision=fp32"], capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr
        assert f"less where {tmp_path / 'cache' / 'compiled'} holds them" in proc.stdout
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    first, second = summaries
    assert first["compile_cache_dir"] == second["compile_cache_dir"] == str(tmp_path / "cache" / "compiled")
    assert first["compile_cache_misses"] > 0 and first["compile_cache_hits"] == 0
    assert second["compile_cache_hits"] == first["compile_cache_misses"] and second["compile_cache_misses"] == 0
    assert any((tmp_path / "cache" / "compiled").rglob("*"))
    assert second["recompiles"] == first["recompiles"] == 0
