"""speedrun export: a real run (the shrunk cifar10-94 on 1,024 real CIFAR-10 images) exported to
each format through the real command line, then loaded the way a user would (onnxruntime,
torch.jit.load, safetensors) and compared with the run's PyTorch model on the 256 real test
images, prepared as the run's evaluation prepared them. Refusals go through ``speedrun.cli.main``
(one in a real process): one message, no traceback, nothing written."""
import json
import re
import shutil
import tomllib
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from speedrun.cli import main
from speedrun.models import build_model
from speedrun.recipe import recipe_from_dict
from speedrun.use import export as export_module
from speedrun.use.loaded import load_run, normalise

from small_data import build_once
from test_cli import speedrun
from test_failures import assert_unchanged, check_refused, read_only, snapshot
import test_failures

TOLERANCE = 1e-4          # the acceptance: fp32 logits within 1e-4 of PyTorch's
SMALL = ["--set", "data.dataset=npz", "--set", "model.widths=[16,32,32]", "--set", "data.batch_size=256",
         "--set", "train.epochs=0.5", "--set", "eval.tta=none", "--device", "cpu"]
tmpfs = test_failures.tmpfs        # the fixture: a real tmpfs mount (read-only, full)
FORMATS = {"onnx": "model.onnx", "torchscript": "model.torchscript.pt", "safetensors": "model.safetensors"}


@pytest.fixture(scope="module")
def exported(artifacts, cifar_small):
    """The run folder, with every format exported by the real command into it (their stdout
    beside, in stdout-FORMAT.txt); made once per test session, shared by xdist's workers."""
    def build(root):
        root.mkdir()
        speedrun("train", "cifar10-94", "--data-dir", cifar_small, *SMALL, "--out", root / "run")
        for fmt in FORMATS:
            proc = speedrun("export", root / "run", "--format", fmt)
            (root / f"stdout-{fmt}.txt").write_text(proc.stdout)
            (root / f"stderr-{fmt}.txt").write_text(proc.stderr)
    return build_once(artifacts, "export-speednet", build)


@pytest.fixture(scope="module")
def reference(exported, cifar_small):
    """(uint8 test images, the run's PyTorch logits on them as its evaluation computes them)."""
    loaded = load_run(exported / "run", "cpu")
    x_u8 = torch.from_numpy(np.load(cifar_small)["x_test"])
    assert x_u8.shape == (256, 3, 32, 32)
    with torch.no_grad():
        logits = loaded.model(normalise(loaded, x_u8).contiguous(memory_format=loaded.runtime.memory_format))
    return x_u8, logits


def test_the_command_checks_each_export_on_the_runs_test_images(exported, cifar_small):
    for fmt in ("onnx", "torchscript"):
        out = (exported / f"stdout-{fmt}.txt").read_text()
        assert f"256 test images of {cifar_small}" in out, out
        diff = float(re.search(r"max \|logit difference\|\s*│\s*([-+.e0-9]+) vs PyTorch", out).group(1))
        assert 0 <= diff <= TOLERANCE
    assert "39, identical to model.pt's" in (exported / "stdout-safetensors.txt").read_text()
    for fmt in FORMATS:         # nothing from torch's exporters leaks onto the user's terminal
        assert (exported / f"stderr-{fmt}.txt").read_text() == "", fmt
    assert not [p.name for p in (exported / "run").iterdir() if p.name.startswith(".")]


def test_onnx_agrees_with_pytorch_on_256_real_test_images(exported, reference):
    x_u8, expected = reference
    session = ort.InferenceSession(str(exported / "run" / "model.onnx"), providers=["CPUExecutionProvider"])
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.type, out.name) == ("pixels", "tensor(float)", "logits")
    assert isinstance(inp.shape[0], str) and inp.shape[1:] == [3, 32, 32]         # any batch size
    logits = session.run(None, {"pixels": x_u8.float().numpy()})[0]          # raw pixels: normalised inside
    assert logits.shape == (256, 10) and expected.std() > 0.01
    diff = np.abs(logits - expected.numpy()).max()
    print(f"ONNX vs PyTorch, 256 CIFAR-10 test images: max |diff| {diff:.3g}")
    assert diff <= TOLERANCE
    single = session.run(None, {"pixels": x_u8[7:8].float().numpy()})[0]
    assert np.abs(single - expected[7:8].numpy()).max() <= TOLERANCE


def test_onnx_metadata_describes_the_input(exported):
    model = onnx.load(str(exported / "run" / "model.onnx"))
    meta = {p.key: p.value for p in model.metadata_props}
    pre = json.loads((exported / "run" / "preprocessing.json").read_text())
    assert json.loads(meta["classes"]) == pre["classes"] == ["airplane", "automobile", "bird", "cat", "deer", "dog",
                                                             "frog", "horse", "ship", "truck"]
    assert json.loads(meta["mean"]) == pre["mean"] and json.loads(meta["std"]) == pre["std"]
    assert json.loads(meta["image_size"]) == [32, 32] and meta["layout"] == "NCHW" and meta["dtype"] == "float32"
    assert meta["normalisation"] == "in_graph" and meta["recipe"] == "cifar10-94"
    assert json.loads(meta["preprocessing"]) == pre


def test_torchscript_agrees_with_pytorch_and_carries_its_preprocessing(exported, reference):
    x_u8, expected = reference
    extra = {"preprocessing.json": ""}
    with warnings.catch_warnings():                        # torch 2.13 deprecates TorchScript; it still loads
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(exported / "run" / "model.torchscript.pt"), _extra_files=extra)
    with torch.no_grad():
        logits = module(x_u8.float())
    diff = (logits - expected).abs().max().item()
    print(f"TorchScript vs PyTorch, 256 CIFAR-10 test images: max |diff| {diff:.3g}")
    assert diff <= TOLERANCE
    meta = json.loads(extra["preprocessing.json"])
    pre = json.loads((exported / "run" / "preprocessing.json").read_text())
    assert meta["classes"] == pre["classes"] and meta["mean"] == pre["mean"] and meta["std"] == pre["std"]
    assert meta["normalisation"] == "in_graph" and meta["image_size"] == [32, 32]


def test_safetensors_loads_back_to_the_same_tensors(exported, reference):
    run = exported / "run"
    weights = torch.load(run / "model.pt", weights_only=True)
    tensors = load_file(run / "model.safetensors")
    assert tensors.keys() == weights.keys()
    for name, t in weights.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
    with safe_open(run / "model.safetensors", "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["classes"])[0] == "airplane" and meta["normalisation"] == "before_model"
    # the file alone rebuilds the model: the recipe in its metadata, then (pixels - mean) / std
    recipe = recipe_from_dict(tomllib.loads(meta["recipe_toml"]))
    model = build_model(recipe.model, int(meta["channels"]), len(json.loads(meta["classes"])))
    model.load_state_dict(tensors)
    x_u8, expected = reference
    mean, std = (torch.tensor(json.loads(meta[k])).view(1, -1, 1, 1) for k in ("mean", "std"))
    with torch.no_grad():
        logits = model.eval()((x_u8.float() - mean) / std)
    assert (logits - expected).abs().max().item() <= TOLERANCE


# ------------------------------------------------------------------------------------------
# Refusals: one message, no traceback, nothing written
# ------------------------------------------------------------------------------------------

@pytest.fixture
def run_copy(exported, tmp_path):
    """A copy of the run without its exports."""
    dest = shutil.copytree(exported / "run", tmp_path / "run")
    for name in FORMATS.values():
        (dest / name).unlink()
    return dest


def test_a_missing_run_folder_is_one_message_in_a_real_process(tmp_path):
    proc = speedrun("export", tmp_path / "nope", "--format", "onnx", check=False)
    check_refused(proc, 2, tmp_path / "nope", "no such run folder")
    assert not list(tmp_path.iterdir())


def test_refusals_name_the_problem_and_write_nothing(cli, run_copy, exported, tmp_path):
    before = snapshot(tmp_path)
    check_refused(cli("export", run_copy, "--format", "pdf"), 2, "invalid choice", "'pdf'")
    # the default file exists (an earlier export): not overwritten, --out suggested
    check_refused(cli("export", exported / "run", "--format", "safetensors"), 2, "model.safetensors",
                  "already exists", "--out")
    (tmp_path / "mine.onnx").write_text("the user's file")
    before = snapshot(tmp_path)
    check_refused(cli("export", run_copy, "--format", "onnx", "--out", tmp_path / "mine.onnx"), 2,
                  "mine.onnx", "already exists")
    check_refused(cli("export", run_copy, "--format", "torchscript", "--out", tmp_path / "mine.onnx" / "m.pt"), 2,
                  "is a file")
    assert_unchanged(tmp_path, before)
    (run_copy / "model.pt").unlink()
    before = snapshot(tmp_path)
    check_refused(cli("export", run_copy, "--format", "safetensors"), 2, "model.pt", "not a finished run")
    assert_unchanged(tmp_path, before)


def test_a_read_only_or_full_disk_is_refused_before_exporting(cli, run_copy, tmpfs):
    ro = tmpfs("ro")
    read_only(ro)
    check_refused(cli("export", run_copy, "--format", "safetensors", "--out", ro / "m.safetensors"), 2,
                  "read-only")
    full = tmpfs("full", "2m")
    (full / "filler").write_bytes(bytes(1900 * 1024))
    check_refused(cli("export", run_copy, "--format", "safetensors", "--out", full / "m.safetensors"), 2,
                  "free")
    assert sorted(p.name for p in full.iterdir()) == ["filler"]


def test_a_missing_package_names_the_pip_install(cli, run_copy, monkeypatch):
    real = export_module.importlib.util.find_spec
    monkeypatch.setattr(export_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    err = check_refused(cli("export", run_copy, "--format", "onnx"), 2, "onnxruntime", "pip install onnxruntime")
    assert "speedrun[export]" in err
    assert not (run_copy / "model.onnx").exists()


def test_an_export_that_disagrees_with_pytorch_is_not_written(cli, run_copy, monkeypatch):
    runner = export_module.run_torchscript
    monkeypatch.setattr(export_module, "run_torchscript", lambda data, batches: runner(data, batches) + 1e-3)
    check_refused(cli("export", run_copy, "--format", "torchscript"), 1, "differ from PyTorch's by up to 0.001",
                  "nothing was written")
    assert sorted(p.name for p in run_copy.iterdir()) == sorted(
        ["config.toml", "metrics.jsonl", "model.pt", "preprocessing.json", "summary.json"])


def test_an_exporter_failure_is_one_message_and_writes_nothing(cli, run_copy, monkeypatch):
    def trace(*args, **kwargs):
        raise RuntimeError("Tracer cannot infer type of output\nmore lines of torch's own")
    monkeypatch.setattr(torch.jit, "trace", trace)
    err = check_refused(cli("export", run_copy, "--format", "torchscript"), 1, "cannot export", "to torchscript",
                        "Tracer cannot infer type of output", "nothing was written")
    assert "more lines" not in err and not (run_copy / "model.torchscript.pt").exists()
    check_refused(cli("export", run_copy, "--format", "torchscript", "--tolerance", "-1"), 2, "--tolerance -1")


def test_without_the_runs_data_the_check_uses_random_images_and_says_so(run_copy, tmp_path):
    done = export_module.export_run(run_copy, "torchscript", out=tmp_path / "m.pt", data_dir=tmp_path / "gone.npz")
    assert done.checked_on.startswith("256 random images") and "gone.npz" in done.checked_on
    assert done.max_difference <= TOLERANCE and (tmp_path / "m.pt").is_file()


def test_the_check_reads_the_data_the_run_was_trained_from_until_it_is_gone(tmp_path, data_dir, isolated_env,
                                                                           monkeypatch):
    """A built-in set trained from --data-dir, with neither $SPEEDRUN_DATA nor ~/.cache/speedrun
    holding it: the run's summary.json records where it read the data; `speedrun evaluate`, run
    from another directory without --data-dir, evaluates the test images there, and the export
    is checked on them; once that folder is gone, the export on random images, saying why."""
    copy = tmp_path / "data" / "fashion-mnist"
    copy.mkdir(parents=True)
    for f in (data_dir / "fashion-mnist").iterdir():
        (copy / f.name).symlink_to(f)
    run = tmp_path / "run"
    speedrun("train", "fashion-mnist", "--data-dir", tmp_path / "data", "--set", "model.widths=[8,8,8]",
             "--set", "train.epochs=0.05", "--set", "eval.tta=none", "--device", "cpu", "--out", run)
    assert json.loads((run / "summary.json").read_text())["data_path"] == str(copy)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["evaluate", str(run), "--device", "cpu"]) == 0
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["data"] == f"{copy}, 10000 test images" and evaluation["matches_record"] is True
    assert not any((tmp_path / "elsewhere").iterdir())
    done = export_module.export_run(run, "torchscript", out=tmp_path / "a.pt")
    assert done.checked_on == f"256 test images of {copy}" and done.max_difference <= TOLERANCE
    shutil.rmtree(tmp_path / "data")
    done = export_module.export_run(run, "torchscript", out=tmp_path / "b.pt")
    assert done.checked_on.startswith("256 random images (the run's test images are not at hand: dataset "
                                      "'fashion-mnist' not found") and "--data-dir DIR" in done.checked_on
    assert done.max_difference <= TOLERANCE and (tmp_path / "b.pt").is_file()
