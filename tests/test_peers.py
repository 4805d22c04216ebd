"""The peers of benchmarks/peers.py run speedrun's cifar10-94 algorithm, so that the benchmark
compares engines, not algorithms: on real CIFAR-10 images, in fp32 eager, the plain loop's
steps give the weights of speedrun's own ``TrainStep`` fed the same batches (schedule,
parameter groups, decoupled decay, whitening-bias freeze and lookahead averaging included),
and the Lightning module's steps give the plain loop's; the data preparation, augmentation
and TTA match speedrun's functions; and the plain peer, end to end, learns.

Narrow nets (the algorithm does not depend on the widths), batch 256, 2,048 training images."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers  # noqa: E402
from peer_algorithm import (Algorithm, Normalise, TrainBatches, first_touch, lightning_module,  # noqa: E402
                            make_optimizer, make_trainer, peer_model, random_translate, tta_logits, train_plain)
from speedrun.data.augment.batch import crop, reflect_pad  # noqa: E402
from speedrun.data.pipeline.resident import ResidentData  # noqa: E402
from speedrun.engine.evaluate import tta_logits as speedrun_tta_logits  # noqa: E402
from speedrun.engine.loop import Session  # noqa: E402
from speedrun.engine.runtime import Runtime  # noqa: E402
from speedrun.recipe import load_recipe  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
"""The kept records, among them the peers' of several rounds."""

CPU = torch.device("cpu")
NARROW = ["model.widths=[16,32,32]", "data.batch_size=256"]
# 8 steps per epoch: 10 steps over two epochs, the whitening bias frozen from step 5 on,
# lookahead averages after steps 5 and 10 (the last), so the final weights hold every step
STEPS = ["train.epochs=1.25", "model.whiten.train_bias_epochs=0.5"]
TOLERANCE = 1e-5


def require_lightning():
    try:
        import lightning  # noqa: F401
    except ImportError as err:
        pytest.fail(f"lightning is not importable ({err}): the Lightning peer of benchmarks/peers.py is untested; "
                    "install it (it belongs in the test extras)")


@pytest.fixture(scope="module")
def cifar_slice(cifar10):
    return dataclasses.replace(cifar10, train_x=cifar10.train_x[:2048], train_y=cifar10.train_y[:2048],
                               test_x=cifar10.test_x[:1000], test_y=cifar10.test_y[:1000])


def worst_relative_error(a: dict, b: dict) -> tuple[float, str]:
    """The largest ||a - b|| / ||b|| over the floating-point tensors of two state dicts (the
    integer ones must be equal), and the name of that tensor."""
    assert a.keys() == b.keys()
    worst, where = 0.0, ""
    for k in a:
        if not a[k].is_floating_point():
            assert torch.equal(a[k], b[k]), k
            continue
        err = float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30))
        if err > worst:
            worst, where = err, k
    return worst, where


def train_speedrun_steps(step, batches, total: int) -> None:
    """``total`` calls of speedrun's TrainStep on the passes of ``batches``."""
    done = 0
    while done < total:
        for x, y in batches:
            step(x, y)
            done += 1
            if done == total:
                break


def test_plain_steps_give_the_weights_of_speedruns_train_step(cifar_slice):
    recipe = load_recipe("cifar10-94", NARROW + STEPS)
    algo = Algorithm.from_recipe(recipe, 2048)
    assert (algo.total_steps, algo.epochs, algo.whiten_steps, algo.lookahead[0]) == (10, 2, 4, 5)
    session = Session(recipe, cifar_slice, Runtime(CPU, "fp32", False, True))   # eager fp32, channels_last
    step = session.step
    plain = peer_model(recipe, recipe.train.seed)
    assert worst_relative_error(plain.state_dict(), session.model.state_dict())[0] == 0    # same start

    # the same data preparation: normalisation statistics and the whitening fit
    normalise, batches = first_touch(plain, cifar_slice, algo)
    resident = ResidentData(cifar_slice, CPU, torch.float32, torch.channels_last)
    torch.testing.assert_close(normalise.mean.flatten(), resident.mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(normalise.std.flatten(), resident.std, rtol=1e-6, atol=0)
    session.model.whiten.fit(resident.whitening_sample(recipe.model.whiten.samples))
    for a, b in zip(plain.whiten.state_dict().values(), session.model.whiten.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=1e-6)     # (the bias is near 0: absolute too)
    session.model.whiten.load_state_dict(plain.whiten.state_dict())      # from here, the very same start
    step.reset(recipe.train.seed)                                         # (the average starts here too)

    # the same parameter groups, LR of every step and decoupled decay
    opt, schedule = make_optimizer(plain, algo)
    names = {id(p): n for n, p in plain.named_parameters()}
    theirs = {id(p): n for n, p in session.model.named_parameters()}
    roles = {"weights": "weight", "norm_biases": "norm_bias", "whiten_bias": "whiten_bias"}
    assert len(opt.param_groups) == len(step.opt.param_groups) == 3
    for role, group, base_lr, lam in zip(roles, opt.param_groups, schedule.base_lrs, schedule.lr_lambdas):
        their = next(g for g in step.opt.param_groups if g["name"] == roles[role])
        assert {names[id(p)] for p in group["params"]} == {theirs[id(p)] for p in their["params"]}
        frozen_from = algo.whiten_steps if role == "whiten_bias" else algo.total_steps
        expected = [their["base_lr"] * m * (t < frozen_from) for t, m in enumerate(step.schedule.lrs)]
        assert [base_lr * lam(t) for t in range(algo.total_steps)] == pytest.approx(expected, rel=1e-12)
        assert base_lr * group["weight_decay"] == pytest.approx(their["base_lr"] * their["weight_decay"], rel=1e-12)
        assert (group["momentum"], group["nesterov"]) == (0.85, True)

    # ten steps on the same batches: 2 epochs of real, augmented CIFAR-10 batches
    replay = TrainBatches(cifar_slice.train_x, cifar_slice.train_y, normalise, algo.batch_size, algo.translate,
                          algo.flip, algo.seed)                           # the same seed: the same batches
    train_speedrun_steps(step, replay, algo.total_steps)
    step.averager.finalize()
    train_plain(plain, algo, (opt, schedule), batches, "fp32")
    worst, where = worst_relative_error(plain.state_dict(), session.model.state_dict())
    assert worst < TOLERANCE, f"{where}: relative error {worst:.2e}"
    start = peer_model(recipe, recipe.train.seed).head.weight
    assert (plain.head.weight - start).norm() > 0.01 * start.norm()      # (and the steps did train)


def test_lightning_steps_give_the_plain_loops_weights(cifar_slice):
    require_lightning()
    recipe = load_recipe("cifar10-94", NARROW + STEPS)
    algo = Algorithm.from_recipe(recipe, 2048)
    models = {}
    for name in ("plain", "lightning"):
        model = peer_model(recipe, recipe.train.seed)
        _, batches = first_touch(model, cifar_slice, algo)
        if name == "plain":
            train_plain(model, algo, make_optimizer(model, algo), batches, "fp32")
        else:
            trainer, module = make_trainer(algo, "fp32"), lightning_module(model, algo)
            trainer.fit(module, train_dataloaders=batches)
            assert trainer.global_step == module.steps_done == algo.total_steps
        models[name] = model
    worst, where = worst_relative_error(models["lightning"].state_dict(), models["plain"].state_dict())
    assert worst < TOLERANCE, f"{where}: relative error {worst:.2e}"


def test_augmentation_and_tta_match_speedruns(cifar_slice):
    images = Normalise(cifar_slice.train_x[:64])(cifar_slice.train_x[:64])
    gen = torch.Generator().manual_seed(1)
    ours = random_translate(images, 2, gen)
    gen.manual_seed(1)                                     # the same offsets: dy first, then dx
    top, left = torch.randint(0, 5, (64,), generator=gen), torch.randint(0, 5, (64,), generator=gen)
    assert torch.equal(ours, crop(reflect_pad(images, 2), top, left, (32, 32)))
    assert ours.is_contiguous(memory_format=torch.channels_last)

    recipe = load_recipe("cifar10-94", NARROW)
    model = peer_model(recipe, 0).eval()
    x = images.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for tta in ("none", "flip", "flip_translate"):
            for a, b in zip(tta_logits(model, x, tta), speedrun_tta_logits(model, x, tta, torch.channels_last)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_alternating_flip_mirrors_each_image_every_other_epoch():
    n = 64
    images = torch.zeros(n, 3, 32, 32, dtype=torch.uint8)
    images[:, :, :, :16] = torch.arange(1, n + 1, dtype=torch.uint8)[:, None, None, None]   # a left half to tell
    images[:, :, :, 16:] = 200                                                              # mirrored apart
    batches = TrainBatches(images, torch.arange(n), Normalise(images), 16, 0, "alternating", seed=3)
    mirrored = []
    for _ in range(4):
        seen = torch.zeros(n, dtype=torch.bool)
        for x, ids in batches:
            plain = batches.normalise(images[ids])
            is_mirror = (x == plain.flip(3)).flatten(1).all(1)
            assert (is_mirror | (x == plain).flatten(1).all(1)).all()
            seen[ids] = is_mirror
        mirrored.append(seen)
    assert 16 < int(mirrored[0].sum()) < 48                                 # a random start
    assert torch.equal(mirrored[1], ~mirrored[0]) and torch.equal(mirrored[2], mirrored[0])
    assert torch.equal(mirrored[3], mirrored[1])


def test_the_peers_learn_end_to_end(cifar_slice):
    """The benchmark's own path (statistics, whitening, batches, training with monitoring
    evaluations, the final TTA accuracy) on a small slice: both peers beat chance (10%) by more
    than three standard errors, and in fp32 they agree."""
    require_lightning()
    recipe = load_recipe("cifar10-94", NARROW + ["train.epochs=3"])
    results = {name: peers.run_peer(name, recipe, cifar_slice, "fp32") for name in ("plain", "lightning")}
    n = len(cifar_slice.test_y)
    chance = 0.1 + 3 * math.sqrt(0.1 * 0.9 / n)
    for name, r in results.items():
        assert r["steps"] == 24 and len(r["epoch_seconds"]) == 3 and len(r["monitor_test_acc"]) == 2, name
        assert r["test_acc"] > chance and r["test_acc_no_tta"] > chance, (name, r["test_acc"], chance)
        assert 0 < r["final_eval_seconds"] < r["train_seconds"]
    assert results["lightning"]["test_acc"] == pytest.approx(results["plain"]["test_acc"], abs=0.005)


def test_the_rounds_rotate_and_their_summary_is_the_medians_the_kept_records_hold():
    """Every kept record of several rounds: each round's order is the first rotated, and the
    medians and comparisons ``round_summary`` computes from its rounds are the record's own."""
    records = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("peers-*-rounds-*.json"))]
    assert len(records) >= 4
    for record in records:
        rounds = record["rounds"]
        assert [r["order"] for r in rounds] == [peers.round_order(rounds[0]["order"], i) for i in range(len(rounds))]
        again, kept = peers.round_summary(rounds, record["epochs"]), record["summary"]
        assert again["runs"] == kept["runs"]
        for name, medians in kept["medians"].items():
            assert again["medians"][name] == pytest.approx(medians)
        for key in ("fastest_peer_per_epoch", "fastest_peer_final_eval"):
            assert again[key] == kept[key]


def test_a_bad_peer_list_or_an_existing_record_is_refused_in_one_line_writing_nothing(tmp_path):
    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    for args, says in ((["--peers", "plain,plain"], "each once"), (["--rounds", "0"], "--rounds 1 or more"),
                       ([], "already exists"), (["--set", "augment.mixup=0.2"], "do not implement")):
        with pytest.raises(SystemExit) as stop:
            peers.main(["--epochs", "1", "--out", str(kept), *args])
        assert says in str(stop.value) and str(stop.value).startswith("peers:")
    assert kept.read_text() == "{}" and sorted(tmp_path.iterdir()) == [kept]
