"""Your own network (model.name = "custom", model.factory = "file.py:function"): trained for real on
the 32 px CIFAR-10 images, stopped by a signal and resumed bit for bit, benchmarked, compared and
ablated, used by predict, evaluate and export,
and refused in one line, with nothing written, when the factory cannot give a network for the data
or has changed since its run. No timm needed: these run in the main suite."""
import hashlib
import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from matrix import bar
from networks import factory_file, one_error_line, recipe_file
from small_data import speedrun
from torch.utils.flop_counter import FlopCounterMode

from speedrun.errors import RecipeError
from speedrun.recipe import load_recipe
from test_stop_signals import check_stopped, plain_env, signalled

CUSTOM = {"name": "custom", "factory": "tiny_net.py:make"}


def test_a_factory_file_learns_resumes_bit_for_bit_and_its_run_is_used(npz32, jpeg32, tmp_path, monkeypatch, cli):
    """Test accuracy of its 3 epochs (48 steps) under seeds 0, 1, 2: 27.5%, 27.3%, 27.7%, against a bar of
    14.0% (chance + 3 standard errors on 512 test images; 2-core AMD EPYC, torch 2.13)."""
    monkeypatch.chdir(tmp_path)                       # the factory is named relative to here
    factory = factory_file(tmp_path)
    recipe = recipe_file(tmp_path, CUSTOM, train={"epochs": 3, "label_smoothing": 0.1})
    args = ["train", recipe, "--data-dir", npz32, "--device", "cpu"]
    speedrun(*args, "--out", tmp_path / "whole")
    whole = tmp_path / "whole"
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["test_acc"] > bar(10, 512), summary["test_acc"]
    recorded = load_recipe(str(whole / "config.toml")).model
    assert recorded.factory == f"{factory}:make"      # made absolute: the run can be used from anywhere
    assert recorded.factory_sha256 == hashlib.sha256(factory.read_bytes()).hexdigest()

    # stopped by SIGTERM in its second epoch, as a cluster stops a job: the resumable exit, a checkpoint at the step
    cut = tmp_path / "cut"
    rc, out, err = signalled([sys.executable, "-m", "speedrun", *map(str, args), "--log-every", "1", "--out", str(cut)],
                             signal.SIGTERM, after_step=20, env=plain_env())
    assert check_stopped(rc, out, err, signal.SIGTERM, cut, 48, 20) >= 20
    # the factory edited since: --resume refuses in one line and changes nothing
    original = factory.read_text()
    factory.write_text(original + "\n# edited\n")
    files = lambda: {p.name: p.read_bytes() for p in cut.iterdir() if p.name != ".speedrun.lock"}   # (the killed run's)
    before = files()
    rc, err = cli("train", "--resume", cut, "--data-dir", npz32, "--device", "cpu")
    assert rc == 2 and "has changed since the run was trained" in one_error_line(err)
    assert files() == before
    factory.write_text(original)
    speedrun("train", "--resume", cut, "--data-dir", npz32, "--device", "cpu")
    a, b = (torch.load(run / "model.pt", weights_only=True) for run in (whole, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the finished run predicts, evaluates and exports with the factory it was trained with, from elsewhere
    monkeypatch.chdir(tmp_path / "whole")
    images = sorted((jpeg32 / "val").glob("*/*.jpg"))[:3]
    assert cli("predict", whole, *images, "--device", "cpu", "--format", "json", "--out", tmp_path / "p.json")[0] == 0
    assert len(json.loads((tmp_path / "p.json").read_text())["predictions"]) == 3
    assert cli("evaluate", whole, "--data-dir", npz32, "--device", "cpu")[0] == 0
    assert json.loads((whole / "evaluation.json").read_text())["test_acc"] == pytest.approx(summary["test_acc"])
    rc, err = cli("export", whole, "--format", "torchscript", "--out", tmp_path / "net.pt", "--data-dir", npz32)
    assert rc == 0 and (tmp_path / "net.pt").stat().st_size > 0, err
    # ... and refuses, in one line, a factory that has changed or gone
    factory.write_text(original + "\n# edited\n")
    for command in (["predict", whole, images[0]], ["evaluate", whole, "--data-dir", npz32],
                    ["export", whole, "--format", "onnx", "--out", tmp_path / "net.onnx", "--data-dir", npz32]):
        rc, err = cli(*command, "--device", "cpu") if command[0] != "export" else cli(*command)
        assert rc == 2 and "tiny_net.py has changed since the run was trained" in one_error_line(err), command
    factory.unlink()
    rc, err = cli("predict", whole, images[0], "--device", "cpu")
    assert rc == 2 and "no such file" in one_error_line(err) and "the run was trained with it" in err
    assert not (tmp_path / "net.onnx").exists()


def test_your_network_is_benchmarked_compared_and_ablated(npz32, tmp_path, monkeypatch, cli):
    """`speedrun bench`, `compare` and `ablate` on a factory's network, as on speedrun's own: two seeds
    each of the network and of a narrower one (model.args), each run learning, the two compared by
    Welch's test, and label smoothing ablated (2 epochs, 32 steps, a run; 2-core AMD EPYC Zen 3, torch
    2.13, seeds 0-1: 22.5% and 18.9% at width 16, 21.7% and 20.3% at width 8, against a bar of 14.0%)."""
    monkeypatch.chdir(tmp_path)
    factory_file(tmp_path)
    recipe = recipe_file(tmp_path, CUSTOM)
    data = ["--data-dir", npz32, "--device", "cpu", "--runs", 2]
    assert cli("bench", recipe, *data, "--out", tmp_path / "a")[0] == 0
    assert cli("bench", recipe, *data, "--set", "model.args={width=8}", "--out", tmp_path / "b")[0] == 0
    for name, width in (("a", 16), ("b", 8)):
        bench = json.loads((tmp_path / name / "bench.json").read_text())
        assert [r["seed"] for r in bench["runs"]] == [0, 1]
        assert all(r["test_acc"] > bar(10, 512) for r in bench["runs"]), bench["runs"]
        assert bench["recipe_config"]["model"]["factory"] == f"{tmp_path / 'tiny_net.py'}:make"
        assert bench["recipe_config"]["model"]["args"] == ({} if width == 16 else {"width": 8})
    rc, err = cli("compare", tmp_path / "a", tmp_path / "b", "--json", tmp_path / "cmp.json")
    assert rc == 0, err
    result = json.loads((tmp_path / "cmp.json").read_text())
    assert 0 <= result["time"]["p"] <= 1 and 0 <= result["test_acc"]["p"] <= 1 and result["verdict"]
    rc, err = cli("ablate", recipe, *data, "--tricks", "label_smoothing", "--out", tmp_path / "ablate")
    assert rc == 0, err
    rows = json.loads((tmp_path / "ablate" / "ablate.json").read_text())["variants"]
    assert [(v["label"], v["overrides"]) for v in rows] == [("recipe", []),
                                                          ("without label_smoothing", ["train.label_smoothing=0"])]
    assert rows[0]["test_acc"]["mean"] > bar(10, 512) and 0 <= rows[1]["p_acc"] <= 1


@pytest.mark.slow
def test_the_batch_finder_halves_your_network_s_batch_on_a_real_out_of_memory(npz32, tmp_path):
    """--find-batch on a factory's network under an address-space limit, so that the large batch really
    fails to allocate: at width 96 a step of all 512 images did not fit in 0.7-1.1 GiB more than the
    process held after importing torch, and one of 256 fitted in 0.7-1.0 GiB (2-core AMD EPYC Zen 3,
    torch 2.13); the limit here is 0.9 GiB. Half an epoch, so the found batch's steps are counted."""
    factory_file(tmp_path)
    recipe = recipe_file(tmp_path, CUSTOM)
    code = f"""
import resource, sys
from speedrun.cli import main
import torch
base = int(open('/proc/self/statm').read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (base + int(0.9 * 2**30), resource.RLIM_INFINITY))
sys.exit(main(["train", {str(recipe)!r}, "--data-dir", {str(npz32)!r}, "--out", {str(tmp_path / 'fb')!r},
               "--device", "cpu", "--find-batch", "--set", "data.batch_size=512", "--set", "model.args={{width=96}}",
               "--set", "train.epochs=0.5", "--set", "eval.batch_size=128"]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data.batch_size=512 ran out of memory on cpu; using 256" in proc.stdout, proc.stdout[-3000:]
    s = json.loads((tmp_path / "fb" / "summary.json").read_text())
    assert s["batch_size"] <= 256 and s["steps"] == 256 // s["batch_size"]          # half an epoch
    assert f"batch_size = {s['batch_size']}" in (tmp_path / "fb" / "config.toml").read_text()


FACTORY_REFUSALS = [
    ("tiny_net.py:raises", "raised ValueError: width 16 must be even when called as raises(3, 10"),
    ("tiny_net.py:not_a_module", "returned 42 (of type int), not a torch.nn.Module"),
    ("tiny_net.py:wrong_shape", "gives outputs of shape 2x11 for 2 images of 3x32x32; speedrun needs 2x10"),
    ("tiny_net.py:absent", "tiny_net.py defines no 'absent'"),
    ("missing.py:make", "no such file missing.py"),
    ("no_such_package.nets:make", "no module named 'no_such_package'"),
    ("tiny_net.py", "names no function"),
]


@pytest.mark.parametrize("factory, message", FACTORY_REFUSALS, ids=[f for f, _ in FACTORY_REFUSALS])
def test_a_factory_that_gives_no_network_for_the_data_is_one_line_naming_it(npz32, tmp_path, monkeypatch, cli,
                                                                           factory, message):
    monkeypatch.chdir(tmp_path)
    factory_file(tmp_path)
    recipe = recipe_file(tmp_path, {**CUSTOM, "factory": "tiny_net.py:make"})
    rc, err = cli("train", recipe, "--data-dir", npz32, "--device", "cpu", "--out", tmp_path / "run",
                  "--set", f"model.factory={factory}")
    line = one_error_line(err)
    assert rc == 2 and "model.factory" in line and message in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting, field", [
    ("model.whiten.kernel=2", "model.whiten"), ("model.norm.ghost_batch=16", "model.norm"),
    ("model.norm.scale=frozen", "model.norm"), ("model.global_pool_grad=select", "model.global_pool_grad"),
    ("model.widths=[8,16]", "model.widths"), ("model.zero_gamma=true", "model.zero_gamma"),
    ("optim.whiten_bias_lr_mult=4", "optim.whiten_bias_lr_mult")])
def test_speed_net_and_resnet_options_are_refused_for_your_network_naming_the_field(tmp_path, setting, field):
    recipe = recipe_file(tmp_path, CUSTOM)
    with pytest.raises(RecipeError) as err:
        load_recipe(str(recipe), [setting])
    assert f"{field} " in str(err.value) and "\n" not in str(err.value)


def test_another_kind_of_network_by_set_starts_the_model_section_afresh(tmp_path):
    """--set model.name=custom on a speed-net recipe drops the speed net's own fields."""
    recipe = load_recipe("fashion-mnist", ["model.name=custom", f"model.factory={tmp_path / 'net.py'}:make",
                                           "model.args={width=8}"])
    assert recipe.model.name == "custom" and recipe.model.args == {"width": 8}
    assert recipe.model.norm.ghost_batch == 0 and recipe.model.norm.sync_ranks == 1


def test_flops_of_your_network_are_torch_s_count_of_its_module(npz32, tmp_path, cli):
    factory = factory_file(tmp_path)
    recipe = recipe_file(tmp_path, {**CUSTOM, "factory": f"{factory}:make"})
    rc, err = cli("flops", recipe, "--data-dir", npz32, "--steps", 2, "--json", tmp_path / "f.json")
    assert rc == 0, err
    rec = json.loads((tmp_path / "f.json").read_text())
    import importlib.util
    spec = importlib.util.spec_from_file_location("tiny_net_copy", factory)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with FlopCounterMode(display=False) as counted:
        module.make(3, 10)(torch.zeros(2, 3, 32, 32))
    assert rec["flops_per_forward_image"] == counted.get_total_flops() / 2


def test_timm_networks_without_timm_say_what_to_install(npz32, tmp_path, cli):
    try:
        import timm  # noqa: F401
        pytest.skip("timm is installed here (the refusal is for installs without it)")
    except ImportError:
        pass
    recipe = recipe_file(tmp_path, {"name": "timm", "arch": "convnext_atto"})
    rc, err = cli("train", recipe, "--data-dir", npz32, "--device", "cpu", "--out", tmp_path / "run")
    assert rc == 2 and "pip install 'speedrun[timm]'" in one_error_line(err) and not (tmp_path / "run").exists()


def test_a_copy_of_a_factory_file_elsewhere_is_the_same_network(tmp_path):
    """The SHA-256 is of the file's content: a run moved with its factory still builds."""
    from speedrun.models import build_model
    from speedrun.models.custom import recorded
    a = factory_file(tmp_path)
    (tmp_path / "b").mkdir()
    b = tmp_path / "b" / "tiny_net.py"
    shutil.copy(a, b)
    first = load_recipe("fashion-mnist", ["model.name=custom", f"model.factory={a}:make"])
    sha = recorded(first.model)["model.factory_sha256"]
    moved = load_recipe("fashion-mnist", ["model.name=custom", f"model.factory={b}:make",
                                          f"model.factory_sha256={sha}"])
    assert sum(p.numel() for p in build_model(moved.model, 1, 10).parameters()) > 0
