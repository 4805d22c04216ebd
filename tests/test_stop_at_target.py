"""train.stop_at_target: a run stops once the recipe's target is reached on a validation split
held out of the training images (data.holdout), never decided on the test set; on the
1,024-image Fashion-MNIST slice and its JPEG folder."""
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speedrun.data.pipeline.dataset import open_source
from speedrun.data.pipeline.resident import ResidentData
from speedrun.data.sources.folder import folder_splits
from speedrun.engine import checkpoint as ckpt
from speedrun.engine.loop import NullProgress, Session
from speedrun.engine.plan import plan_run
from speedrun.recipe import RecipeError, load_recipe

from small_data import speedrun
from test_distributed import ok, run, torchrun_cmd

CPU = torch.device("cpu")
TINY = ["data.dataset=npz", "model.widths=[8,16,16]", "data.batch_size=64", "train.epochs=8", "optim.lr=20",
        "eval.every=0", "runtime.precision=fp32", "train.stop_at_target=true", "data.holdout=0.25"]
"""768 of the slice's 1,024 training images trained, 256 held out: 12 steps an epoch, 96 planned;
the validation accuracy climbs past 40% within a few epochs (about 22%, 38%, 46%, 47%, 58% on
a 2-core AMD EPYC)."""
PLANNED = 96
REACHABLE = 0.42
"""Reached after a few epochs of the eight."""


def _recipe(*extra):
    return load_recipe("fashion-mnist", [*TINY, *extra])


def _session(recipe, path):
    plan = plan_run(recipe, path, CPU)
    return Session(plan.recipe, plan.source, plan.runtime)


def _checked_epochs(history, target):
    """The epochs' validation accuracies, checked: each below ``target`` but the last."""
    held = [h.holdout_acc for h in history]
    assert all(a is not None and a < target for a in held[:-1]) and held[-1] >= target, held
    return held


def test_a_reachable_target_stops_the_run_early_says_so_and_records_where(fashion_small, tmp_path, cli):
    out = tmp_path / "run"
    proc = speedrun("train", "fashion-mnist", "--data-dir", fashion_small, "--out", out,
                    *(a for s in TINY for a in ("--set", s)), "--set", f"target={REACHABLE}")
    said = proc.stdout
    assert ("stopping at the target 42.00% on a validation split of 256 training images held out (data.holdout=0.25"
            in said), said
    s = json.loads((out / "summary.json").read_text())
    stop = s["stop_at_target"]
    reached = stop["reached"]
    assert reached is not None and 1 <= reached["epoch"] < 8
    assert (f"target 42.00% reached on the validation split at epoch {reached['epoch']} (step {reached['step']}, "
            in said) and "; stopping" in said
    # trained fewer steps than planned, up to the end of the epoch it was reached in
    assert reached["step"] == s["steps"] == 12 * reached["epoch"] < PLANNED and s["epochs"] == reached["epoch"]
    assert reached["holdout_acc"] >= REACHABLE and 0 < reached["seconds"] <= s["train_seconds"]
    # a check after each epoch, on the 256 held-out images, its cost inside the run's time
    assert stop["holdout_images"] == stop["images_per_check"] == 256 and stop["checks"] == reached["epoch"]
    assert 0 < stop["check_seconds"] < s["train_seconds"] and stop["check_every_epochs"] == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, reached["epoch"] + 1))
    assert all(r["holdout_acc"] < REACHABLE for r in rows[:-1]) and rows[-1]["holdout_acc"] == reached["holdout_acc"]
    # the final evaluation on the test set, as usual
    assert 0.2 < s["test_acc"] <= 1 and s["test_images"] == 256 and rows[-1]["test_acc"] == s["test_acc_no_tta"]
    # and the run's report says it
    assert cli("report", out)[0] == 0
    report = (out / "report.md").read_text()
    assert f"on the validation split at epoch {reached['epoch']}, step {reached['step']}" in report
    assert "validation acc" in report


def _scrambled(path, tmp_path):
    """The slice with every test label wrong (each moved to the next class)."""
    with np.load(path) as z:
        arrays = dict(z)
    arrays["y_test"] = (arrays["y_test"] + 1) % 10
    out = tmp_path / "scrambled.npz"
    np.savez(out, **arrays)
    return out


class Events(NullProgress):
    """The run's progress as events, in order (to place the test set's reads among them)."""

    def __init__(self, events):
        self.events = events

    def epoch(self, record):
        self.events.append("epoch")

    def final_evaluation(self, images, tta):
        self.events.append("final evaluation")


def test_the_stop_is_decided_on_the_validation_split_and_never_reads_the_test_set(fashion_small, tmp_path):
    # the test set's labels, all wrong, read by a monitoring evaluation after each epoch: the same stop
    monitored = ["eval.every=1", f"target={REACHABLE}"]
    true = _session(_recipe(*monitored), fashion_small).run()
    wrong = _session(_recipe(*monitored), _scrambled(fashion_small, tmp_path)).run()
    where = lambda result: {k: v for k, v in result.target_stop.reached.items() if k != "seconds"}
    assert where(true) == where(wrong)
    assert [h.holdout_acc for h in true.history] == [h.holdout_acc for h in wrong.history]
    _checked_epochs(wrong.history, REACHABLE)
    assert all(torch.equal(true.state_dict[k], wrong.state_dict[k]) for k in true.state_dict)
    assert true.test_acc > 0.3 > wrong.test_acc                 # (the wrong labels are read, by the evaluations)
    assert [h.test_acc for h in true.history] != [h.test_acc for h in wrong.history]

    # without monitoring evaluations the test set is first read by the final evaluation, after the stop
    events = []
    test_reads, held_reads = ResidentData.test_batches.__code__, ResidentData.holdout_batches.__code__

    def probe(frame, event, arg):                               # (a generator's every resume is a call)
        if event == "call" and frame.f_code in (test_reads, held_reads):
            events.append("test read" if frame.f_code is test_reads else "holdout read")
    session = _session(_recipe(f"target={REACHABLE}"), fashion_small)
    sys.setprofile(probe)
    try:
        result = session.run(progress=Events(events))
    finally:
        sys.setprofile(None)
    final = events.index("final evaluation")
    assert "test read" not in events[:final] and "test read" in events[final:]
    assert "holdout read" in events[:final] and "holdout read" not in events[final:]
    assert where(result) == where(true)


def test_the_held_out_images_are_never_trained_on_and_a_resumed_run_holds_out_the_same(fashion_small, tmp_path):
    recipe = _recipe(f"target={REACHABLE}", "checkpoint.every_steps=5")
    _, whole = open_source(load_recipe("fashion-mnist", ["data.dataset=npz"]), fashion_small)
    _, source = open_source(recipe, fashion_small)
    held = source.holdout_index
    # a quarter of each class held out, chosen by data.split_seed; the training set is the rest
    assert len(held) == 256 and len(source.train_y) == 768
    for c in range(10):
        assert (whole.train_y[held] == c).sum() == round((whole.train_y == c).sum().item() * 0.25)
    assert torch.equal(source.holdout_x, whole.train_x[held]) and torch.equal(source.holdout_y, whole.train_y[held])
    kept = sorted(set(range(1024)) - set(held.tolist()))
    assert torch.equal(source.train_x, whole.train_x[kept]) and torch.equal(source.train_y, whole.train_y[kept])
    other = open_source(_recipe("data.split_seed=1"), fashion_small)[1].holdout_index
    assert not torch.equal(other, held)
    # what a run trains on: the kept images, 12 steps an epoch
    runtime = plan_run(recipe, fashion_small, CPU).runtime
    data = ResidentData(source, CPU, torch.float32, torch.contiguous_format)
    assert torch.equal(data.train, source.train_x) and torch.equal(data.holdout, source.holdout_x)
    session = Session(recipe, source, runtime)
    assert session.steps_per_epoch == 12 and session.total_steps == PLANNED

    whole_run = session.run(checkpoint_dir=tmp_path)
    reached = whole_run.target_stop.reached
    state = ckpt.load(tmp_path)                       # the last checkpoint, in the epoch the target was reached
    assert state["step"] <= reached["step"] and state["target_checks"]["checks"] == (state["step"] - 1) // 12
    _, reopened = open_source(recipe, fashion_small)
    assert torch.equal(reopened.holdout_index, held)
    resumed = Session(recipe, reopened, runtime).run(resume=state)
    assert resumed.target_stop.reached["epoch"] == reached["epoch"]
    assert resumed.target_stop.reached["step"] == reached["step"]
    assert resumed.target_stop.reached["holdout_acc"] == reached["holdout_acc"]
    assert resumed.target_stop.checks == whole_run.target_stop.checks
    assert all(torch.equal(whole_run.state_dict[k], resumed.state_dict[k]) for k in whole_run.state_dict)


def test_checks_every_few_epochs_and_none_after_the_last(fashion_small):
    result = _session(_recipe("target=1.0", "train.stop_check_every=3"), fashion_small).run()
    assert result.steps == PLANNED and result.target_stop.reached is None and result.target_stop.checks == 2
    assert [h.epoch for h in result.history if h.holdout_acc is not None] == [3, 6]


def test_an_unreachable_target_runs_the_whole_schedule_on_a_streamed_folder(fashion_jpeg, tmp_path):
    recipe = load_recipe("fashion-mnist", ["data.dataset=folder", "data.cache=off", "data.workers=0",
                                           "model.widths=[8,16,16]", "data.batch_size=64", "train.epochs=3",
                                           "eval.every=0", "runtime.precision=fp32", "train.stop_at_target=true",
                                           "target=1.0"])
    plan = plan_run(recipe, fashion_jpeg, CPU)
    train, _ = folder_splits(fashion_jpeg, 0.0, 0)
    held = set(plan.source.holdout.files)
    assert len(held) == 51 and not held & set(plan.source.train.files)          # 10% of 512, per class
    assert held | set(plan.source.train.files) == set(train.files)
    session = Session(plan.recipe, plan.source, plan.runtime)
    result = session.run()
    assert result.steps == session.total_steps == 3 * (461 // 64)
    stop = result.target_stop
    assert stop.reached is None and stop.checks == 2 and stop.holdout_images == 51 and stop.seconds > 0
    assert [h.holdout_acc is not None for h in result.history] == [True, True, False]    # (none after the last)

    # decoded once into the cache instead (stored larger than evaluated): the same images held out
    cached = plan_run(recipe.with_values({"data.cache": "on", "data.cache_size": 40,
                                          "data.cache_dir": str(tmp_path)}), fashion_jpeg, CPU).source
    assert sorted(train.files[i] for i in cached.holdout_index.tolist()) == sorted(held)
    assert tuple(cached.holdout_x.shape[2:]) == cached.eval_size == (32, 32)


@pytest.mark.parametrize("sets, named", [
    (["data.holdout=0.2"], "data.holdout = 0.2 does nothing with train.stop_at_target = False"),
    (["train.stop_check_every=2"], "train.stop_check_every = 2 does nothing with train.stop_at_target = False"),
    (["train.stop_at_target=true", "data.holdout=0.6"], "data.holdout"),
    (["train.stop_at_target=true", "data.holdout=0"], "data.holdout"),
    (["train.stop_at_target=true", "train.stop_check_every=0"], "train.stop_check_every"),
])
def test_bad_settings_are_refused_naming_the_field(sets, named):
    with pytest.raises(RecipeError) as err:
        load_recipe("fashion-mnist", sets)
    assert named in str(err.value)
    assert load_recipe("fashion-mnist", ["train.stop_at_target=true", "data.holdout=0.5"]).data.holdout == 0.5


def test_a_refused_holdout_ends_in_one_line(cli, tmp_path):
    rc, err = cli("train", "fashion-mnist", "--set", "data.holdout=0.2", "--out", tmp_path / "run")
    assert rc == 2 and err.startswith("speedrun: error: ") and err.count("\n") == 1
    assert "data.holdout" in err and "train.stop_at_target" in err and not (tmp_path / "run").exists()


def test_data_with_no_image_to_spare_for_the_split_is_refused_saying_how_many_it_has(fashion_small, fashion_jpeg,
                                                                                      tmp_path, cli):
    """A class gives the split at least one image when it has two or more, none when it has one:
    data with one training image per class is refused when it is opened, before a cache is made or
    a step trained, and leaves nothing behind."""
    from test_failures import assert_unchanged, check_refused, snapshot
    with np.load(fashion_small) as full:
        first = [int(np.flatnonzero(full["y_train"] == c)[0]) for c in range(10)]
        np.savez(tmp_path / "one-each.npz", x_train=full["x_train"][first], y_train=full["y_train"][first],
                 x_test=full["x_test"], y_test=full["y_test"], classes=full["classes"])
    folder = tmp_path / "two-classes"
    for cls in ("Bag", "Coat"):
        for split, n in (("train", 1), ("val", 3)):
            (folder / split / cls).mkdir(parents=True)
            for f in sorted((fashion_jpeg / split / cls).iterdir())[:n]:
                (folder / split / cls / f.name).write_bytes(f.read_bytes())
    rule = ("train.stop_at_target checks the target on a validation split held out of the training images "
            "(data.holdout=0.1 of each class, at least one image of a class with two or more), and ")
    advice = ("none with more than one, so none can be held out: give it more training images (a class needs two or "
              "more for one to be held out), or drop train.stop_at_target")
    sets = ["--set", "train.stop_at_target=true", "--set", "data.batch_size=2", "--out", tmp_path / "run"]
    before = snapshot(tmp_path)
    proc = speedrun("train", "fashion-mnist", "--set", "data.dataset=npz", "--data-dir", tmp_path / "one-each.npz",
                    *sets, check=False)
    check_refused(proc, 2, f"speedrun: error: {rule}{tmp_path / 'one-each.npz'} has 10 training images in 10 classes, "
                  f"{advice}\n")
    assert "stopping at the target" not in proc.stdout and "open_source" not in proc.stderr
    for cache in ("off", "on"):                  # streamed, or decoded into a cache first
        check_refused(cli("train", "fashion-mnist", "--set", "data.dataset=folder", "--data-dir", folder, "--set",
                          f"data.cache={cache}", "--set", f"data.cache_dir={tmp_path / 'cache'}", *sets), 2,
                      f"{rule}{folder} has 2 training images in 2 classes, {advice}")
    assert_unchanged(tmp_path, before)


def test_a_session_given_data_opened_without_the_split_says_how_to_open_it(fashion_small):
    plan = plan_run(load_recipe("fashion-mnist", TINY[:-2]), fashion_small, CPU)         # no stop_at_target
    with pytest.raises(RecipeError) as err:
        Session(plan.recipe.with_values({"train.stop_at_target": True}), plan.source, plan.runtime)
    assert str(err.value) == ("train.stop_at_target checks the target on a validation split held out of the training "
                              "images, and the data given to this run holds none out: open the data with "
                              "train.stop_at_target on in its recipe, which holds out data.holdout of each class")


def test_bench_runs_stop_at_the_target_and_record_it(fashion_small, tmp_path, cli):
    rc, err = cli("bench", "fashion-mnist", "--runs", 2, "--data-dir", fashion_small, "--out", tmp_path / "b",
                  *(a for s in TINY for a in ("--set", s)), "--set", f"target={REACHABLE}")
    assert rc == 0, err
    record = json.loads((tmp_path / "b" / "bench.json").read_text())
    for record_run in record["runs"]:
        stop = record_run["stop_at_target"]
        assert stop["holdout_images"] == 256 and stop["reached"]["step"] == record_run["steps"] < PLANNED
        assert stop["checks"] == stop["reached"]["epoch"] == len(record_run["history"])
        _checked_epochs([SimpleNamespace(**h) for h in record_run["history"]], REACHABLE)


def test_every_process_of_a_data_parallel_run_stops_at_the_same_epoch(fashion_small, tmp_path):
    """Each rank checks its share of the validation split and the counts are summed, so every
    rank decides alike: a rank that stopped alone would leave the others waiting in the next
    step's gradient exchange until distributed.timeout_s ended the job in an error."""
    out = tmp_path / "two"
    proc = run(torchrun_cmd("fashion-mnist", "--data-dir", fashion_small, "--out", out,
                            *(a for s in TINY for a in ("--set", s)), "--set", f"target={REACHABLE}",
                            "--set", "distributed.timeout_s=30"), timeout=240)
    said = ok(proc)
    stop = json.loads((out / "summary.json").read_text())["stop_at_target"]
    assert stop["reached"] is not None and stop["reached"]["step"] == 12 * stop["reached"]["epoch"] < PLANNED
    assert stop["holdout_images"] == 256 and "reached on the validation split" in said
