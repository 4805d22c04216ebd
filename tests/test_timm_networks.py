"""timm's networks (model.name = "timm"): four families trained from random weights on the 32 px
CIFAR-10 images, fine-tuned from weights timm itself saved (model.init = timm:NAME=FILE), their
blocks and classifier as timm groups them, and the refusals. timm needs torchvision, which cannot
be imported beside the CPU torch of .venv/: these run in .venv-2.14 (.ci/run), and skip elsewhere.

The accuracy margins were measured on a 2-core AMD EPYC under torch 2.14.1 and timm 1.0.31, test
accuracy on 512 test images against a bar of 14.0% (chance + 3 standard errors), seeds 0, 1, 2
(``SPEEDRUN_TEST_SEED``); each test names its own."""
import json
from pathlib import Path

import pytest
import torch
from matrix import bar
from networks import RECIPE, one_error_line, recipe_file
from small_data import learning_seed

from speedrun.errors import CheckpointError, RecipeError
from speedrun.models import build_model, classifier_names
from speedrun.models.pretrained import apply_weights, open_weights
from speedrun.optim.params import block_of, head_of
from speedrun.recipe import load_recipe

timm = pytest.importorskip("timm", reason="timm is not installed")


def trained(cli, capsys, tmp_path, npz32, model: dict, *sets: str, init: str | None = None, **sections):
    """A run of the small recipe with this timm network: (summary, its start lines)."""
    recipe = recipe_file(tmp_path, model, **sections)
    args = ["train", recipe, "--data-dir", npz32, "--device", "cpu", "--out", tmp_path / "run",
            "--seed", learning_seed(), *sum((["--set", s] for s in sets), [])]
    from speedrun import cli as speedrun_cli
    capsys.readouterr()
    rc = speedrun_cli.main([str(a) for a in args + (["--init", init] if init else [])])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = [line for line in out.out.splitlines() if line.startswith("speedrun: ")]
    return json.loads((tmp_path / "run" / "summary.json").read_text()), lines


# ------------------------------------------------------------------------------------------
# Four families from random weights
# ------------------------------------------------------------------------------------------

FAMILIES = {
    # narrower than the published widths (model.args), so that each run takes seconds
    "resnet10t": ({"arch": "resnet10t", "args": {"channels": [16, 32, 64, 128], "stem_width": 8}}, {}),
    "convnext_atto": ({"arch": "convnext_atto", "args": {"dims": [16, 32, 64, 128]}}, {}),
    # (6 epochs: the depthwise blocks start slowly from timm's initialisation at 32 px)
    "mobilenetv3_small_050": ({"arch": "mobilenetv3_small_050"}, {"train": {"epochs": 6, "label_smoothing": 0.1},
                                                                 "optim": {"lr": 2.0, "ref_batch": 256}}),
    # 4 patches a side, 4 blocks
    "vit_tiny_patch16_224": ({"arch": "vit_tiny_patch16_224", "img_size": 32, "args": {"patch_size": 8, "depth": 4}},
                             {"train": {"epochs": 3, "label_smoothing": 0.1}, "optim": {"lr": 2.0, "ref_batch": 256}}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_timm_networks_of_four_families_learn_from_random_weights(npz32, tmp_path, cli, capsys, family):
    """Seeds 0, 1, 2: resnet10t 27.3%, 27.3%, 30.1%; convnext_atto 28.3%, 22.7%, 29.1%;
    mobilenetv3_small_050 20.1%, 18.4%, 20.3%; vit_tiny_patch16_224 29.5%, 26.8%, 25.6% (bar 14.0%).
    convnext_atto's run is then exported (exports_compute_the_runs_outputs)."""
    model, sections = FAMILIES[family]
    sections = {**sections, "optim": {**RECIPE["optim"], **sections.get("optim", {})}}
    summary, lines = trained(cli, capsys, tmp_path, npz32, {"name": "timm", **model}, **sections)
    assert summary["test_acc"] > bar(10, 512), (family, summary["test_acc"])
    network = next(line for line in lines if line.startswith("speedrun: network: timm"))
    assert f" {family}" in network and "from random weights (timm's own initialisation)" in network
    assert "trained at 32 px, evaluated at 32 px" in network
    assert load_recipe(str(tmp_path / "run" / "config.toml")).model.arch == family
    if family == "convnext_atto":                       # (one family's run is enough to export)
        exports_compute_the_runs_outputs(cli, tmp_path / "run", npz32, tmp_path)


def exports_compute_the_runs_outputs(cli, run, npz32, folder):
    """``speedrun export`` of a timm network's run: TorchScript that gives the run's model's logits on the
    512 test images (uint8 pixels in, normalised inside), safetensors holding model.pt's tensors, and ONNX,
    whose packages .venv-2.14 lacks, refused in one line naming the pip install, nothing written."""
    import warnings

    import numpy as np
    from safetensors.torch import load_file

    from speedrun.use.loaded import load_run, normalise
    for fmt, name in (("torchscript", "net.pt"), ("safetensors", "net.safetensors")):
        rc, err = cli("export", run, "--format", fmt, "--out", folder / name, "--data-dir", npz32)
        assert rc == 0, err
    loaded, x_u8 = load_run(run, "cpu"), torch.from_numpy(np.load(npz32)["x_test"])
    with warnings.catch_warnings():                     # (torch deprecates TorchScript; it still loads)
        warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))
        module = torch.jit.load(str(folder / "net.pt"))
    with torch.no_grad():
        expected = loaded.model(normalise(loaded, x_u8).contiguous(memory_format=loaded.runtime.memory_format))
        logits = module(x_u8.float())
    assert expected.shape == (512, 10) and (logits - expected).abs().max().item() <= 1e-4
    weights, tensors = torch.load(run / "model.pt", weights_only=True), load_file(folder / "net.safetensors")
    assert tensors.keys() == weights.keys() and all(torch.equal(tensors[k], weights[k]) for k in weights)
    try:
        import onnx, onnxruntime, onnxscript  # noqa: F401, E401
    except ImportError:
        rc, err = cli("export", run, "--format", "onnx", "--out", folder / "net.onnx", "--data-dir", npz32)
        line = one_error_line(err)
        assert rc == 2 and "--format onnx needs the Python packages" in line and "pip install" in line, line
        assert not (folder / "net.onnx").exists()
    else:
        rc, err = cli("export", run, "--format", "onnx", "--out", folder / "net.onnx", "--data-dir", npz32)
        assert rc == 0 and (folder / "net.onnx").stat().st_size > 0, err


# ------------------------------------------------------------------------------------------
# Blocks and the classifier, as timm groups them
# ------------------------------------------------------------------------------------------

def test_a_timm_network_with_stochastic_depth_mixup_averaging_and_micro_batches_resumes_bit_for_bit(
        npz32, tmp_path):
    """convnext_atto (narrow) with drop_path_rate 0.2 (timm's stochastic depth draws from torch's
    generator in every block), mixup, an EMA of the weights and two micro-batches a step, killed at
    its first checkpoint and resumed: the same weights as the uninterrupted run, bit for bit, and it
    learned. Test accuracy under seeds 0, 1, 2 on a 2-core Intel Xeon (family 6, model 167), torch
    2.14.1: 30.1%, 27.0%, 28.7% against a bar of 14.0% (chance + 3 standard errors on 512 test images)."""
    from small_data import speedrun
    from test_training_features import killed_at_first_checkpoint
    model = {"name": "timm", **FAMILIES["convnext_atto"][0], "drop_path_rate": 0.2}
    recipe = recipe_file(tmp_path, model, train={"epochs": 3, "label_smoothing": 0.1, "accumulate": 2},
                         augment={**RECIPE["augment"], "mixup": 0.2}, averaging={"kind": "ema", "every": 2})
    args = ["train", recipe, "--data-dir", npz32, "--device", "cpu", "--seed", learning_seed(),
            "--set", "checkpoint.every_steps=20"]
    speedrun(*args, "--out", tmp_path / "whole")
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["test_acc"] > bar(10, 512), summary["test_acc"]
    cut = tmp_path / "cut"
    assert killed_at_first_checkpoint([str(a) for a in args], cut)["step"] == 20
    speedrun("train", "--resume", cut, "--data-dir", npz32, "--device", "cpu")
    a, b = (torch.load(run / "model.pt", weights_only=True) for run in (tmp_path / "whole", cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((cut / "summary.json").read_text())["test_acc"] == summary["test_acc"]


def test_the_regularisation_fields_reach_timms_network():
    """model.drop_rate and model.drop_path_rate are timm's own arguments: the dropout before the
    classifier and stochastic depth rising to drop_path_rate at the last block."""
    cfg = load_recipe("fashion-mnist", ["model.name=timm", "model.arch=convnext_atto", "model.drop_rate=0.25",
                                        "model.drop_path_rate=0.1"]).model
    with torch.device("meta"):
        model = build_model(cfg, 3, 7)
    assert model.drop_rate == 0.25
    rates = [m.drop_prob for m in model.modules() if type(m).__name__ == "DropPath"]
    assert rates and max(rates) == pytest.approx(0.1) and min(rates) < max(rates)


@pytest.mark.parametrize("arch", ["convnext_atto", "mobilenetv3_small_050", "vit_tiny_patch16_224"])
def test_blocks_and_classifier_are_timms_own(arch):
    from timm.models import group_parameters
    cfg = load_recipe("fashion-mnist", ["model.name=timm", f"model.arch={arch}"]).model
    with torch.device("meta"):
        model = build_model(cfg, 3, 7)
    block, names = block_of(model), {id(p): n for n, p in model.named_parameters()}
    by_name = group_parameters(model, model.group_matcher(coarse=False), reverse=True)
    assert {names[i]: b for i, b in block.items()} == by_name
    clf = model.get_classifier()
    assert head_of(model) == {id(p) for p in clf.parameters()}
    assert max(block.values()) == max(block[id(p)] for p in clf.parameters())     # the classifier last
    assert set(classifier_names(model)) == {f"{n}.{k}" for n, m in model.named_modules() if m is clf
                                            for k in m.state_dict()}


# ------------------------------------------------------------------------------------------
# Fine-tuning from weights timm saved
# ------------------------------------------------------------------------------------------

SLOWER = {"train": {"epochs": 6, "label_smoothing": 0.1}, "optim": {**RECIPE["optim"], "lr": 2.0}}
FINETUNED = {
    "convnext_atto": ({}, {}),
    "mobilenetv3_small_050": ({}, SLOWER),
    "vit_tiny_patch16_224": ({"img_size": 32, "args": {"patch_size": 8}},
                             {**SLOWER, "train": {"epochs": 3, "label_smoothing": 0.1}}),
}


@pytest.fixture(scope="module")
def timm_weights(tmp_path_factory):
    """Each architecture's weights as timm makes and saves them (random: no hub is reachable)."""
    folder = tmp_path_factory.mktemp("timm-weights")
    for arch in FINETUNED:
        torch.manual_seed(0)
        torch.save(timm.create_model(arch, pretrained=False).state_dict(), folder / f"{arch}.pth")
    return folder


@pytest.mark.parametrize("arch", list(FINETUNED))
def test_weights_timm_saved_load_into_its_network_for_the_data(timm_weights, arch):
    path = timm_weights / f"{arch}.pth"
    pre = open_weights(f"timm:{arch}={path}")
    assert pre.model == {"name": "timm", "arch": arch} and pre.num_classes == 1000
    net_cfg = timm.create_model(arch).pretrained_cfg
    assert pre.mean == [255 * m for m in net_cfg["mean"]]
    assert pre.eval_crop == (net_cfg.get("test_crop_pct") or net_cfg["crop_pct"])   # (with its test_input_size)
    extra, _ = FINETUNED[arch]
    cfg = load_recipe("fashion-mnist", ["model.name=timm", f"model.arch={arch}",
                                         *(f"model.{k}={json.dumps(v) if k != 'args' else _table(v)}"
                                           for k, v in extra.items())]).model
    torch.manual_seed(1)
    model = build_model(cfg, 1, 10)                     # grey images, 10 classes
    fresh_head = {k: v.clone() for k, v in model.state_dict().items() if k in classifier_names(model)}
    notes = apply_weights(model, pre, 1, 10, None, cfg)
    assert any("head replaced for 10 classes" in n for n in notes) and any("adapted from 3 to 1" in n for n in notes)
    state, saved = model.state_dict(), torch.load(path, weights_only=True)
    first = net_cfg["first_conv"] + ".weight"
    for key, tensor in state.items():
        if key in fresh_head:
            assert torch.equal(tensor, fresh_head[key]), key          # the model's own new classifier
        elif key == first:
            if tensor.shape[2:] == saved[key].shape[2:]:
                assert torch.allclose(tensor, saved[key].sum(1, keepdim=True)), key     # summed over the colours
        elif tensor.shape == saved[key].shape:
            assert torch.equal(tensor, saved[key]), key
        else:
            assert arch.startswith("vit") and key == "pos_embed", key  # resampled by timm to 4 x 4 patches
    if arch.startswith("vit"):
        assert any("resampled by timm" in n and "pos_embed" in n for n in notes)


@pytest.mark.parametrize("arch", ["convnext_atto", "resnet18"])
def test_weights_saved_with_a_classifier_for_other_classes_load_and_get_a_new_one(tmp_path, arch):
    """A file of timm's network trained or fine-tuned on other data (its classifier for 7 classes, as
    timm's train.py saves it) is that network's weights: every tensor but the classifier is loaded (for
    resnet18 into speedrun's own ResNet, converted), and the run's model gets a classifier of its own
    for its data's classes. A misshapen tensor outside the classifier is still refused."""
    torch.manual_seed(0)
    saved = timm.create_model(arch, pretrained=False, num_classes=7).state_dict()
    path = tmp_path / f"{arch}-7.pth"
    torch.save(saved, path)
    pre = open_weights(f"timm:{arch}={path}")
    assert pre.num_classes == 7 and {pre.state[k].shape[0] for k in pre.head if pre.state[k].ndim} == {7}
    if arch == "convnext_atto":
        assert pre.model == {"name": "timm", "arch": arch}
        assert all(torch.equal(pre.state[k], saved[k]) for k in saved)
        cfg = load_recipe("fashion-mnist", ["model.name=timm", f"model.arch={arch}"]).model
        model = build_model(cfg, 3, 10)
        notes = apply_weights(model, pre, 3, 10, None, cfg)
        assert any("head replaced for 10 classes" in n for n in notes), notes
        body = [k for k in saved if k not in pre.head]
        assert all(torch.equal(model.state_dict()[k], saved[k]) for k in body)
    else:
        assert pre.model["name"] == "resnet" and pre.model["depth"] == 18       # speedrun's own, converted
    bad = dict(saved)
    key = next(k for k in saved if k.endswith("weight") and saved[k].ndim == 4 and k not in pre.head)
    bad[key] = saved[key][:1]
    torch.save(bad, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match=f"not the weights of timm's {arch}"):
        open_weights(f"timm:{arch}={tmp_path / 'bad.pth'}")


def _table(d: dict) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + "}"


@pytest.mark.parametrize("arch", list(FINETUNED))
def test_fine_tuning_from_weights_timm_saved_learns(npz32, tmp_path, cli, capsys, timm_weights, arch):
    """Seeds 0, 1, 2: convnext_atto (2 epochs) {convnext}; mobilenetv3_small_050 (6) {mobilenet};
    vit_tiny_patch16_224 at 32 px, patch 8 (3) {vit} (bar 14.0%)."""
    extra, sections = FINETUNED[arch]
    summary, lines = trained(cli, capsys, tmp_path, npz32, {"name": "timm", "arch": arch, **extra},
                             init=f"timm:{arch}={timm_weights / f'{arch}.pth'}",
                             finetune={"head_epochs": 0.5, "lr_first": 0.3}, **sections)
    assert summary["test_acc"] > bar(10, 512), (arch, summary["test_acc"])
    said = "\n".join(lines)
    assert f"weights to start from: timm {arch} (timm's own network; weights from {arch}.pth)" in said
    assert "inputs normalised as the weights were trained" in said and "head replaced for 10 classes" in said
    assert "fine-tuned: the classifier alone for 0.5 epochs, then each block's LR from 0.3x" in said
    assert "blocks by timm's group_matcher" in said


# ------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------

def test_an_unknown_architecture_names_the_field_and_the_close_names(npz32, tmp_path, cli):
    recipe = recipe_file(tmp_path, {"name": "timm", "arch": "convnxt_atto"})
    rc, err = cli("train", recipe, "--data-dir", npz32, "--device", "cpu", "--out", tmp_path / "run")
    line = one_error_line(err)
    assert rc == 2 and "model.arch = 'convnxt_atto' is not one of timm's" in line and "convnext_atto" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("sets, field, message", [
    (["model.arch=convnext_atto", "model.img_size=32"], "model.img_size", "timm's convnext_atto takes no img_size"),
    (["model.arch=vit_tiny_patch16_224"], "model.arch=vit_tiny_patch16_224",
     "the network fails on 32 px images"),                       # (built for 224 px: its position embedding)
    # (16 px crops: the stem and three halvings leave less than its 2x2 downsampling kernel; before, the check's
    # retry on the CPU copied its meta input and named that instead)
    (["model.arch=convnext_atto", "data.progressive=[[0.0, 0.5], [0.5, 1.0]]"], "model.arch=convnext_atto",
     "the network fails on 16 px images of 3 channels (RuntimeError: Calculated padded input size"),
    (["model.arch=resnet10t", "model.args={num_classes=3}"], "model.args.num_classes", "leave it out"),
    (["model.arch=resnet10t", "model.whiten.kernel=2"], "model.whiten", "remove model.whiten"),
    (["model.arch=resnet10t", "model.norm.scale=frozen"], "model.norm", "remove model.norm"),
])
def test_what_a_timm_network_cannot_take_is_one_line_naming_the_field(npz32, tmp_path, cli, sets, field, message):
    recipe = recipe_file(tmp_path, {"name": "timm", "arch": "resnet10t"})
    rc, err = cli("train", recipe, "--data-dir", npz32, "--device", "cpu", "--out", tmp_path / "run",
                  *sum((["--set", s] for s in sets), []))
    line = one_error_line(err)
    assert rc == 2 and field in line and message in line, line
    assert not (tmp_path / "run").exists()


def test_a_vit_of_one_size_refuses_progressive_sizes_until_told_to_take_any(npz32, tmp_path, cli, capsys):
    model = {"name": "timm", "arch": "vit_tiny_patch16_224", "img_size": 32, "args": {"patch_size": 8, "depth": 1}}
    recipe = recipe_file(tmp_path, model)
    progressive = ["--set", "data.progressive=[[0.0, 0.75], [0.5, 1.0]]"]
    rc, err = cli("train", recipe, "--data-dir", npz32, "--device", "cpu", "--out", tmp_path / "run", *progressive)
    line = one_error_line(err)
    assert rc == 2 and "fails on 24 px images" in line and "dynamic_img_size = true" in line
    summary, _ = trained(cli, capsys, tmp_path, npz32, {**model, "args": {**model["args"], "dynamic_img_size": True}},
                         "data.progressive=[[0.0, 0.75], [0.5, 1.0]]", "train.epochs=1")
    assert summary["epochs"] == 1


def test_weights_of_another_architecture_are_refused_in_one_line(timm_weights):
    with pytest.raises(CheckpointError) as err:
        open_weights(f"timm:convnext_femto={timm_weights / 'convnext_atto.pth'}")
    assert "not the weights of timm's convnext_femto (" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(RecipeError, match="model.args.in_chans is set by the data"):
        load_recipe("fashion-mnist", ["model.name=timm", "model.arch=resnet10t", "model.args={in_chans=1}"])


# ------------------------------------------------------------------------------------------
# The engine's features with a timm network
# ------------------------------------------------------------------------------------------

def test_a_timm_network_compiles_resizes_streams_from_the_decoded_cache_and_checks_a_target(
        jpeg32, tmp_path, cli, capsys, monkeypatch):
    """resnet10t (narrow) on the CIFAR-10 JPEG folder, streamed: compiled (aot_eager: dynamo's
    capture and AOTAutograd as inductor gets them) with no recompile after the warm-up, progressive
    sizes (16 px, then 32 px crops), the images decoded once into the cache, and a target it cannot
    reach checked on a held-out fifth of the training images every epoch; then ``speedrun flops``
    of the same recipe gives torch's FlopCounterMode count of timm's network, and ``speedrun bench``
    runs it twice with its statistics. Seed 0, 2-core Intel Xeon 6/207, torch 2.14.1: 26.2% (bar 14.0%)."""
    monkeypatch.setenv("SPEEDRUN_COMPILE_BACKEND", "aot_eager")
    model = {"name": "timm", **FAMILIES["resnet10t"][0]}
    recipe = recipe_file(tmp_path, model, data={"dataset": "folder", "batch_size": 32, "workers": 1,
                                                "progressive": [[0.0, 0.5], [0.5, 1.0]], "cache": "on",
                                                "cache_dir": str(tmp_path / "cache"), "holdout": 0.2},
                         train={"epochs": 4, "label_smoothing": 0.1, "stop_at_target": True, "stop_check_every": 1},
                         runtime={**RECIPE["runtime"], "compile": "on"}, target=0.99)
    args = ["train", recipe, "--data-dir", jpeg32, "--device", "cpu", "--out", tmp_path / "run", "--seed", 0]
    capsys.readouterr()
    from speedrun import cli as speedrun_cli
    rc = speedrun_cli.main([str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_acc"] > bar(10, 512), summary["test_acc"]
    assert summary["compile"] and summary["compile_backend"] == "aot_eager" and summary["recompiles"] == 0
    assert summary["compile_seconds"] > 0
    assert summary["train_steps_by_size"] == {"16x16": 24, "32x32": 24}, summary["train_steps_by_size"]
    cache = summary["data_cache"]
    assert cache["cache_made_now"] and Path(cache["cache"]).parent == tmp_path / "cache" and cache["cache_size"] == 32
    target = summary["stop_at_target"]                 # (checked after epochs 1-3; the 4th ends the run)
    assert target["reached"] is None and target["checks"] == 3 and target["holdout_images"] == 102, target
    epochs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["holdout_acc"] is not None for e in epochs] == [True, True, True, False]
    assert all(0 <= e["holdout_acc"] <= 1 for e in epochs[:3])

    rc, err = cli("flops", recipe, "--data-dir", jpeg32, "--steps", 2, "--json", tmp_path / "f.json")
    assert rc == 0, err
    from torch.utils.flop_counter import FlopCounterMode
    net = build_model(load_recipe(str(recipe)).model, 3, 10)
    with FlopCounterMode(display=False) as counted:
        net(torch.zeros(2, 3, 32, 32))
    assert json.loads((tmp_path / "f.json").read_text())["flops_per_forward_image"] == counted.get_total_flops() / 2

    rc, err = cli("bench", recipe, "--runs", 2, "--data-dir", jpeg32, "--device", "cpu", "--out", tmp_path / "bench",
                  "--set", "train.epochs=1", "--set", "train.stop_at_target=false")
    assert rc == 0, err
    bench = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [r["seed"] for r in bench["runs"]] == [0, 1] and bench["summary"]["test_acc"]["n"] == 2, bench["summary"]


def test_a_timm_network_trains_the_same_weights_on_two_processes_as_on_one(npz32, tmp_path):
    """convnext_atto (narrow; layer norms, so no batch statistics to share) in fp32 with AdamW and
    layer decay over timm's blocks: one process, and two started by torchrun (gloo) at the same
    global batch, each training on its half of every batch, end with the same weights."""
    from test_distributed import ok, relative_difference, run, single, summary, torchrun_cmd, weights
    model = {"name": "timm", **FAMILIES["convnext_atto"][0]}
    recipe = recipe_file(tmp_path, model, optim={"name": "adamw", "lr": 0.002, "ref_batch": 32, "weight_decay": 0.05,
                                                 "layer_decay": 0.8},
                         train={"epochs": 1, "label_smoothing": 0.1}, eval={"every": 0, "batch_size": 256, "tta": "none"})
    common = [recipe, "--data-dir", npz32, "--device", "cpu", "--seed", 0]
    ok(single(*common, "--out", tmp_path / "one"))
    ok(run(torchrun_cmd(*common, "--out", tmp_path / "two")))
    one, two = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert (one["world_size"], two["world_size"], one["steps"], two["steps"]) == (1, 2, 16, 16)
    assert (one["per_rank_batch"], two["per_rank_batch"]) == (32, 16)
    diff = relative_difference(weights(tmp_path / "one"), weights(tmp_path / "two"))
    assert diff < 1e-5, diff
    assert one["test_acc"] == pytest.approx(two["test_acc"], abs=1 / 512 + 1e-9)
