"""Where the training step's parts live, read from the source with ``ast`` (nothing is run):
its loss and its precision in a module each (that the step is the one caller of backward is
tests/test_step_structure.py's), a loop that builds, trains and resumes and reaches into no private part
of the step, and one step counter on each side of the device."""
import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "src" / "speedrun" / "engine"


def tree(name: str) -> ast.Module:
    return ast.parse((ENGINE / name).read_text(encoding="utf-8"))


def classes(module: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}


def methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_loss_and_the_precision_have_their_own_modules():
    step = tree("step.py")
    names = {n.name for n in ast.walk(step) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not {"LossScale", "distillation_loss", "mixed_loss", "first_bad_step"} & names
    assert {"LossScale", "StepPrecision", "first_bad_step", "NonFiniteLoss"} <= set(classes(tree("precision.py"))) | {
        n.name for n in tree("precision.py").body if isinstance(n, ast.FunctionDef)}
    loss = tree("loss.py")
    assert "TrainingLoss" in classes(loss)
    assert {"distillation_loss", "mixed_loss"} <= {n.name for n in loss.body if isinstance(n, ast.FunctionDef)}
    # nothing of the loss scale or of the cross entropy is written in the step itself
    source = (ENGINE / "step.py").read_text(encoding="utf-8")
    for text in ("cross_entropy", "_amp_update_scale_", "torch.where(overflow"):
        assert text not in source, text


def private_reads_of_the_step(module: ast.Module) -> list[str]:
    """``self.step._x`` or ``step._x`` anywhere in ``module``."""
    out = []
    for n in ast.walk(module):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            v = n.value
            if (isinstance(v, ast.Attribute) and v.attr == "step") or (isinstance(v, ast.Name) and v.id == "step"):
                out.append(n.attr)
    return out


def test_the_loop_has_three_jobs_and_reads_no_private_part_of_the_step():
    loop = tree("loop.py")
    session = classes(loop)["Session"]
    public = {m for m in methods(session) if not m.startswith("_")}
    assert public == {"run", "reset"}, public                 # train from a seed (or resume); re-initialise
    # what it no longer does: the batch finder's probe, FLOP counting, image geometry, data swaps
    gone = {"_probe", "run_flops", "step_image_shapes", "image_sizes", "dataset", "_build", "_fresh_model"}
    assert not gone & methods(session)
    assert private_reads_of_the_step(loop) == []
    for name in ("warmup.py", "checkpoint.py", "plan.py"):
        assert private_reads_of_the_step(tree(name)) == [], name


def test_one_host_counter_and_one_device_counter_of_steps():
    """The run's state keeps no step number of its own: the step's ``steps_done`` (host) and
    ``counter`` (device) are the only two, advanced together."""
    run_state = classes(tree("loop.py"))["RunState"]
    fields = {n.target.id for n in run_state.body if isinstance(n, ast.AnnAssign)}
    assert "step" not in fields, fields
    init = next(n for n in classes(tree("step.py"))["TrainStep"].body
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                for t in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(t, ast.Attribute)}
    counters = {a for a in assigned if "step" in a or "counter" in a} - {"whiten_steps", "head_steps"}   # (boundaries)
    assert counters == {"counter", "steps_done"}, counters
