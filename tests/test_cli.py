"""End to end: the real command, real data, real files."""
import json
import re
import subprocess
import sys
import tomllib

import pytest
import torch

from speedrun.models import build_model
from speedrun.recipe import load_recipe

from small_data import speedrun

QUICK = ["--set", "train.epochs=0.25", "--set", "model.widths=[16,32,32]", "--set", "eval.tta=flip"]



@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("run") / "fm"
    # in a fresh interpreter: the record's start-up counts the interpreter's own start (a forked
    # process has none of its own to count)
    proc = speedrun("train", "fashion-mnist", "--data-dir", data_dir, "--device", "cpu", "--seed", 3,
                    "--out", out, *QUICK, env={"SPEEDRUN_TEST_FRESH": "1"})
    return out, proc


def test_train_writes_the_run_record(quick_run):
    out, proc = quick_run
    assert "test accuracy" in proc.stdout and "train seconds" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    for key in ("recipe", "dataset", "test_acc", "test_acc_no_tta", "epochs", "train_seconds",
                "compile_seconds", "wall_seconds", "device", "device_name", "torch_version",
                "git_commit", "seed"):
        assert key in summary, key
    assert summary["recipe"] == "fashion-mnist" and summary["dataset"] == "fashion-mnist"
    assert summary["seed"] == 3 and summary["device"] == "cpu"
    assert summary["epochs"] == pytest.approx(0.25, abs=1 / 234)   # whole steps: 59 of 234 per epoch
    assert 0 <= summary["test_acc"] <= 1 and summary["torch_version"] == torch.__version__
    assert summary["compile_seconds"] == 0 and 0 < summary["train_seconds"] < summary["wall_seconds"]
    # the start-up: from the process's start (the interpreter's share read from /proc) to the training clock
    assert 0 < summary["before_main_seconds"] < summary["start_up_seconds"]
    assert summary["start_up_seconds"] - summary["before_main_seconds"] < summary["wall_seconds"] - summary["train_seconds"]
    assert "start-up seconds" in proc.stdout and "training clock" in summary["start_up_region"]
    # a quarter epoch of a small net already classifies most of Fashion-MNIST (chance: 0.1)
    assert summary["test_acc"] > 0.65 and summary["test_acc_no_tta"] > 0.65


def test_config_is_the_fully_resolved_recipe(quick_run):
    out, _ = quick_run
    config = tomllib.loads((out / "config.toml").read_text())
    assert config["train"]["epochs"] == 0.25 and config["train"]["seed"] == 3
    assert config["model"]["widths"] == [16, 32, 32]
    assert config["runtime"] == {"precision": "auto", "compile": "auto", "compile_mode": "default",
                                 "cuda_graphs": "auto", "channels_last": True,
                                 "cast": "autocast", "find_batch": False, "hold_memory": "auto",
                                 "conv_weight_grad": "torch", "master_weights": "none", "threads": "auto"}
    assert load_recipe(str(out / "config.toml")).eval.tta == "flip"


def test_metrics_have_one_line_per_epoch(quick_run):
    out, _ = quick_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert set(rows[0]) == {"epoch", "train_loss", "train_acc", "test_acc", "lr", "seconds", "seconds_total",
                            "skipped_steps", "holdout_acc"}
    assert rows[0]["holdout_acc"] is None                  # (train.stop_at_target is off)
    summary = json.loads((out / "summary.json").read_text())
    assert rows[0]["test_acc"] == summary["test_acc_no_tta"]


def test_weights_load_with_weights_only_and_reproduce_the_accuracy(quick_run, fashion):
    out, _ = quick_run
    state = torch.load(out / "model.pt", weights_only=True)
    recipe = load_recipe(str(out / "config.toml"))
    net = build_model(recipe.model, 1, 10)
    net.load_state_dict(state)
    net.eval()
    x = fashion.test_x.float()
    x = (x - fashion.train_x.float().mean()) / fashion.train_x.float().std()
    with torch.no_grad():
        acc = (net(x).argmax(1) == fashion.test_y).float().mean().item()
    summary = json.loads((out / "summary.json").read_text())
    assert acc == pytest.approx(summary["test_acc_no_tta"], abs=2e-3)


def test_existing_run_folder_is_not_overwritten(quick_run, data_dir):
    out, _ = quick_run
    before = (out / "summary.json").read_bytes()
    proc = speedrun("train", "fashion-mnist", "--data-dir", data_dir, "--out", out, *QUICK, check=False)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (out / "summary.json").read_bytes() == before


def test_bad_recipe_value_exits_with_the_field_named(tmp_path, data_dir):
    proc = speedrun("train", "fashion-mnist", "--set", "optim.momentum=1.5", "--out", tmp_path / "x", check=False)
    assert proc.returncode == 2
    assert "'optim.momentum'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()


def test_missing_data_exits_with_where_it_looked(tmp_path):
    env = {"SPEEDRUN_DATA": str(tmp_path / "nowhere"), "HOME": str(tmp_path), "SPEEDRUN_MIRROR": "http://127.0.0.1:9/"}
    proc = speedrun("train", "fashion-mnist", "--out", tmp_path / "r", env=env, check=False)
    assert proc.returncode == 1 and "not found. Looked in" in proc.stderr and "Traceback" not in proc.stderr


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_weights(tmp_path, data_dir):
    out = tmp_path / "nan"
    proc = speedrun("train", "fashion-mnist", "--data-dir", data_dir, "--out", out, "--set", "optim.lr=1e30",
                    "--set", "train.epochs=0.1", "--set", "model.widths=[8,8,8]", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "at step " in proc.stderr and "last good weights" in proc.stderr
    assert not (out / "summary.json").exists()
    state = torch.load(out / "last_good.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_recipes_lists_every_shipped_recipe():
    proc = speedrun("recipes")
    for name in ("cifar10-94", "page-resnet9", "dawnbench-resnet18", "fashion-mnist"):
        assert name in proc.stdout


def test_version_and_console_script():
    assert speedrun("--version").stdout.startswith("speedrun ")


def test_progress_is_printed_as_plain_lines_when_output_is_a_log_file(tmp_path, fashion_small):
    """A cluster job's log (stdout not a terminal) gets a line every N steps with step, epoch,
    images/s, ETA and (from the second epoch) the last epoch's mean loss, and a line per epoch;
    `--log-every` takes steps or seconds. No line reads a step's loss back from the device."""
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "speedrun", "train", "fashion-mnist", "--data-dir",
                               str(fashion_small), "--set", "data.dataset=npz", "--out", str(tmp_path / "r"),
                               "--set", "model.widths=[8,8,8]", "--set", "data.batch_size=128", "--set",
                               "train.epochs=2", "--set", "eval.tta=none", "--log-every", "3"],
                              stdout=f, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0
    text = log.read_text()
    steps = re.findall(r"fashion-mnist step (\d+)/16 epoch (\d)/2 ([\d,]+) img/s ETA (\d+s|\d+m\d\ds)"
                       r" \(with the final evaluation, estimated at \d+s\)(?: \(epoch (\d) loss (\d+\.\d+)\))?\n", text)
    assert [int(s[0]) for s in steps] == [3, 6, 9, 12, 15]
    assert [s[1] for s in steps] == ["1", "1", "2", "2", "2"]
    assert all(int(s[2].replace(",", "")) > 0 for s in steps)
    epoch_loss = re.search(r"fashion-mnist epoch 1/2 done: loss (\d+\.\d+)", text).group(1)
    assert [(s[4], s[5]) for s in steps] == [("", "")] * 2 + [("1", epoch_loss)] * 3
    assert len(re.findall(r"fashion-mnist epoch \d/2 done: loss \d+\.\d+ train acc", text)) == 2
    assert "\x1b[" not in text.split("┏")[0]                       # no progress-bar escape codes
    bad = speedrun("train", "fashion-mnist", "--log-every", "often", check=False)
    assert bad.returncode == 2 and "--log-every 'often'" in bad.stderr


def test_progress_counts_the_epochs_the_run_trains(tmp_path, fashion_small):
    """A run whose last epoch is partial says how many epochs it trains as its summary does: 12
    steps of 8 an epoch are 1.5 epochs, the second done as 1.5/1.5 and shown as far as it has
    come while it trains (1.25/1.5 at step 10); one epoch is 'epoch'."""
    common = ["train", "fashion-mnist", "--data-dir", fashion_small, "--set", "data.dataset=npz", "--set",
              "model.widths=[8,8,8]", "--set", "data.batch_size=128", "--set", "eval.tta=none", "--log-every", "5"]
    proc = speedrun(*common, "--set", "train.epochs=1.5", "--out", tmp_path / "a")
    text = proc.stdout
    assert "fashion-mnist: 12 steps in 1.5 epochs, batch 128" in text
    assert re.findall(r"fashion-mnist step (\d+)/12 epoch (\S+) ", text) == [("5", "1/1.5"), ("10", "1.25/1.5")]
    assert re.findall(r"fashion-mnist epoch (\S+) done", text) == ["1/1.5", "1.5/1.5"]
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["epochs"] == 1.5
    assert re.search(r"epochs\s+│\s+1\.5 ", text)
    proc = speedrun(*common, "--set", "train.epochs=1", "--out", tmp_path / "b")
    assert "fashion-mnist: 8 steps in 1 epoch, batch 128" in proc.stdout
    assert re.findall(r"fashion-mnist epoch (\S+) done", proc.stdout) == ["1/1"]


def test_the_command_table_lists_every_command_of_the_parser_and_loads_each():
    import argparse

    from speedrun.cli import COMMANDS, build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)
    for name, command in COMMANDS.items():
        assert callable(command.load()), name
