"""Part 3's training features on real data: accumulation, resume, schedules, progressive
resizing, distillation, mixing, LARS/LAMB and the batch finder."""
import json
import math
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from speedrun.engine.sizes import epoch_image_side
from speedrun.engine.loss import distillation_loss
from speedrun.engine.step import TrainStep
from speedrun.optim.schedule import lr_multipliers
from speedrun.recipe import CosineSchedule, PolySchedule, StepSchedule, load_recipe

from test_cli import speedrun

TINY = ["--set", "data.dataset=npz", "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=256",
        "--set", "eval.tta=none"]
"""fashion-mnist on its 1,024-image slice (--data-dir fashion_small): 4 steps an epoch; 16 epochs
of this tiny net reach about 71% on the 256 test images (LARS 34%, LAMB 53%; chance: 10%)."""


# ---------------------------------------------------------------------------- accumulation
def _no_bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.GELU(), nn.Conv2d(8, 8, 3, stride=2), nn.GELU(),
                         nn.Flatten(), nn.Linear(8 * 12 * 12, 10)).double()


def _one_step(k, x, y):
    """Weights and metrics after one real TrainStep (SGD with Nesterov momentum, label
    smoothing, no averaging) of a batch-norm-free net in float64, in ``k`` micro-batches."""
    from speedrun.engine.runtime import Runtime
    from speedrun.recipe import load_recipe
    model = _no_bn_model()
    recipe = load_recipe("fashion-mnist", [f"train.accumulate={k}", f"data.batch_size={len(x)}",
                                           "averaging.kind=none", "train.label_smoothing=0.1"])
    step = TrainStep(recipe, Runtime(torch.device("cpu"), "fp32", False, False), model, model, 1, 1, [(28, 28)])
    step.reset(0)
    step(x, y)
    return step.metrics[0], [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("n", [64, 62])          # 62 = uneven micro-batches (16, 16, 15, 15)
def test_accumulating_four_micro_batches_equals_one_full_batch(fashion, n):
    x = (fashion.train_x[:n].double() / 255 - 0.29) / 0.35
    y = fashion.train_y[:n]
    (full_loss, full_correct, _), full = _one_step(1, x, y)
    (acc_loss, acc_correct, _), acc = _one_step(4, x, y)
    assert torch.allclose(acc_loss, full_loss, rtol=1e-6) and acc_correct == full_correct
    initial = [p.detach() for p in _no_bn_model().parameters()]
    for a, b, w in zip(acc, full, initial):
        assert (a - b).norm() / (b - w).norm() < 1e-5        # the same step, relative to its size


@pytest.fixture(scope="module")
def accumulated(fashion_small, tmp_path_factory) -> Path:
    """16 epochs of the tiny net in 4 micro-batches a step: its run folder (also the teacher of
    the distillation test below)."""
    out = tmp_path_factory.mktemp("accumulated") / "acc"
    speedrun("train", "fashion-mnist", "--data-dir", fashion_small, "--out", out, *TINY,
             "--set", "train.epochs=16", "--set", "train.accumulate=4")
    return out


def test_training_with_accumulation_learns(accumulated):
    # a speed net has batch norm, so accumulation changes its statistics; the run still learns
    s = json.loads((accumulated / "summary.json").read_text())
    assert s["test_acc"] > 0.5 and s["steps"] == 64


# ------------------------------------------------------------------------------- resume
def killed_at_first_checkpoint(args: list, run) -> dict:
    """Start ``speedrun *args --out run`` as a real process, SIGKILL it once its first checkpoint
    is written, and return that checkpoint (the run must not have finished)."""
    proc = subprocess.Popen([sys.executable, "-m", "speedrun", *args, "--out", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "checkpoint.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)                                  # a real interruption
        proc.wait()
    assert not (run / "summary.json").exists(), "the run finished before it could be interrupted"
    return torch.load(run / "checkpoint.pt", weights_only=True)


# eager: what "auto" is on CPUs without and with bf16; low-resolution windows (augment.low_res =
# crop) drawn per epoch, resumed in the middle of a 20 px epoch
@pytest.mark.slow
@pytest.mark.parametrize("precision, extra", [
    ("fp32", []), ("bf16", []),
    ("fp32", ["augment.translate=2", "augment.low_res=crop", "data.progressive=[[0.0, 0.75], [0.5, 1.0]]"])],
    ids=["fp32", "bf16", "fp32-low-res-windows"])
def test_resume_after_a_kill_equals_the_uninterrupted_run_bit_for_bit(fashion_small, tmp_path, precision, extra):
    # (bf16 on a narrower net for one epoch: on CPUs without native bf16 it is emulated, ~50x slower)
    size = ["train.epochs=2", "model.widths=[32,64,64]"] if precision == "fp32" else ["train.epochs=1",
                                                                                     "model.widths=[8,16,16]"]
    size += extra
    args = ["train", "fashion-mnist", "--data-dir", str(fashion_small), "--seed", "4", *TINY,
            *sum((["--set", s] for s in size), []), "--set", f"runtime.precision={precision}",
            "--set", "data.batch_size=32",
            "--set", "eval.every=1", "--set", "checkpoint.every_steps=7"]          # 32 steps/epoch: mid-epoch
    speedrun(*args, "--out", tmp_path / "whole")
    run = tmp_path / "cut"
    state_step = killed_at_first_checkpoint(args, run)["step"]
    assert state_step % 7 == 0 and state_step < (64 if precision == "fp32" else 32)
    out = speedrun("train", "--resume", run, "--data-dir", fashion_small)
    assert re.search(rf"resumed from step\s*│\s*{state_step}\s*│", out.stdout), out.stdout
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(run / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    cut = json.loads((run / "summary.json").read_text())
    assert cut["test_acc"] == whole["test_acc"] and cut["resumed_from_step"] == state_step
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(l) for l in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["train_loss"], r["lr"], r["test_acc"]) for r in rows] == [(r["train_loss"], r["lr"], r["test_acc"])
                                                                        for r in ref]


def test_resume_needs_a_checkpoint(tmp_path, cli):
    code, err = cli("train", "--resume", tmp_path)
    assert code == 1 and "no checkpoint to resume from" in err


# ---------------------------------------------------------------------------- schedules
def test_warmup_then_cosine_step_and_poly_schedules():
    spe, total = 10, 100
    cos = lr_multipliers(CosineSchedule(warmup_epochs=2, warmup_start=0.1), total, spe)
    assert cos[0] == pytest.approx(0.1) and cos[10] == pytest.approx(0.1 + 0.9 * 0.5)
    assert cos[20] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 79 / 80)))
    step = lr_multipliers(StepSchedule(milestones=[3, 6], gamma=0.1), total, spe)
    assert step[29] == 1.0 and step[30] == pytest.approx(0.1) and step[60] == pytest.approx(0.01)
    poly = lr_multipliers(PolySchedule(warmup_epochs=1, power=2.0), total, spe)
    assert poly[5] == pytest.approx(0.5) and poly[10] == 1.0 and poly[-1] == pytest.approx((1 / 90) ** 2)


def test_linear_scaling_rule_from_the_reference_batch():
    from speedrun.optim.params import step_lr
    r = load_recipe("imagenet-resnet50")
    assert step_lr(r.optim, 256) == pytest.approx(0.1)                  # the 0.1-per-256 rule
    assert step_lr(r.optim, 1024) == pytest.approx(0.4)


# --------------------------------------------------------------------- progressive resizing
def test_progressive_resizing_sizes_and_batches(data_dir, tmp_path):
    r = load_recipe("fashion-mnist", ["data.progressive=[[0.0, 0.5], [0.5, 1.0]]", "train.epochs=2"])
    assert [epoch_image_side(r, e, 28) for e in (0, 1)] == [16, 28]
    r3 = load_recipe("cifar10-94", ["data.progressive=[[0.0, 0.75], [0.4, 0.875], [0.7, 1.0]]", "train.epochs=10"])
    assert [epoch_image_side(r3, e, 32) for e in range(10)] == [24] * 4 + [28] * 3 + [32] * 3   # 4 px steps under 64 px
    assert [epoch_image_side(r3, e, 224) for e in (0, 4, 9)] == [168, 192, 224]                # 8 px steps above
    from speedrun.data import load_dataset
    from speedrun.engine.loop import Session
    from speedrun.engine.runtime import Runtime
    ds = load_dataset("fashion-mnist", data_dir)
    r = load_recipe("fashion-mnist", ["data.progressive=[[0.0, 0.5], [0.5, 1.0]]", "train.epochs=0.1",
                                      "model.widths=[8,8,8]", "data.batch_size=1000"])
    session = Session(r, ds, Runtime(torch.device("cpu"), "fp32", False, True))
    seen = []
    session.model.register_forward_pre_hook(lambda m, a: seen.append((m.training, a[0].shape[-1])))
    session.run()
    assert {s for t, s in seen if t} == {16} and {s for t, s in seen if not t} == {28}


def test_low_res_crop_cuts_windows_at_the_test_scale():
    """augment.low_res = crop: a smaller progressive batch is a random window of the translated
    image (pixels unchanged), every offset of the padded image reachable; at the full size the
    translation alone."""
    from speedrun.data.augment.batch import BatchAugment, reflect_pad
    from speedrun.recipe import AugmentConfig
    n, t = 4000, 2
    x = torch.arange(n * 32 * 32, dtype=torch.float32).reshape(n, 1, 32, 32)
    padded = reflect_pad(x, t)
    cfg = AugmentConfig(flip="none", translate=t, low_res="crop")
    aug = BatchAugment(cfg, n, (32, 32), torch.Generator().manual_seed(0), torch.device("cpu"))
    r = aug.draw(0)
    idx = torch.arange(n)
    out = aug(padded, idx, r, 24)
    assert out.shape == (n, 1, 24, 24)
    for i in range(0, n, 10):
        top, left = int(r["win_y"][i] * 13), int(r["win_x"][i] * 13)     # 36 - 24 + 1 places
        assert torch.equal(out[i], padded[i, :, top:top + 24, left:left + 24])
    spots = set(zip((r["win_y"] * 13).long().tolist(), (r["win_x"] * 13).long().tolist()))
    assert len(spots) == 13 * 13                       # every place is reached
    full = aug(padded[:8], idx[:8], r, None)                 # the full size: the translation alone
    assert full.shape[-1] == 32 and torch.equal(full[0], padded[0, :, r["top"][0]:r["top"][0] + 32,
                                                                 r["left"][0]:r["left"][0] + 32])
    with pytest.raises(ValueError, match="augment.crop = translate"):
        AugmentConfig(crop="random_resized", low_res="crop")
    with pytest.raises(Exception, match="augment.low_res"):
        load_recipe("imagenette", ["augment.crop=translate", "augment.low_res=crop"])


def test_low_res_crop_trains_and_learns(fashion_small, tmp_path):
    """A progressive run with windows instead of resized images, end to end through the CLI."""
    speedrun("train", "fashion-mnist", "--data-dir", fashion_small, "--out", tmp_path / "run", *TINY,
             "--set", "train.epochs=16", "--set", "augment.low_res=crop", "--set", "augment.translate=2",
             "--set", "data.progressive=[[0.0, 0.75], [0.5, 1.0]]")
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["test_acc"] > 0.4                           # chance: 10%


# ------------------------------------------------------------------------- distillation
def test_distillation_loss_is_temperature_scaled_kl():
    s, t = torch.randn(5, 4), torch.randn(5, 4)
    T = 3.0
    p_t = F.softmax(t / T, 1)
    expected = (p_t * (p_t.log() - F.log_softmax(s / T, 1))).sum(1).mean() * T * T
    assert distillation_loss(s, t, T) == pytest.approx(expected.item(), rel=1e-5)
    assert distillation_loss(t, t, T) == pytest.approx(0.0, abs=1e-6)


def test_distill_from_a_teacher_checkpoint(fashion_small, tmp_path, accumulated, cli):
    # the teacher: the accumulated run above (its config.toml beside its weights says how to build it)
    speedrun("train", "fashion-mnist", "--data-dir", fashion_small, "--out", tmp_path / "student", *TINY,
             "--set", "train.epochs=16", "--set", f"distill.teacher={accumulated / 'model.pt'}",
             "--set", "model.widths=[8,8,8]")
    s = json.loads((tmp_path / "student" / "summary.json").read_text())
    assert s["test_acc"] > 0.4                            # a smaller net than its teacher
    code, err = cli("train", "fashion-mnist", "--data-dir", fashion_small, "--out", tmp_path / "x", *TINY,
                    "--set", f"distill.teacher={tmp_path / 'missing.pt'}")
    assert code == 1 and "distill.teacher" in err


# ---------------------------------------------------------- mixing, LARS, LAMB end to end
@pytest.mark.parametrize("extra", [
    ["--set", "augment.mixup=0.2", "--set", "augment.cutmix=1.0"],
    ["--set", "optim.name=lars", "--set", "optim.lr=20.0", "--set", "optim.weight_decay=5e-5"],
    ["--set", "optim.name=lamb", "--set", "optim.lr=0.02", "--set", "optim.weight_decay=0.01"],
    ["--set", "augment.crop=random_resized", "--set", "augment.rrc_scale=[0.5, 1.0]",
     "--set", "augment.color_jitter=0.3"],
])
def test_training_options_run_and_learn(fashion_small, tmp_path, extra):
    speedrun("train", "fashion-mnist", "--data-dir", fashion_small, "--out", tmp_path / "r", *TINY,
             "--set", "train.epochs=16", *extra)
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["test_acc"] > 0.25, s["test_acc"]


# --------------------------------------------------------------------------- batch finder
def test_the_batch_is_settled_before_the_session_which_never_changes_its_recipe(data_dir):
    from speedrun.data import load_dataset
    from speedrun.engine.loop import Session
    from speedrun.engine.plan import fit_batch_to_device
    from speedrun.engine.runtime import Runtime
    ds = load_dataset("fashion-mnist", data_dir)
    rt = Runtime(torch.device("cpu"), "fp32", False, True)
    plain = load_recipe("fashion-mnist", ["model.widths=[8,8,8]", "data.batch_size=512"])
    assert fit_batch_to_device(plain, ds, rt) is plain                              # no probe without find_batch
    said = []
    finding = load_recipe("fashion-mnist", ["model.widths=[8,8,8]", "data.batch_size=512", "runtime.find_batch=true"])
    settled = fit_batch_to_device(finding, ds, rt, said.append)
    assert settled == finding and said == []                           # 512 fits: nothing to change or say
    session = Session(settled, ds, rt)
    assert session.recipe is settled and session.local_batch == 512


@pytest.mark.slow
def test_batch_finder_halves_on_a_real_out_of_memory(cifar_small, tmp_path):
    """Run with an address-space limit so that the large batch really fails to allocate: a
    training step of the cifar10-94 net with fp32 batch norm takes about 1.7 MB per image, so
    1,024 images do not fit in 1.2 GiB; 512 or 256 do (the run's other allocations decide which).
    (With bf16 batch norm, the CPU default since, 1,024 images fitted in one thread.)"""
    code = f"""
import resource, sys
from speedrun.cli import main
import torch
base = int(open('/proc/self/statm').read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (base + int(1.2 * 2**30), resource.RLIM_INFINITY))
sys.exit(main(["train", "cifar10-94", "--data-dir", {str(cifar_small)!r}, "--set", "data.dataset=npz",
               "--out", {str(tmp_path / 'fb')!r}, "--find-batch", "--set", "data.batch_size=1024",
               "--set", "train.epochs=0.5", "--set", "eval.tta=none", "--set", "eval.batch_size=256",
               "--set", "model.norm.fp32=true"]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data.batch_size=1024 ran out of memory on cpu; using 512" in proc.stdout
    s = json.loads((tmp_path / "fb" / "summary.json").read_text())
    assert s["batch_size"] in (256, 512) and s["steps"] == 512 // s["batch_size"]       # half an epoch
    config = (tmp_path / "fb" / "config.toml").read_text()
    assert f"batch_size = {s['batch_size']}" in config
