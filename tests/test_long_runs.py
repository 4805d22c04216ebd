"""Faults of long runs, with real processes and real files: a second run into a folder in use,
a run killed with -9 whose lock is left behind, and a data loader worker killed by the system
(a decoded cache cut short or overwritten: tests/test_photos.py)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from speedrun.data.pipeline.stream import batches_of
from speedrun.errors import DataError
from speedrun.stop_signals import RESUMABLE_EXIT

SMALL = ["--set", "data.dataset=npz", "--set", "model.widths=[8,8,8]", "--set", "data.batch_size=128",
         "--set", "eval.tta=none", "--device", "cpu"]


def start(*args, log):
    return subprocess.Popen([sys.executable, "-m", "speedrun", *map(str, args)], stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def run(*args):
    return subprocess.run([sys.executable, "-m", "speedrun", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def wait_for(path, proc, seconds=300):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {path} was written"
        assert time.monotonic() - t0 < seconds, f"{path} was not written in {seconds} s"
        time.sleep(0.05)


def tree(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slow
def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path,
                                                                                            fashion_small):
    out = tmp_path / "run"
    common = ["train", "fashion-mnist", "--data-dir", fashion_small, *SMALL, "--out", out]
    with open(tmp_path / "first.log", "w") as log:
        # long enough to outlast the second process's start on a busy machine; stopped by SIGTERM below
        first = start(*common, "--set", "train.epochs=400", "--set", "checkpoint.every_steps=4", log=log)
        try:
            wait_for(out / "checkpoint.pt", first)
            before = tree(out)
            second = run(*common, "--set", "train.epochs=1")
            after = tree(out)
            assert first.poll() is None                     # (the first run is still going)
        finally:
            first.send_signal(signal.SIGTERM)               # it stops at a step, checkpointed, resumable
            first.wait(timeout=600)
    assert second.returncode == 2, second.stderr
    line = second.stderr.strip()
    assert line.count("\n") == 0 and line.startswith("speedrun: error: --out ")
    assert str(out) in line and f"process {first.pid}" in line and "still going" in line
    assert set(after) >= set(before) and after[".speedrun.lock"] == before[".speedrun.lock"]
    assert not (out / "model.pt").exists()                                  # nothing of the refused run
    assert first.returncode == RESUMABLE_EXIT, (tmp_path / "first.log").read_text()
    assert not (out / ".speedrun.lock").exists()                            # released at its end

    # a run killed with -9 leaves its lock file behind; the kernel freed the lock, so resuming takes it over
    killed = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as log:
        victim = start("train", "fashion-mnist", "--data-dir", fashion_small, *SMALL, "--out", killed,
                       "--set", "train.epochs=3", "--set", "checkpoint.every_steps=2", log=log)
        wait_for(killed / "checkpoint.pt", victim)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    assert (killed / ".speedrun.lock").read_text().strip() == str(victim.pid)
    resumed = run("train", "--resume", killed)
    assert resumed.returncode == 0, resumed.stderr
    assert f"left locked by process {victim.pid}, which is no longer running" in resumed.stdout
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["test_acc"] > 0.1 + 3 * (0.09 / summary["test_images"]) ** 0.5      # it learned: chance + 3 SE
    assert not (killed / ".speedrun.lock").exists()


def descendants(pid):
    """The ids of a process's descendants, from /proc."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def test_a_killed_data_loader_worker_ends_the_run_naming_the_folder_and_keeps_the_weights(tmp_path, jpeg32):
    out, log_path = tmp_path / "run", tmp_path / "job.log"
    with open(log_path, "w") as log:
        proc = start("train", "folder", "--data", jpeg32, "--set", "data.cache=off", "--set", "data.workers=2",
                     "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=32", "--set", "train.epochs=4",
                     "--set", "eval.tta=none", "--set", "data.auto_choices=false", "--set", "data.image_size=32",
                     "--set", "eval.every=0", "--log-every", "1", "--out", out, log=log)     # (no test loader yet)
        t0 = time.monotonic()
        while "epoch 1/4 done" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() - t0 < 300, log_path.read_text()
            time.sleep(0.05)
        workers = [p for p in descendants(proc.pid) if p not in descendants(proc.pid)[:1]]
        os.kill(workers[-1], signal.SIGKILL)
        proc.wait(timeout=300)
    text = log_path.read_text()
    errors = [line for line in text.splitlines() if line.startswith("speedrun: error:")]
    assert proc.returncode == 1 and len(errors) == 1, text
    assert "data loader worker reading" in errors[0] and str(jpeg32) in errors[0] and "Traceback" not in text
    assert (out / "last_good.pt").exists()
    # a checkpoint of the last finished step (the middle of the epoch where the worker died), from
    # which the run continues to the end
    said = re.search(r"A checkpoint after step (\d+) is in (\S+): once the cause is fixed, continue with "
                     r"`speedrun train --resume (\S+)`", errors[0])
    assert said and said.group(2) == str(out / "checkpoint.pt") and said.group(3) == str(out), text
    step = int(said.group(1))
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["step"] == step >= 16 and state["epoch"] >= 1        # (16 steps an epoch: after the first)
    resumed = run("train", "--resume", out, "--data", jpeg32)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    losses = [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 64 and len(losses) == 4 and losses[-1] < losses[0] - 0.05, losses      # it learned


MEMORY = "the system may have run out of memory"


@pytest.mark.parametrize("death, advice", [
    (RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed."), MEMORY),
    (ConnectionResetError(104, "Connection reset by peer"), MEMORY), (EOFError(), MEMORY),
    # a signal other than SIGKILL is not the out-of-memory killer's (the stop signals never reach a worker)
    (RuntimeError("DataLoader worker (pid 7) is killed by signal: Hangup."), "another process sent it Hangup")],
    ids=["torch", "reset", "closed", "signal"])
def test_each_way_a_dead_worker_shows_up_is_the_one_line_data_error(death, advice):
    """Which of these reaches the loop first depends on timing (the run above meets one of them)."""
    def loader():
        yield "first batch"
        raise death
    batches = batches_of(loader(), "/photos")
    assert next(batches) == "first batch"
    with pytest.raises(DataError, match=r"reading /photos ended unexpectedly \(\S.*\); " + advice):
        next(batches)


def test_a_runtime_error_of_another_kind_passes_through_the_loader_unchanged():
    def loader():
        raise RuntimeError("unrelated")
        yield
    with pytest.raises(RuntimeError, match="unrelated"):
        next(batches_of(loader(), "/photos"))
