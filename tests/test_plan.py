"""The run plan: the data opened, the runtime resolved and the batch fitted once, in one order,
by one function that every command and benchmark starts from."""
import ast
from pathlib import Path

import torch

from speedrun.engine.plan import plan_run
from speedrun.engine.runtime import cpp_compiler, resolve_runtime
from speedrun.recipe import load_recipe, total_steps

SRC = Path(__file__).resolve().parents[1] / "src" / "speedrun"
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_a_folder_run_is_planned_from_its_data_then_its_device(jpeg32):
    heard = []
    plan = plan_run(load_recipe("folder"), str(jpeg32), torch.device("cpu"), heard.append, announce=True)
    r = plan.recipe
    assert r.data.path == str(jpeg32) and r.data.image_size == 32      # filled in from the data
    assert plan.source.num_classes == 10 and len(plan.source.train_y) == 512
    expected = resolve_runtime(r.runtime, torch.device("cpu"), r.model.name, total_steps(r, 512), r.model.norm.fp32)
    assert plan.runtime == expected
    assert heard[0].startswith("from the data: ") and heard[:len(plan.choices)] == plan.choices
    assert plan.open_seconds > 0


def test_the_runtime_is_resolved_for_the_run_the_data_makes(data_dir):
    """A ResNet in bf16 with fp32 batch norm for thousands of steps compiles on a CPU (it pays);
    the runtime resolved before the data is known (the model and the run's length unknown), as
    `speedrun bench` and `flops` once did, stays eager: one recipe, two behaviours."""
    recipe = load_recipe("dawnbench-resnet18", ["runtime.precision='bf16'", "model.norm.fp32=true"])
    blind = resolve_runtime(recipe.runtime, torch.device("cpu"))
    plan = plan_run(recipe, data_dir, torch.device("cpu"), fit_batch=False)
    assert total_steps(plan.recipe, len(plan.source.train_y)) >= 2000
    assert blind.compile is False
    assert plan.runtime.compile is (cpp_compiler() is not None)
    assert any("compile on" in c for c in plan.choices) or cpp_compiler() is None


def _calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
            for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}


def test_every_command_and_benchmark_that_trains_plans_with_plan_run():
    """train, bench (its runner), ablate and flops, and the benchmark scripts that build a
    Session from a recipe, take the recipe, the data and the runtime from plan_run, never
    opening the data and resolving the runtime in their own order; the command modules that
    only hand a recipe on (bench/commands.py, bench/ablate_command.py) build no Session."""
    for path in (SRC / "bench" / "commands.py", SRC / "bench" / "ablate_command.py"):
        assert not {"Session", "open_source", "fit_batch_to_device"} & _calls(path), f"{path.name} builds a run itself"
    users = [SRC / "training.py", SRC / "bench" / "runner.py", SRC / "bench" / "flops_command.py",
             SRC / "bench" / "ablate.py",
             *(BENCH / f"{name}.py" for name in ("gpu_record", "throughput"))]
    for path in users:
        calls = _calls(path)
        assert "plan_run" in calls, f"{path.name} does not plan with plan_run"
        assert "fit_batch_to_device" not in calls or path.name == "training.py", f"{path.name} fits the batch itself"
