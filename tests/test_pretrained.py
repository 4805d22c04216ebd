"""Weights to start from (``model.init``): each source opens into speedrun's layout and loads into a
speedrun model built from its [model] section, computing what the original computed; adaptation
to other channels and classes; torchvision names fetched from a file:// mirror and checked
against their hash; and every refusal one line, with nothing run and nothing written.

The tests that compare with torchvision's and timm's own models need them (``.venv-2.14``) and
are skipped, saying so, where they cannot be imported."""
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
from pydantic import TypeAdapter

from speedrun.errors import CheckpointError
from speedrun.models import build_model
from speedrun.models import published_weights as published
from speedrun.models.pretrained import apply_weights, open_weights
from speedrun.recipe import init_is_weights
from speedrun.recipe import ModelConfig, ResNetConfig
from small_data import speedrun

IMAGENET_MEAN = [255 * m for m in (0.485, 0.456, 0.406)]
IMAGENET_STD = [255 * s for s in (0.229, 0.224, 0.225)]


def speedrun_model(section: dict, in_channels: int, num_classes: int) -> torch.nn.Module:
    """The speedrun model a [model] section builds (what the training run builds from it)."""
    return build_model(TypeAdapter(ModelConfig).validate_python(section), in_channels, num_classes)


@torch.no_grad()
def randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` with random weights and batch-norm statistics, in eval mode: every tensor matters."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=gen))
            m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
            m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
    return model.eval()


def foreign_key(key: str, deep_stem: bool) -> str:
    """The name torchvision (plain stem) or timm (``resnet*d``: deep stem, pooled projection)
    gives a speedrun ResNet tensor."""
    if key.startswith("head."):
        return "fc." + key[5:]
    m = re.fullmatch(r"stem\.(\d)\.(.+)", key)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        if deep_stem:
            return f"bn1.{rest}" if i == 7 else f"conv1.{i}.{rest}"
        return f"{'conv1' if i == 0 else 'bn1'}.{rest}"
    m = re.fullmatch(r"stages\.(\d)\.(\d+)\.(.+)", key)
    stage, block, rest = int(m.group(1)), int(m.group(2)), m.group(3)
    s = re.fullmatch(r"shortcut\.(\d)\.(.+)", rest)
    if s:
        shift = 1 if deep_stem and stage == 0 else 0        # timm's pool is an identity at stride 1
        rest = f"downsample.{int(s.group(1)) + shift}.{s.group(2)}"
    return f"layer{stage + 1}.{block}.{rest}"


def saved_foreign(model, path, deep_stem=False, wrap=None):
    state = {foreign_key(k, deep_stem): v for k, v in model.state_dict().items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save({wrap: state} if wrap else state, path)
    return path


def loaded(pre, in_channels=None, num_classes=None):
    """A speedrun model built from the weights' section for data of these channels and classes,
    with the weights applied: (model in eval mode, notes)."""
    c, k = in_channels or pre.in_channels, num_classes or pre.num_classes
    model = speedrun_model(pre.model, c, k)
    notes = apply_weights(model, pre, c, k)
    return model.eval(), notes


def one_line_refusal(spec, *, cache_dir=None):
    with pytest.raises(CheckpointError) as err:
        open_weights(str(spec), cache_dir)
    message = str(err.value)
    assert message.startswith(f"model.init={spec}: ") and "\n" not in message
    return message


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None


# ------------------------------------------------------------------------------------------
# Files in torchvision's and timm's layouts (speedrun ResNets saved under their names)
# ------------------------------------------------------------------------------------------

def test_schemes_are_not_weights():
    assert not any(init_is_weights(s) for s in ("kaiming", "xavier", "default"))
    assert all(init_is_weights(s) for s in ("runs/a", "w.pth", "timm:resnet50.a1_in1k", "torchvision:resnet18"))


@pytest.mark.parametrize("depth, variant, suffix, wrap", [
    (18, "a", ".pth", None),                 # torchvision's layout, basic blocks
    (50, "b", ".pt", "state_dict"),          # torchvision's bottlenecks (3x3 conv strided), wrapped
    (50, "d", ".safetensors", None),         # timm's resnet50d: deep stem, pooled projections
])
def test_a_resnet_file_round_trips_to_the_same_outputs(tmp_path, depth, variant, suffix, wrap):
    cfg = ResNetConfig(depth=depth, variant=variant)
    original = randomised(build_model(cfg, 3, 7))
    path = saved_foreign(original, tmp_path / f"weights{suffix}", deep_stem=variant == "d", wrap=wrap)
    before = listing(tmp_path)
    pre = open_weights(str(path))
    assert pre.model == {"name": "resnet", "depth": depth, "variant": variant, "stem": "imagenet", "width": 64}
    assert (pre.in_channels, pre.num_classes, pre.head) == (3, 7, ("head.weight", "head.bias"))
    assert pre.mean is pre.std is pre.image_size is pre.classes is None     # a bare file says nothing of them
    assert pre.description.startswith(f"ResNet-{depth}") and "sha256" in pre.description
    model, notes = loaded(pre)
    x = torch.randn(2, 3, 64, 64)
    assert notes == [] and torch.allclose(model(x), original(x), atol=1e-5)
    assert listing(tmp_path) == before                                      # read only


def test_grey_data_from_colour_weights_sees_the_grey_image_as_three_equal_channels(tmp_path):
    original = randomised(build_model(ResNetConfig(depth=18), 3, 10))
    pre = open_weights(str(saved_foreign(original, tmp_path / "rgb.pth")))
    grey, notes = loaded(pre, in_channels=1)
    assert notes == ["first layer stem.0.weight adapted from 3 to 1 input channels (summed over the weights' 3 "
                     "colour channels)"]
    x = torch.randn(3, 1, 64, 64)
    assert torch.allclose(grey(x), original(x.repeat(1, 3, 1, 1)), atol=1e-4)


def test_other_classes_get_the_models_fresh_head_and_keep_the_rest(tmp_path):
    original = randomised(build_model(ResNetConfig(depth=18), 3, 1000))
    pre = open_weights(str(saved_foreign(original, tmp_path / "in1k.pth")))
    model = speedrun_model(pre.model, 3, 5)
    fresh = {k: v.clone() for k, v in model.head.state_dict().items()}
    notes = apply_weights(model, pre, 3, 5)
    assert notes == ["head replaced for 5 classes (the weights had 1000)"]
    assert all(torch.equal(model.head.state_dict()[k], v) for k, v in fresh.items())
    model.eval()
    x = torch.randn(2, 3, 64, 64)
    features = lambda m: m.stages(m.stem(x)).mean(dim=(2, 3))               # noqa: E731
    assert torch.allclose(features(model), features(original), atol=1e-5)


def test_weights_that_do_not_fit_the_model_name_the_first_tensor(tmp_path):
    pre = open_weights(str(saved_foreign(randomised(build_model(ResNetConfig(depth=18), 3, 10)), tmp_path / "w.pth")))
    narrow = build_model(ResNetConfig(depth=18, width=32), 3, 10)
    with pytest.raises(CheckpointError) as err:
        apply_weights(narrow, pre, 3, 10)
    message = str(err.value)
    assert message.startswith(f"model.init={pre.source}: the weights do not fit the model (tensor stem.0.weight is "
                              "64x3x7x7 in the weights but 32x3x7x7 in the model)") and "\n" not in message
    with pytest.raises(CheckpointError, match="take 3 input channels and the data has 4; speedrun adapts 3"):
        apply_weights(speedrun_model(pre.model, 4, 10), pre, 4, 10)


def test_a_misshapen_or_missing_tensor_of_a_resnet_file_is_named_as_the_file_names_it(tmp_path, cli, data_dir):
    files = tmp_path / "files"
    files.mkdir()
    plain = torch.load(saved_foreign(build_model(ResNetConfig(depth=18), 3, 10), files / "r18.pth"))
    torch.save({**plain, "layer3.1.conv2.weight": torch.zeros(256, 256, 1, 1)}, files / "r18.pth")  # 3x3 in one
    torch.save({**plain, "layer4.1.bn3.weight": torch.zeros(512)}, files / "extra.pth")  # basic blocks have two BNs
    deep = torch.load(saved_foreign(build_model(ResNetConfig(depth=18, variant="d"), 3, 10), files / "r18d.pth",
                                    deep_stem=True))
    del deep["layer2.0.downsample.2.weight"]                           # timm's name of the projection's BN
    torch.save(deep, files / "r18d.pth")
    before = listing(tmp_path)
    assert one_line_refusal(files / "r18d.pth").endswith(
        ": the weights are not a ResNet-18 speedrun builds (missing tensor layer2.0.downsample.2.weight (speedrun's "
        "stages.1.0.shortcut.2.weight), 128 in the model); speedrun loads its own runs and ResNet-18/34/50/101 in "
        "torchvision's or timm's layout (resnet18-101, resnet18d-101d)")
    assert one_line_refusal(files / "extra.pth").endswith(
        "(unexpected tensor layer4.1.bn3.weight (speedrun's stages.3.1.bn3.weight), 512 in the weights: the model has "
        "no such tensor); speedrun loads its own runs and ResNet-18/34/50/101 in torchvision's or timm's layout "
        "(resnet18-101, resnet18d-101d)")
    rc, err = cli("train", "fashion-mnist", "--data-dir", data_dir, "--init", files / "r18.pth", "--out",
                  tmp_path / "run")
    assert rc == 1 and err.count("speedrun: error: ") == 1 and "Traceback" not in err, err
    assert (f"model.init={files / 'r18.pth'}: the weights are not a ResNet-18 speedrun builds (tensor "
            "layer3.1.conv2.weight (speedrun's stages.2.1.conv2.weight) is 256x256x1x1 in the weights but "
            "256x256x3x3 in the model)") in err
    assert listing(tmp_path) == before


# ------------------------------------------------------------------------------------------
# A speedrun run
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grey_run(tmp_path_factory, fashion_small):
    """A speed net (with whitening) trained for 2 real steps on Fashion-MNIST's slice."""
    run = tmp_path_factory.mktemp("pretrained") / "run"
    speedrun("train", "fashion-mnist", "--data-dir", fashion_small, "--set", "data.dataset=npz", "--set",
             "model.widths=[8,8,8]", "--set", "data.batch_size=256", "--set", "train.epochs=0.5", "--set",
             "eval.tta=none", "--device", "cpu", "--out", run)
    return run


def test_a_run_folder_and_its_model_pt_open_as_the_run(grey_run):
    from speedrun.use import load_run
    pre_json = json.loads((grey_run / "preprocessing.json").read_text())
    before = listing(grey_run)
    for spec in (grey_run, grey_run / "model.pt"):
        pre = open_weights(str(spec))
        assert pre.model["name"] == "speednet" and pre.model["widths"] == [8, 8, 8] and "init" not in pre.model
        assert (pre.in_channels, pre.num_classes, pre.classes) == (1, 10, pre_json["classes"])
        assert (pre.mean, pre.std, pre.image_size, pre.eval_size) == (pre_json["mean"], pre_json["std"], 28, 28)
        assert pre.head == ("head.weight",) and pre.description.startswith("speedrun run run (speed net 8/8/8")
    run = load_run(grey_run, "cpu")
    model, notes = loaded(pre)
    x = torch.randn(4, 1, 28, 28)
    assert notes == [] and torch.allclose(model(x), run.model(x), atol=1e-6)
    assert listing(grey_run) == before


def test_colour_data_for_a_grey_speed_net_is_refused_in_one_line(grey_run):
    """A speed net's whitening layer has 2 x C x k x k filters fitted to its images' channels: its
    weights fine-tune on images with as many channels, and other data is refused, naming both."""
    pre = open_weights(str(grey_run))
    with pytest.raises(CheckpointError) as err:
        loaded(pre, in_channels=3, num_classes=10)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model.init={grey_run}: ")
    assert "fitted to 1-channel images" in message and "this data has 3" in message


def test_a_folder_that_is_not_a_finished_run_is_refused(grey_run, tmp_path):
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.toml").write_bytes((grey_run / "config.toml").read_bytes())
    message = one_line_refusal(half)
    assert "is not a finished speedrun run (it has no model.pt, preprocessing.json)" in message
    alone = tmp_path / "model.pt"                                  # a run's weights without their run
    alone.write_bytes((grey_run / "model.pt").read_bytes())
    assert "holds a speedrun model's weights without its run; give the run folder" in one_line_refusal(alone)
    damaged = tmp_path / "damaged"                                 # preprocessing.json edited by hand
    damaged.mkdir()
    for name in ("config.toml", "model.pt", "preprocessing.json"):
        (damaged / name).write_bytes((grey_run / name).read_bytes())
    pre = json.loads((damaged / "preprocessing.json").read_text())
    (damaged / "preprocessing.json").write_text(json.dumps({**pre, "mean": [0.5, 0.5, 0.5]}))
    assert (f"{damaged / 'preprocessing.json'}: entry mean holds 3 values, not 1 numbers (one per channel, 1 channel); "
            "the file is damaged" in one_line_refusal(damaged))
    before = listing(tmp_path)
    for spec in (half, alone, damaged):
        one_line_refusal(spec)
    assert listing(tmp_path) == before


# ------------------------------------------------------------------------------------------
# torchvision names: a mirror, the hash, no network
# ------------------------------------------------------------------------------------------

@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A file:// mirror holding a ResNet-18 in torchvision's layout under its hashed name, and an
    entry for it in the catalogue of torchvision names (the real files need a network)."""
    folder = tmp_path / "mirror"
    folder.mkdir()
    original = randomised(build_model(ResNetConfig(depth=18), 3, 1000))
    saved = saved_foreign(original, tmp_path / "r18.pth")
    prefix = published.sha256_of(saved)[:8]
    os.replace(saved, folder / f"resnet18-{prefix}.pth")
    monkeypatch.setitem(published.TORCHVISION, "resnet18.TEST_V1",
                        published.TorchvisionWeights(f"resnet18-{prefix}.pth", 224, 224, 69.758))
    monkeypatch.setenv("SPEEDRUN_WEIGHTS_URL", folder.as_uri())
    return folder, prefix, original


def test_a_torchvision_name_is_fetched_checked_cached_and_reused(mirror, tmp_path):
    folder, prefix, original = mirror
    cache = tmp_path / "cache"
    pre = open_weights("torchvision:resnet18.TEST_V1", cache)
    assert listing(cache) == ["weights", f"weights/resnet18-{prefix}.pth"]
    assert pre.description == f"ResNet-18 (torchvision TEST_V1 weights, 69.8% ImageNet top-1, sha256 {prefix}...)"
    assert pre.mean == IMAGENET_MEAN and pre.std == IMAGENET_STD and (pre.image_size, pre.eval_size) == (224, 224)
    model, _ = loaded(pre)
    x = torch.randn(2, 3, 64, 64)
    assert torch.allclose(model(x), original(x), atol=1e-5)
    cached = cache / "weights" / f"resnet18-{prefix}.pth"
    os.replace(folder / cached.name, tmp_path / "away.pth")         # the mirror gone: the cached copy serves
    assert torch.equal(open_weights("torchvision:resnet18.TEST_V1", cache).state["head.bias"], pre.state["head.bias"])
    cached.write_bytes(cached.read_bytes()[:1000])                    # a damaged copy is not used
    assert "could not fetch" in one_line_refusal("torchvision:resnet18.TEST_V1", cache_dir=cache)
    assert listing(cache) == ["weights"]
    os.replace(tmp_path / "away.pth", folder / cached.name)           # ... and is fetched again
    assert torch.equal(open_weights("torchvision:resnet18.TEST_V1", cache).state["head.bias"], pre.state["head.bias"])


def test_a_download_with_the_wrong_hash_leaves_nothing(mirror, tmp_path, monkeypatch):
    folder, prefix, _ = mirror
    os.replace(folder / f"resnet18-{prefix}.pth", folder / "resnet18-00000000.pth")
    monkeypatch.setitem(published.TORCHVISION, "resnet18.TEST_V1",
                        published.TorchvisionWeights("resnet18-00000000.pth", 224, 224, 0.0))
    cache = tmp_path / "cache"
    message = one_line_refusal("torchvision:resnet18.TEST_V1", cache_dir=cache)
    assert f"{folder.as_uri()}/resnet18-00000000.pth: the download's SHA-256 does not start with 00000000" in message
    assert not cache.exists()


def test_no_network_is_one_line_naming_the_url_and_the_way_round(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_WEIGHTS_URL", "http://127.0.0.1:9/")
    cache = tmp_path / "cache"
    message = one_line_refusal("torchvision:resnet18", cache_dir=cache)
    assert "could not fetch http://127.0.0.1:9/resnet18-f37072fd.pth" in message
    assert message.endswith("download it where there is a network and give the file: --set "
                            "model.init=/path/resnet18-f37072fd.pth (or set $SPEEDRUN_WEIGHTS_URL to a mirror)")
    assert not cache.exists()
    assert "torchvision has no ResNet weights named 'resnet152.IMAGENET1K_V2'" in one_line_refusal(
        "torchvision:resnet152.IMAGENET1K_V2", cache_dir=cache)


# ------------------------------------------------------------------------------------------
# Files that are not weights to start from
# ------------------------------------------------------------------------------------------

class Payload:
    """Unpickled, this would run a command that leaves a file behind."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_damaged_foreign_and_unsafe_files_are_each_one_line_and_nothing_runs_or_is_written(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    marker = tmp_path / "ran"
    good = saved_foreign(randomised(build_model(ResNetConfig(depth=18), 3, 10)), src / "good.pth")
    safe = saved_foreign(randomised(build_model(ResNetConfig(depth=18), 3, 10)), src / "good.safetensors")
    (src / "truncated.pth").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (src / "truncated.safetensors").write_bytes(safe.read_bytes()[:5000])
    torch.save({"fc.weight": torch.zeros(2, 2), "x": Payload(marker)}, src / "payload.pth")
    with open(src / "payload_raw.pt", "wb") as f:
        pickle.dump({"x": Payload(marker)}, f)
    (src / "notes.pt").write_text("not weights")
    torch.save({"epoch": 3, "lr": 0.1}, src / "numbers.pt")
    torch.save(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(8, 2)).state_dict(), src / "other.pth")
    resnet152 = torch.load(good)                                       # 36 blocks in the third stage
    resnet152.update({f"layer3.{j}.conv1.weight": torch.zeros(256, 256, 3, 3) for j in range(2, 36)})
    torch.save(resnet152, src / "deeper.pth")
    (src / "weights.txt").write_text("0.1 0.2")
    before = listing(tmp_path)
    expected = {
        "truncated.pth": "cannot be read as torch weights (PytorchStreamReader failed reading zip archive",
        "truncated.safetensors": "cannot be read as safetensors (",
        "payload.pth": "holds Python objects besides tensors, which unpickling could run as code, so it is not loaded",
        "payload_raw.pt": "cannot be read as torch weights (not a file torch.save wrote)",
        "notes.pt": "cannot be read as torch weights (not a file torch.save wrote)",
        "numbers.pt": "holds no weights (a dict of tensors, or one under 'state_dict' or 'model', is expected)",
        "other.pth": "not a ResNet in torchvision's or timm's layout (its first tensor is 0.weight); speedrun loads "
                     "its own runs and ResNet-18/34/50/101",
        "deeper.pth": "a ResNet with 2/2/36/2 basic blocks per stage is not one speedrun builds",
        "weights.txt": "not a file of weights (.pt, .pth or .safetensors)",
        "missing.pth": "no such file or folder",
    }
    for name, text in expected.items():
        assert text in one_line_refusal(src / name), name
    assert not marker.exists() and listing(tmp_path) == before


# The first tensors of torchvision's vgg11, mobilenet_v2, mobilenet_v3_large and densenet121 and
# their classifiers, by the names and shapes torchvision gives them
OTHER_TORCHVISION_NETWORKS = {
    "vgg11": ("VGG", {
        "features.0.weight": (64, 3, 3, 3), "features.0.bias": (64,), "features.3.weight": (128, 64, 3, 3),
        "features.3.bias": (128,), "features.6.weight": (256, 128, 3, 3), "features.6.bias": (256,),
        "classifier.0.weight": (4096, 25088), "classifier.0.bias": (4096,), "classifier.3.weight": (4096, 4096),
        "classifier.3.bias": (4096,), "classifier.6.weight": (1000, 4096), "classifier.6.bias": (1000,)}),
    "mobilenet_v2": ("MobileNetV2", {
        "features.0.0.weight": (32, 3, 3, 3), "features.0.1.weight": (32,), "features.0.1.bias": (32,),
        "features.0.1.running_mean": (32,), "features.0.1.running_var": (32,),
        "features.0.1.num_batches_tracked": (), "features.1.conv.0.0.weight": (32, 1, 3, 3),
        "features.1.conv.0.1.weight": (32,), "features.1.conv.1.weight": (16, 32, 1, 1),
        "classifier.1.weight": (1000, 1280), "classifier.1.bias": (1000,)}),
    "mobilenet_v3_large": ("MobileNetV3", {
        "features.0.0.weight": (16, 3, 3, 3), "features.0.1.weight": (16,), "features.0.1.bias": (16,),
        "features.0.1.running_mean": (16,), "features.0.1.running_var": (16,),
        "features.0.1.num_batches_tracked": (), "features.1.block.0.0.weight": (16, 1, 3, 3),
        "classifier.0.weight": (1280, 960), "classifier.0.bias": (1280,), "classifier.3.weight": (1000, 1280),
        "classifier.3.bias": (1000,)}),
    "densenet121": ("DenseNet", {
        "features.conv0.weight": (64, 3, 7, 7), "features.norm0.weight": (64,), "features.norm0.bias": (64,),
        "features.norm0.running_mean": (64,), "features.norm0.running_var": (64,),
        "features.norm0.num_batches_tracked": (), "features.denseblock1.denselayer1.norm1.weight": (64,),
        "features.denseblock1.denselayer1.conv1.weight": (128, 64, 1, 1),
        "classifier.weight": (1000, 1024), "classifier.bias": (1000,)}),
}


def shaped_like(shapes: dict) -> dict[str, torch.Tensor]:
    """Tensors of these names and shapes, each one stored zero broadcast to its shape (so that
    VGG's 4096x25088 classifier takes a few bytes on disk)."""
    return {k: torch.zeros(()).expand(shape) for k, shape in shapes.items()}


def test_other_torchvision_networks_are_named_for_what_they_are_not_taken_for_speedruns(tmp_path, cli, data_dir):
    files = tmp_path / "files"
    files.mkdir()
    for name, (family, shapes) in OTHER_TORCHVISION_NETWORKS.items():
        torch.save(shaped_like(shapes), files / f"{name}.pth")
    speed_net = speedrun_model({"name": "speednet", "widths": [8, 8]}, 3, 10).state_dict()
    resnet = build_model(ResNetConfig(depth=18), 3, 10).state_dict()
    torch.save(speed_net, files / "speednet.pt")
    torch.save(resnet, files / "resnet.pt")
    before = listing(tmp_path)
    for name, (family, _) in OTHER_TORCHVISION_NETWORKS.items():
        message = one_line_refusal(files / f"{name}.pth")
        assert message.endswith(f": looks like torchvision's {family} weights (tensors features.*, classifier.*), "
                                "not a ResNet; speedrun loads its own runs and ResNet-18/34/50/101 in torchvision's "
                                "or timm's layout (resnet18-101, resnet18d-101d)"), message
        assert "speedrun model" not in message
    for name in ("speednet.pt", "resnet.pt"):                     # speedrun's own: the run folder is wanted
        assert "holds a speedrun model's weights without its run; give the run folder" in one_line_refusal(files / name)
    # timm's ConvNeXt starts its names as speedrun's ResNet does (stem, stages, head) and is not one
    timm_like = {"stem.0.weight": torch.zeros(96, 3, 4, 4), "stages.0.blocks.0.conv_dw.weight": torch.zeros(96, 1, 7, 7),
                 "head.norm.weight": torch.zeros(768), "head.fc.weight": torch.zeros(1000, 768)}
    torch.save(timm_like, files / "convnext.pth")
    assert "not a ResNet in torchvision's or timm's layout (its first tensor is stem.0.weight)" in one_line_refusal(
        files / "convnext.pth")
    os.remove(files / "convnext.pth")
    # ... and the command says the same in one line, leaving no run folder
    rc, err = cli("train", "fashion-mnist", "--data-dir", data_dir, "--init", files / "vgg11.pth", "--out",
                  tmp_path / "run")
    assert rc == 1 and err.count("speedrun: error: ") == 1 and "Traceback" not in err, err
    assert f"{files / 'vgg11.pth'}: looks like torchvision's VGG weights (tensors features.*, classifier.*)" in err
    assert listing(tmp_path) == before


def test_timm_names_without_timm_say_how_to_install_it():
    try:
        import timm  # noqa: F401
        pytest.skip("timm is installed here (its refusal is for installs without it)")
    except ImportError:
        pass
    assert one_line_refusal("timm:resnet50.a1_in1k") == ("model.init=timm:resnet50.a1_in1k: needs timm: pip install "
                                                         "'speedrun[timm]'")


# ------------------------------------------------------------------------------------------
# torchvision's and timm's own models (.venv-2.14)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, variant", [("resnet18", "a"), ("resnet50", "b")])
def test_torchvision_resnets_load_and_compute_what_torchvision_computes(tmp_path, arch, variant):
    models = pytest.importorskip("torchvision.models", reason="torchvision is not installed (.venv-2.14 has it)")
    torch.manual_seed(0)
    net = randomised(getattr(models, arch)(weights=None))
    path = tmp_path / f"{arch}.pth"
    torch.save(net.state_dict(), path)
    pre = open_weights(str(path))
    assert pre.model == {"name": "resnet", "depth": int(arch[6:]), "variant": variant, "stem": "imagenet", "width": 64}
    model, _ = loaded(pre)
    x = torch.randn(2, 3, 96, 96)
    assert torch.allclose(model(x), net(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, variant", [("resnet50d", "d"), ("resnet18d", "d"), ("resnet34", "a")])
def test_timm_resnets_load_and_compute_what_timm_computes(tmp_path, arch, variant):
    timm = pytest.importorskip("timm", reason="timm is not installed (.venv-2.14 has it)")
    from safetensors.torch import save_file
    torch.manual_seed(0)
    net = randomised(timm.create_model(arch, pretrained=False))
    path = tmp_path / f"{arch}.safetensors"
    save_file(net.state_dict(), str(path))
    pre = open_weights(str(path))
    assert (pre.model["depth"], pre.model["variant"]) == (int(re.search(r"\d+", arch).group()), variant)
    model, _ = loaded(pre)
    x = torch.randn(2, 3, 96, 96)
    assert torch.allclose(model(x), net(x), atol=1e-4, rtol=1e-4)
    # the same file named as timm's: its training told by timm's pretrained_cfg
    tagged = open_weights(f"timm:{arch}={path}")
    cfg = net.pretrained_cfg
    assert tagged.mean == [255 * m for m in cfg["mean"]] and tagged.std == [255 * s for s in cfg["std"]]
    assert (tagged.image_size, tagged.eval_size) == (cfg["input_size"][-1],
                                                     (cfg.get("test_input_size") or cfg["input_size"])[-1])
    assert all(torch.equal(tagged.state[k], pre.state[k]) for k in pre.state)


def test_timm_refuses_unknown_names_wrong_files_and_says_what_to_do_offline(tmp_path):
    timm = pytest.importorskip("timm", reason="timm is not installed (.venv-2.14 has it)")
    assert "timm has no model 'resnet5'" in one_line_refusal("timm:resnet5")
    assert "did you mean convnext_atto" in one_line_refusal("timm:convnxt_atto")
    path = tmp_path / "r18.pth"
    torch.save(timm.create_model("resnet18").state_dict(), path)
    assert ("not the weights of timm's resnet50d (missing tensor conv1.0.weight"
            in one_line_refusal(f"timm:resnet50d={path}"))
    assert "no such file" in one_line_refusal(f"timm:resnet50={tmp_path / 'none.pth'}")
    # no network (and an empty hub cache): one line naming the file to fetch elsewhere
    code = ("from speedrun.models.pretrained import open_weights\nfrom speedrun.errors import CheckpointError\n"
            "try:\n    open_weights('timm:resnet18.a1_in1k')\nexcept CheckpointError as err:\n    print(err)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TORCH_HOME": str(tmp_path / "th")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300).stdout
    assert out.startswith("model.init=timm:resnet18.a1_in1k: timm could not get the weights of resnet18.a1_in1k (")
    assert out.rstrip().endswith("download https://huggingface.co/timm/resnet18.a1_in1k/resolve/main/model.safetensors"
                                 " where there is a network and give it: --set "
                                 "model.init='timm:resnet18.a1_in1k=/path/model.safetensors'")
    assert len(out.splitlines()) == 1
