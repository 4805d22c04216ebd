"""`speedrun train --log tensorboard,csv`: real runs in this process, their event files read
back with TensorBoard's own reader, the CSV files, a resume, and proof that logging adds no
read-back of a tensor (no device synchronisation) to the run."""
import csv
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import speedrun
from speedrun import cli as speedrun_cli
from speedrun.engine.loop import Session

# 1,024 images in batches of 256: 4 steps an epoch, 8 in all; a checkpoint after step 5 (in the
# second epoch); a one-cycle schedule, so that the momentum is scheduled and logged too
RUN = ["--set", "data.dataset=npz", "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=256",
       "--set", "train.epochs=2", "--set", "eval.every=1", "--set", "checkpoint.every_steps=5",
       "--set", 'schedule={kind="onecycle", momentum_low=0.8}', "--device", "cpu", "--log-every", "1"]
STEPS, PER_EPOCH = 8, 4

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
"""The ways a tensor's value reaches the host; on a GPU each one waits for the device."""
PACKAGE = Path(speedrun.__file__).resolve().parent


def main(*args) -> int:
    try:
        return speedrun_cli.main([str(a) for a in args])
    except SystemExit as exc:                       # argparse
        return exc.code


def counted_run(*args) -> tuple[int, list[tuple[str, bool, str]]]:
    """Run ``speedrun`` in this process counting every read-back of a tensor: (its name, whether
    it happened inside the training loop of an epoch, the speedrun function that asked)."""
    loop_code = Session._train_epoch.__code__
    reads = []

    def counting(name, original):
        def read(self, *a, **k):
            frame, inside, where = sys._getframe(1), False, None
            while frame is not None:
                code = frame.f_code
                inside |= code is loop_code
                if where is None and code.co_filename.startswith(str(PACKAGE)):
                    where = f"{Path(code.co_filename).name}:{code.co_name}"
                frame = frame.f_back
            reads.append((name, inside, where))
            return original(self, *a, **k)
        return read
    with pytest.MonkeyPatch.context() as mp:
        for name in READS:
            mp.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
        rc = main(*args)
    return rc, reads


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fashion_small):
    """The same run with --log tensorboard,csv and without, each with its reads."""
    root = tmp_path_factory.mktemp("loggers")
    common = ["train", "fashion-mnist", "--data-dir", fashion_small, *RUN]
    rc_plain, plain = counted_run(*common, "--out", root / "plain")
    rc_logged, logged = counted_run(*common, "--out", root / "logged", "--log", "tensorboard", "--log", "csv")
    assert rc_plain == rc_logged == 0
    return root, plain, logged


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run's event files as TensorBoard shows them: (step, value) per tag."""
    acc = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def test_tensorboard_events_hold_the_run_metrics(runs):
    root, _, _ = runs
    run = root / "logged"
    tb = scalars(run)
    assert set(tb) == {"step/loss", "step/lr", "step/momentum", "epoch/train_loss", "epoch/train_acc",
                       "epoch/test_acc", "epoch/train_seconds", "final/test_acc", "final/test_acc_no_tta"}
    for tag in ("step/loss", "step/lr", "step/momentum"):
        assert [s for s, _ in tb[tag]] == list(range(1, STEPS + 1)), tag
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    for tag, key in (("train_loss", "train_loss"), ("train_acc", "train_acc"), ("test_acc", "test_acc"),
                     ("train_seconds", "seconds")):
        assert tb[f"epoch/{tag}"] == [(PER_EPOCH * m["epoch"], f32(m[key])) for m in metrics], tag
    assert tb["final/test_acc"] == [(STEPS, f32(summary["test_acc"]))]
    assert tb["final/test_acc_no_tta"] == [(STEPS, f32(summary["test_acc_no_tta"]))]
    # the LR of a step is the schedule's; the last step's is the one the epoch record holds
    assert [tb["step/lr"][PER_EPOCH * m["epoch"] - 1][1] for m in metrics] == [f32(m["lr"]) for m in metrics]
    # the epoch's mean loss is the mean of its steps' losses
    for m in metrics:
        losses = [v for s, v in tb["step/loss"] if (s - 1) // PER_EPOCH + 1 == m["epoch"]]
        assert sum(losses) / len(losses) == pytest.approx(m["train_loss"], rel=1e-6)
    momenta = [v for _, v in tb["step/momentum"]]
    assert min(momenta) == pytest.approx(0.8, abs=0.02) and max(momenta) == pytest.approx(0.85, abs=1e-6)


def test_csv_files_hold_every_step_and_epoch_at_full_precision(runs):
    root, _, _ = runs
    run = root / "logged"
    steps, epochs = read_csv(run / "steps.csv"), read_csv(run / "epochs.csv")
    assert list(steps[0]) == ["step", "epoch", "loss", "lr", "momentum"]
    assert [int(r["step"]) for r in steps] == list(range(1, STEPS + 1))
    assert [int(r["epoch"]) for r in steps] == [1] * PER_EPOCH + [2] * PER_EPOCH
    tb = scalars(run)
    assert [f32(float(r["loss"])) for r in steps] == [v for _, v in tb["step/loss"]]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert [int(r["step"]) for r in epochs] == [PER_EPOCH, STEPS]
    for row, m in zip(epochs, metrics, strict=True):
        for key in ("train_loss", "train_acc", "test_acc", "lr", "seconds"):
            assert float(row[key]) == m[key], key
        assert int(row["epoch"]) == m["epoch"] and int(row["skipped_steps"]) == m["skipped_steps"]
    assert epochs[0]["test_acc_tta"] == "" and float(epochs[-1]["test_acc_tta"]) == summary["test_acc"]
    assert float(steps[-1]["lr"]) == metrics[-1]["lr"]


def test_logging_reads_nothing_back_from_the_device(runs):
    """Every read of a tensor's value (``.item()``, ``.tolist()``, ``float()``, ...) is counted:
    with the logs on the run makes exactly the reads it makes without them, and inside an
    epoch's steps the only reads are the checkpoint's after step 5, a point the run asks for;
    the progress lines (``--log-every 1``) read nothing."""
    _, plain, logged = runs
    assert Counter(logged) == Counter(plain)
    inside = Counter(where for _, is_inside, where in logged if is_inside)
    checkpoint = {"checkpoint.py:save_run", "step.py:state_dict", "step.py:<listcomp>"}
    assert set(inside) <= checkpoint and inside["checkpoint.py:save_run"] >= 1, inside   # copies to the host
    assert Counter(where for _, is_inside, where in logged if not is_inside)["loop.py:_check_epoch"] == 2


def test_a_resumed_run_continues_the_logs_without_logging_a_step_twice(runs, tmp_path):
    """The run killed just before its summary was written: its logs hold every step and the final
    accuracy, its checkpoint is from step 5. The resume (no --log: it continues the folder's logs)
    logs epoch 2 again; TensorBoard's reader and the CSV files show each step once, as the run
    that was not interrupted logged them."""
    root, _, _ = runs
    whole, cut = root / "logged", tmp_path / "cut"
    shutil.copytree(whole, cut)
    for name in ("summary.json", "model.pt", "preprocessing.json"):
        (cut / name).unlink()
    assert torch.load(cut / "checkpoint.pt", weights_only=True)["step"] == 5
    assert main("train", "--resume", cut, "--log-every", "1") == 0
    assert json.loads((cut / "summary.json").read_text())["resumed_from_step"] == 5
    a, b = scalars(whole), scalars(cut)
    assert set(a) == set(b)
    for tag in a:
        if tag != "epoch/train_seconds":
            assert b[tag] == a[tag], tag
    assert [s for s, _ in b["epoch/train_seconds"]] == [PER_EPOCH, STEPS]
    # both event files hold epoch 2's steps; the reader drops the first run's from step 5 on
    files = sorted((cut / "tensorboard").glob("events.out.tfevents.*"))
    written = [v.tag for f in files for e in EventFileLoader(str(f)).Load() for v in e.summary.value]
    assert len(files) == 2 and written.count("step/loss") == STEPS + PER_EPOCH
    drop = {"seconds", "seconds_total"}
    assert read_csv(cut / "steps.csv") == read_csv(whole / "steps.csv")
    assert [{k: v for k, v in r.items() if k not in drop} for r in read_csv(cut / "epochs.csv")] == \
           [{k: v for k, v in r.items() if k not in drop} for r in read_csv(whole / "epochs.csv")]


def test_tensorboard_missing_is_one_line_before_training(tmp_path, fashion_small):
    """A real process in which `import tensorboard` fails."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "tensorboard.py").write_text("raise ImportError(\"No module named 'tensorboard'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "speedrun", "train", "fashion-mnist", "--data-dir", str(fashion_small),
                           *RUN, "--out", str(tmp_path / "run"), "--log", "csv,tensorboard"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("speedrun: error: --log tensorboard needs the tensorboard package")
    assert "pip install tensorboard" in proc.stderr
    assert "epoch" not in proc.stdout and not (tmp_path / "run").exists()


def test_unknown_or_contradictory_loggers_are_refused(tmp_path, capsys):
    for value, said in (("bogus", "--log 'bogus': choose tensorboard, csv or none"),
                        ("none,csv", "'none' cannot be combined")):
        assert main("train", "fashion-mnist", "--out", tmp_path / "r", "--log", value) == 2
        err = capsys.readouterr().err
        assert err.startswith("speedrun: error: ") and said in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_a_resumed_csv_keeps_whole_rows_up_to_its_step_and_appends_after_them(tmp_path):
    """What a killed run can leave: rows past the resumed epoch's start, and a torn last line."""
    from speedrun.report.loggers import CsvLog
    from speedrun.report.record import RunRecord
    (tmp_path / "steps.csv").write_text("step,epoch,loss,lr\n" + "".join(f"{s},{(s - 1) // 4 + 1},0.{s},1e-3\n"
                                                                        for s in range(1, 7)) + "7,2,0.")
    log = CsvLog(RunRecord(tmp_path, resume_history=[]), "steps.csv", "step", keep=4)
    log.write([{"step": s, "epoch": 2, "loss": 0.5, "lr": 1e-3} for s in (5, 6, 7, 8)])
    rows = read_csv(tmp_path / "steps.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 9)) and rows[3]["loss"] == "0.4"
    assert [r["loss"] for r in rows[4:]] == ["0.5"] * 4
