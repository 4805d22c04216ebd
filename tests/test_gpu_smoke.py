"""benchmarks/gpu_smoke.py's GPU-busy fraction, from kernel intervals (the parts the CPU can
check), and its profiling window on a real session (on the CPU: wall time only)."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from speedrun.engine.loop import Session
from speedrun.engine.runtime import Runtime
from speedrun.recipe import load_recipe

_spec = importlib.util.spec_from_file_location("gpu_smoke", Path(__file__).parents[1] / "benchmarks" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_smoke)


def test_busy_time_counts_each_kernel_once_and_overlaps_once():
    assert gpu_smoke.covered([(0, 2), (1, 3), (5, 6)]) == 4            # (0, 3) and (5, 6)
    assert gpu_smoke.covered([(0, 10), (2, 3), (4, 5)]) == 10          # nested kernels on other streams
    assert gpu_smoke.covered([]) == 0
    assert gpu_smoke.busy_fraction([(0, 2), (1, 3), (5, 6)], (0, 10)) == pytest.approx(0.4)
    # kernels are clipped to the window: work before or after it is not counted
    assert gpu_smoke.busy_fraction([(-5, 1), (9, 20)], (0, 10)) == pytest.approx(0.2)
    assert math.isnan(gpu_smoke.busy_fraction([(0, 1)], (3, 3)))


def test_the_profiled_window_runs_real_steps_after_the_run(fashion):
    small = dataclasses.replace(fashion, train_x=fashion.train_x[:1024], train_y=fashion.train_y[:1024],
                                test_x=fashion.test_x[:256], test_y=fashion.test_y[:256])
    recipe = load_recipe("fashion-mnist", ["model.widths=[8,8,8]", "data.batch_size=128", "train.epochs=1",
                                           "eval.batch_size=256"])
    session = Session(recipe, small, Runtime(torch.device("cpu"), "fp32", False, True))
    out = gpu_smoke.profile_steps(session, torch.device("cpu"), steps=10)   # more steps than a run has (8)
    assert out["steps"] == 10 and out["wall_ms_per_step"] > 0 and "busy_fraction" not in out
