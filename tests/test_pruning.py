"""data.prune: loss-based pruning of easy images between passes (speedrun.data.pipeline.pruning), on
real data and real training processes."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from speedrun.data.augment.batch import BatchAugment
from speedrun.data.pipeline.pruning import LossPruner
from speedrun.engine.runtime import Runtime
from speedrun.engine.step import TrainStep
from speedrun.errors import RecipeError
from speedrun.recipe import load_recipe

from test_cli import speedrun
from test_training_features import TINY, killed_at_first_checkpoint

CPU = torch.device("cpu")


def test_the_first_pass_keeps_every_image_and_later_ones_drop_only_easy_images():
    n, gen = 1000, torch.Generator().manual_seed(0)
    p = LossPruner(n, 0.5, full_from_step=10 ** 6, device=CPU)
    p.plan(gen, full=False)
    assert len(p.order) == n and sorted(p.order.tolist()) == list(range(n))        # nothing seen yet
    assert torch.equal(p.weight, torch.ones(n))
    p.loss.copy_(torch.arange(n, dtype=torch.float32))          # mean 499.5: images 0..499 are easy
    p.plan(gen, full=False)
    kept = set(p.order.tolist())
    assert set(range(500, n)) <= kept                            # every hard image stays
    easy_kept = kept - set(range(500, n))
    assert 200 < len(easy_kept) < 300                            # about half of the 500 easy ones
    w = p.weight
    assert all(w[i] == 2.0 for i in easy_kept)                   # 1 / (1 - 0.5)
    assert torch.all(w[500:] == 1.0)
    assert len(p.order) == len(set(p.order.tolist()))            # each kept image once per pass
    p.plan(gen, full=True)                                       # the end of the run: every image, weight 1
    assert len(p.order) == n and torch.equal(p.weight, torch.ones(n))
    assert p.kept == [n, len(kept), n]


def test_batches_come_from_passes_and_the_end_of_the_run_uses_every_image():
    n, b = 100, 30
    recipe = load_recipe("cifar10-94-cpu")
    gen = torch.Generator().manual_seed(1)
    augment = BatchAugment(recipe.augment, n, (32, 32), gen, CPU)
    p = LossPruner(n, 0.5, full_from_step=9, device=CPU)
    seen, flips = [], []
    for step in range(12):
        idx = p.batch(b, step, gen, augment)
        assert len(idx) == b
        seen.append(idx)
        flips.append(p.draws["flip"].clone())
        p.record(torch.arange(n, dtype=torch.float32)[idx])     # image i's loss is i: 0..49 easy
    assert p.kept[0] == n and torch.equal(torch.cat(seen[:3]).sort().values, torch.cat(seen[:3]).unique())
    assert all(k < n for k in p.kept[1:-1]) and p.kept[-1] == n  # pruned passes, then a full one from step 9
    assert torch.equal(flips[3], ~flips[0])                      # the alternating flip turns each pass
    # a pass's remainder (100 - 90 images) is dropped: the fourth batch starts a new pass
    assert p.passes >= 4


def test_a_pass_smaller_than_a_batch_stops_naming_the_fields():
    n = 100
    augment = BatchAugment(load_recipe("cifar10-94-cpu").augment, n, (32, 32), torch.Generator(), CPU)
    p = LossPruner(n, 0.9, full_from_step=10 ** 6, device=CPU)
    gen = torch.Generator().manual_seed(0)
    p.batch(90, 0, gen, augment)
    p.record(torch.arange(90, dtype=torch.float32))          # most images seen are easy: the next pass is small
    with pytest.raises(RecipeError, match=r"data\.prune=0\.9 .* data\.batch_size=90"):
        p.batch(90, 1, gen, augment)


def _weighted_step(weights):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.GELU(), nn.Flatten(), nn.Linear(8 * 26 * 26, 10)).double()
    recipe = load_recipe("fashion-mnist", ["data.batch_size=16", "averaging.kind=none",
                                           "train.label_smoothing=0.1"])
    step = TrainStep(recipe, Runtime(CPU, "fp32", False, False), model, model, 1, 1, [(28, 28)])
    x = torch.randn(16, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.arange(16) % 10
    _, loss, _, each = step.forward_loss(x, y, 1.0, weights)
    return model, x, y, loss, each


def test_the_step_weighs_each_images_loss_and_returns_it():
    w = torch.linspace(0.5, 2.0, 16, dtype=torch.float64)
    model, x, y, loss, each = _weighted_step(w)
    with torch.no_grad():
        ce = F.cross_entropy(model(x).float(), y, label_smoothing=0.1, reduction="none")
    assert torch.allclose(each, ce) and torch.allclose(loss, (w * ce).mean())
    _, _, _, plain, none = _weighted_step(None)
    assert none is None and torch.allclose(plain, ce.mean())


def test_a_pruned_run_learns_with_the_same_steps_and_records_its_passes(fashion_small, tmp_path):
    speedrun("train", "fashion-mnist", "--data-dir", fashion_small, "--out", tmp_path / "p", *TINY,
             "--set", "train.epochs=16", "--set", "data.prune=0.5")
    s = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert s["test_acc"] > 0.5                                   # chance: 10%
    assert s["steps"] == 64                                      # 16 epochs of 4 steps: pruning changes passes, not steps
    passes = s["pass_images"]
    assert passes[0] == 1024 and min(passes[1:]) < 900           # pruned after the first pass ...
    assert passes[-1] == 1024                                    # ... and every image again at the end


def test_a_pruned_run_resumes_bit_for_bit(fashion_small, tmp_path):
    args = ["train", "fashion-mnist", "--data-dir", str(fashion_small), "--seed", "3", *TINY,
            "--set", "train.epochs=3", "--set", "model.widths=[16,32,32]", "--set", "runtime.precision=fp32",
            "--set", "data.batch_size=32", "--set", "data.prune=0.5", "--set", "checkpoint.every_steps=41"]
    speedrun(*args, "--out", tmp_path / "whole")
    run = tmp_path / "cut"
    state = killed_at_first_checkpoint(args, run)
    assert state["step"] in (41, 82) and state["pruner"]["passes"] >= 2     # inside a pruned pass
    speedrun("train", "--resume", run, "--data-dir", fashion_small)
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(run / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    cut = json.loads((run / "summary.json").read_text())
    assert cut["pass_images"] == whole["pass_images"] and cut["test_acc"] == whole["test_acc"]


@pytest.mark.parametrize("sets, field", [
    (["data.prune=0.3", "augment.mixup=0.2"], "augment.mixup"),
    (["data.prune=1.0"], "data.prune"),
])
def test_bad_prune_settings_name_the_field(sets, field):
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        load_recipe("cifar10-94-cpu", sets)


def test_pruning_a_streamed_folder_is_refused_before_anything_is_written(jpeg32, tmp_path):
    out = tmp_path / "run"
    proc = speedrun("train", "folder", "--data-dir", jpeg32, "--out", out, "--set", "data.prune=0.3", check=False)
    assert proc.returncode != 0 and "data.prune" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
