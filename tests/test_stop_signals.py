"""A run stopped by a signal at a step boundary or in an evaluation, as a cluster or a user
stops it: real processes signalled mid-epoch, or as an evaluation starts, once their progress
lines (or logs) say so, the resumable exit code, the one line naming the checkpoint, and a
resume that ends with the weights and accuracy of an uninterrupted run bit for bit (resident
and streamed data, one process and two under torchrun); `speedrun evaluate` stopped alike."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speedrun.stop_signals import RESUMABLE_EXIT

from test_cli import speedrun
from test_distributed import env as job_env, free_port, torchrun_cmd

RESIDENT = ["fashion-mnist", "--device", "cpu", "--seed", "4", "--set", "data.dataset=npz",
            "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=64", "--set", "eval.tta=none",
            "--set", "train.epochs=0.5"]
"""fashion-mnist on the 1,024-image slice (--data-dir fashion_small): 8 steps of a 16-step epoch."""
STREAMED = ["folder", "--device", "cpu", "--seed", "4", "--set", "model.widths=[8,16,16]",
            "--set", "data.batch_size=64", "--set", "eval.tta=flip", "--set", "eval.every=1",
            "--set", "train.epochs=4", "--set", "data.workers=2"]
"""the 512-image JPEG folder (--data-dir jpeg32), decoded by two worker processes for training and
two for the evaluation after each epoch: 4 epochs of 8 steps."""
LINE = re.compile(r"speedrun: stopped by (SIG\w+) after step (\d+) of (\d+); checkpoint: (\S+); "
                  r"continue with `speedrun train --resume (\S+)`")
ANY_STOP = re.compile(r"speedrun: stopped by (SIG\w+)(?: in (the [\w -]+?),)? after step (\d+) of (\d+)[^;]*; "
                      r"checkpoint: (\S+); continue with `speedrun train --resume \S+`")
"""The stop's line at a step boundary (LINE), or in an evaluation (which one is named)."""


def plain_env() -> dict:
    """This environment without a launcher's variables (no SLURM job to requeue)."""
    return {k: v for k, v in job_env().items() if not k.startswith("SLURM_")}


def signalled(cmd: list, sig: int, after_step: int, whole_group: bool = False, env=None, in_evaluation: int = 0):
    """Run ``cmd`` (which prints a progress line per step), send ``sig`` once it reports step
    ``after_step``, and wait for it: (exit code, stdout, stderr). ``whole_group``: signal every
    process of its group (its data workers too), as a terminal's Ctrl-C and SLURM do.
    ``in_evaluation``: after that line, wait until this many processes run under ``cmd`` (its
    helpers with the evaluation's data workers, started as the evaluation after the epoch
    begins), and send the signal then: as the evaluation's workers start."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or plain_env(), start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r"step (\d+)/", line)
        if m and int(m.group(1)) >= after_step:
            if in_evaluation:
                deadline = time.monotonic() + 60
                while len(descendants(proc.pid)) < in_evaluation:
                    assert time.monotonic() < deadline, "the evaluation's workers never started"
                    time.sleep(0.002)
            (os.killpg if whole_group else os.kill)(proc.pid, sig)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(seen) + out, err


def descendants(pid: int) -> set[int]:
    """The processes started by ``pid``, and by those, and so on (from /proc)."""
    from test_distributed import processes
    table, found, todo = processes(), set(), [pid]
    while todo:
        parent = todo.pop()
        for child, (_, ppid) in table.items():
            if ppid == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found


def equal_weights(a: Path, b: Path) -> bool:
    x, y = torch.load(a / "model.pt", weights_only=True), torch.load(b / "model.pt", weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def check_stopped(rc, out, err, sig: int, run: Path, steps: int, after_step: int) -> int:
    """The stop's exit code, line and checkpoint; returns the step it stopped after."""
    assert rc == RESUMABLE_EXIT, f"exit {rc}\n{out[-3000:]}\n{err[-3000:]}"
    m = LINE.search(out)
    assert m, out[-3000:]
    name, step, total, path, resume = m.groups()
    step = int(step)
    assert name == signal.Signals(sig).name and int(total) == steps and after_step <= step < steps
    assert Path(path) == run / "checkpoint.pt" and Path(resume) == run and not (run / "summary.json").exists()
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["step"] == step and 0 < state["batch_in_epoch"] < 16          # in the middle of an epoch
    return step


@pytest.fixture(scope="module")
def whole(fashion_small, tmp_path_factory) -> Path:
    """The RESIDENT run, uninterrupted and without periodic checkpoints: the weights each
    signalled and resumed run below must end with."""
    out = tmp_path_factory.mktemp("whole") / "run"
    speedrun("train", *RESIDENT, "--data-dir", fashion_small, "--out", out, env=plain_env())
    return out


@pytest.mark.parametrize("sig, periodic, group", [(signal.SIGINT, [], True),
                                                  (signal.SIGUSR1, ["checkpoint.every_steps=3"], False)],
                         ids=["SIGINT-to-the-group-no-periodic-checkpoints", "SIGUSR1-after-a-periodic-checkpoint"])
def test_a_signalled_run_stops_at_a_step_with_a_checkpoint_and_resumes_bit_for_bit(fashion_small, tmp_path, sig,
                                                                                   periodic, group, whole):
    """... to the bit of the run that was never stopped (and, with periodic checkpoints, of one
    that wrote none: writing them changes no weight). ``group``: to the whole process group, as
    a terminal sends Ctrl-C."""
    args = [*RESIDENT, "--data-dir", str(fashion_small), *sum((["--set", s] for s in periodic), [])]
    run = tmp_path / "cut"
    rc, out, err = signalled([sys.executable, "-m", "speedrun", "train", *args, "--log-every", "1", "--out", str(run)],
                             sig, after_step=4, whole_group=group)
    step = check_stopped(rc, out, err, sig, run, 8, 4)
    assert step > 3            # after the last periodic checkpoint before the signal (step 3), where there is one
    speedrun("train", "--resume", run, "--data-dir", fashion_small, env=plain_env())
    assert equal_weights(whole, run)


# ------------------------------------------------------------------------------------------
# A stop signal in an evaluation: the final one, the monitoring one after an epoch, the
# target check, and `speedrun evaluate`
# ------------------------------------------------------------------------------------------

def _fashion_npz(name: str, train: int, test: int):
    """A session fixture: Fashion-MNIST's first ``train`` training and ``test`` test images as an .npz."""
    def fixture(artifacts, fashion) -> Path:
        import numpy as np
        from small_data import build_once

        def build(tmp):
            tmp.mkdir()
            np.savez(tmp / f"{name}.npz", x_train=fashion.train_x[:train].numpy(),
                     y_train=fashion.train_y[:train].numpy(), x_test=fashion.test_x[:test].numpy(),
                     y_test=fashion.test_y[:test].numpy(), classes=np.array(fashion.classes))
        return build_once(artifacts, name, build) / f"{name}.npz"
    fixture.__name__ = name.replace("-", "_")
    return pytest.fixture(scope="session", name=fixture.__name__)(fixture)


fashion_long_test = _fashion_npz("fashion-long-test", 1024, 10_000)
fashion_long_holdout = _fashion_npz("fashion-long-holdout", 8192, 256)

TINY = ["fashion-mnist", "--device", "cpu", "--seed", "4", "--set", "data.dataset=npz",
        "--set", "model.widths=[8,16,16]", "--set", "eval.batch_size=250"]
LONG_FINAL = [*TINY, "--set", "data.batch_size=64", "--set", "train.epochs=0.5", "--set", "eval.tta=flip_translate"]
"""fashion_long_test (1,024 training images, all 10,000 test images): 8 steps, then a final
evaluation of 40 batches with TTA, many times longer than the training: a signal sent as it
starts lands long before its last batch."""
MONITORED = [*TINY, "--set", "data.batch_size=64", "--set", "train.epochs=2", "--set", "eval.every=1",
             "--set", "eval.tta=none", "--log", "csv"]
"""fashion_long_test: 2 epochs of 16 steps with a monitoring evaluation of the 10,000 test
images after the first; steps.csv is written as the first epoch's end begins, just before it."""
TARGET = [*TINY, "--set", "data.batch_size=256", "--set", "train.epochs=1.0625", "--set", "eval.every=0",
          "--set", "eval.tta=none", "--set", "train.stop_at_target=true", "--set", "data.holdout=0.5",
          "--log", "csv"]
"""fashion_long_holdout (8,192 training images, half held out): 16 steps, the target check on
the 4,096 held-out images (the recipe's 92% is not reached), then one more step."""
IN_EVALUATION = re.compile(r"speedrun: stopped by (SIG\w+) in (the [\w -]+?), after step (\d+) of (\d+)(.*?); "
                           r"checkpoint: (\S+); continue with `speedrun train --resume (\S+)`")


def signalled_at_line(cmd: list, sig: int, text: str, whole_group: bool = False):
    """Run ``cmd``, send ``sig`` as soon as it prints a line holding ``text``, and wait:
    (exit code, stdout, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=plain_env(),
                            start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            (os.killpg if whole_group else os.kill)(proc.pid, sig)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(seen) + out, err


def signalled_when_logged(cmd: list, sig: int, steps_csv: Path, step: int):
    """Run ``cmd`` (a run with ``--log csv``), send ``sig`` once ``steps_csv`` holds step
    ``step``'s row (written as that epoch's end begins, after its last step), and wait."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=plain_env())
    while not (steps_csv.is_file() and f"\n{step}," in steps_csv.read_text()):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.002)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def stopped_in(rc, out, err, sig: int, run: Path, evaluation: str, step: int, steps: int) -> dict:
    """A stop in ``evaluation``: the exit code, the one line, no traceback; returns the checkpoint."""
    said = f"exit {rc}\n{out[-3000:]}\n{err[-3000:]}"
    assert rc == RESUMABLE_EXIT and "Traceback" not in out + err and out.count("speedrun: stopped") == 1, said
    m = IN_EVALUATION.search(out)
    assert m, said
    name, where, after, total, _, path, resume = m.groups()
    assert (name, where, int(after), int(total)) == (signal.Signals(sig).name, evaluation, step, steps), said
    assert Path(path) == run / "checkpoint.pt" and Path(resume) == run and not (run / "summary.json").exists()
    state = torch.load(path, weights_only=True)
    assert state["step"] == step and state["interrupted"] == {"evaluation": evaluation,
                                                              "training_complete": evaluation == "the final evaluation"}
    return state


def summary(run: Path) -> dict:
    import json
    return json.loads((run / "summary.json").read_text())


def metrics(run: Path) -> list[dict]:
    import json
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def resume(run: Path, data: Path) -> str:
    return speedrun("train", "--resume", run, "--data-dir", data, "--log-every", "1", env=plain_env()).stdout


def same_results(a: Path, b: Path, keys=("test_acc", "test_acc_no_tta", "epochs", "steps", "test_images")) -> None:
    """The same accuracies and weights, bit for bit, and the same per-epoch records but for
    their seconds."""
    sa, sb = summary(a), summary(b)
    assert {k: sa.get(k) for k in keys} == {k: sb.get(k) for k in keys}
    assert equal_weights(a, b)
    untimed = lambda rows: [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]  # noqa: E731
    assert untimed(metrics(a)) == untimed(metrics(b))


@pytest.fixture(scope="module")
def whole_long_final(fashion_long_test, tmp_path_factory) -> Path:
    """LONG_FINAL uninterrupted: what the runs stopped in their final evaluation must report."""
    out = tmp_path_factory.mktemp("whole-long-final") / "run"
    speedrun("train", *LONG_FINAL, "--data-dir", fashion_long_test, "--out", out, env=plain_env())
    return out


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGINT-to-the-group"])
def test_a_signal_in_the_final_evaluation_stops_it_and_the_resume_reports_the_uninterrupted_result(
        fashion_long_test, tmp_path, sig, group, whole_long_final, cli):
    """SIGTERM (what SLURM sends at its time limit), or Ctrl-C to the process group, as the
    final evaluation starts: it ends between two batches, long before its last (no
    accuracy is printed), with the trained weights in model.pt (the uninterrupted run's,
    bit for bit), a checkpoint that says the training is complete and the evaluation is not,
    and exit 75. ``--resume`` runs the evaluation again and reports the uninterrupted run's
    accuracies; its clock counts the training before the stop and the whole evaluation after
    it, not the evaluation that was cut short."""
    run = tmp_path / "cut"
    cmd = [sys.executable, "-m", "speedrun", "train", *LONG_FINAL, "--data-dir", str(fashion_long_test),
           "--out", str(run), "--log-every", "1"]
    rc, out, err = signalled_at_line(cmd, sig, "final evaluation: 10,000 test images", whole_group=group)
    state = stopped_in(rc, out, err, sig, run, "the final evaluation", 8, 8)
    assert "final evaluation done" not in out and "test accuracy" not in out
    assert f"(the training is complete; its weights: {run / 'model.pt'})" in out
    assert "(it runs the final evaluation)" in out
    assert equal_weights(whole_long_final, run)                 # the trained weights, written at the stop
    assert state["epoch"] == 0 and state["batch_in_epoch"] == 8 and state["history"] == []
    # the folder is not a finished run yet, and says how to finish it
    code, said = cli("evaluate", run, "--device", "cpu")
    assert code == 2 and f"continue it with `speedrun train --resume {run}`" in said, said
    resumed = resume(run, fashion_long_test)
    assert "final evaluation: 10,000 test images" in resumed and "final evaluation done" in resumed
    same_results(run, whole_long_final)
    s = summary(run)
    before = state["elapsed"] - sum(state["paused"].values())      # the training's seconds, until its last step
    assert s["resumed_from_step"] == 8 and 0 < s["final_eval_seconds"]
    assert s["train_seconds"] >= before + s["final_eval_seconds"]
    assert metrics(run)[-1]["seconds_total"] == s["train_seconds"]


ONE_BATCH = ["--set", "eval.batch_size=10000", "--set", "eval.chunk=250"]
"""The final evaluation as one batch of all 10,000 test images (as a large eval.batch_size on a
slow CPU makes one batch last minutes), computed in model calls of 250 images: the images of
each call are those of one of LONG_FINAL's batches of 250."""


def test_a_signal_inside_one_long_evaluation_batch_stops_between_its_model_calls(fashion_long_test, tmp_path,
                                                                                  whole_long_final):
    """SIGTERM as a final evaluation of a single batch starts: the stop is checked between the
    batch's model calls, not only between batches, so the run stops inside its only batch
    (no accuracy printed), exit 75, the trained weights and a checkpoint written; the resume
    evaluates the batch again. Its plain-view accuracy is the uninterrupted LONG_FINAL run's
    exactly (the same images in each call); its TTA accuracy is near that run's, not the same
    (TTA goes to the least confident quarter of each batch, and here the batch is all the test
    images)."""
    run = tmp_path / "cut"
    cmd = [sys.executable, "-m", "speedrun", "train", *LONG_FINAL, *ONE_BATCH, "--data-dir", str(fashion_long_test),
           "--out", str(run), "--log-every", "1"]
    rc, out, err = signalled_at_line(cmd, signal.SIGTERM, "final evaluation: 10,000 test images")
    stopped_in(rc, out, err, signal.SIGTERM, run, "the final evaluation", 8, 8)
    assert "final evaluation done" not in out and "test accuracy" not in out
    assert equal_weights(whole_long_final, run)
    resumed = resume(run, fashion_long_test)
    assert "final evaluation done" in resumed
    s, whole = summary(run), summary(whole_long_final)
    assert s["resumed_from_step"] == 8 and "chunk = 250" in (run / "config.toml").read_text()
    assert {k: s[k] for k in ("test_acc_no_tta", "steps", "test_images")} == \
        {k: whole[k] for k in ("test_acc_no_tta", "steps", "test_images")}
    assert abs(s["test_acc"] - whole["test_acc"]) < 0.01 and equal_weights(whole_long_final, run)


@pytest.fixture(scope="module")
def whole_monitored(fashion_long_test, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole-monitored") / "run"
    speedrun("train", *MONITORED, "--data-dir", fashion_long_test, "--out", out, env=plain_env())
    return out


def test_a_signal_in_the_monitoring_evaluation_after_an_epoch_stops_it_and_the_resume_repeats_it(
        fashion_long_test, tmp_path, whole_monitored):
    """SIGUSR1 (what a SLURM job asks for ahead of its time limit) once the first epoch's last
    step is done, during the evaluation of the 10,000 test images after it: the run stops there
    with a checkpoint after the epoch's last step; the resume evaluates the epoch again (its
    record gets its test accuracy), trains the second epoch and ends as the uninterrupted run
    does, bit for bit, with each step logged once."""
    run = tmp_path / "cut"
    cmd = [sys.executable, "-m", "speedrun", "train", *MONITORED, "--data-dir", str(fashion_long_test),
           "--out", str(run)]
    rc, out, err = signalled_when_logged(cmd, signal.SIGUSR1, run / "steps.csv", 16)
    state = stopped_in(rc, out, err, signal.SIGUSR1, run, "the monitoring evaluation after epoch 1", 16, 32)
    assert "epoch 1/2 done" not in out and not (run / "model.pt").exists() and not (run / "metrics.jsonl").exists()
    assert state["epoch"] == 0 and state["batch_in_epoch"] == 16
    resume(run, fashion_long_test)
    same_results(run, whole_monitored)
    assert metrics(run)[0]["test_acc"] is not None
    logged = [int(line.split(",")[0]) for line in (run / "steps.csv").read_text().splitlines()[1:]]
    assert logged == list(range(1, 33))


@pytest.fixture(scope="module")
def whole_target(fashion_long_holdout, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("whole-target") / "run"
    speedrun("train", *TARGET, "--data-dir", fashion_long_holdout, "--out", out, env=plain_env())
    return out


def test_a_signal_in_the_target_check_stops_it_and_the_resume_checks_again(fashion_long_holdout, tmp_path,
                                                                          whole_target):
    """SIGTERM during train.stop_at_target's check on 4,096 held-out images after the first
    epoch: the run stops there; the resume makes the check again (counted once), and ends as
    the uninterrupted run does, bit for bit."""
    run = tmp_path / "cut"
    cmd = [sys.executable, "-m", "speedrun", "train", *TARGET, "--data-dir", str(fashion_long_holdout),
           "--out", str(run)]
    rc, out, err = signalled_when_logged(cmd, signal.SIGTERM, run / "steps.csv", 16)
    state = stopped_in(rc, out, err, signal.SIGTERM, run, "the target check after epoch 1", 16, 17)
    assert state["target_checks"]["checks"] == 0
    resume(run, fashion_long_holdout)
    same_results(run, whole_target)
    checks = lambda run: {k: v for k, v in summary(run)["stop_at_target"].items() if "seconds" not in k}  # noqa: E731
    assert checks(run) == checks(whole_target) and checks(run)["checks"] == 1
    assert metrics(run)[0]["holdout_acc"] == metrics(whole_target)[0]["holdout_acc"] is not None


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGINT-to-the-group"])
def test_a_signal_stops_speedrun_evaluate_between_batches_writing_nothing(whole_long_final, tmp_path, sig, group):
    """`speedrun evaluate` of a finished run, signalled as its evaluation of 10,000 test images
    starts: one line says it stopped and wrote nothing, exit 130 (nothing to continue from),
    and the run folder holds what it held before."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(whole_long_final, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    cmd = [sys.executable, "-m", "speedrun", "evaluate", str(run), "--device", "cpu"]
    rc, out, err = signalled_at_line(cmd, sig, f"speedrun: evaluating {run}", whole_group=group)
    said = f"exit {rc}\n{out[-3000:]}\n{err[-3000:]}"
    assert rc == 130 and "Traceback" not in out + err and "error" not in out + err, said
    assert (f"speedrun: evaluate stopped by {signal.Signals(sig).name} during the evaluation of {run}; nothing was "
            f"written (run `speedrun evaluate {run}` again)") in out, said
    assert "accuracy" not in out
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


# (signal, when): each of the three stop signals once in the middle of an epoch and once while the
# evaluation after an epoch starts its data workers; one run, cut and resumed six times
# (the fork server, the resource tracker, two data workers for training and two for the evaluation)
HELPERS = 6
CUTS = [(signal.SIGINT, 3, 0), (signal.SIGTERM, 8, HELPERS), (signal.SIGUSR1, 11, 0), (signal.SIGINT, 16, HELPERS),
        (signal.SIGTERM, 19, 0), (signal.SIGUSR1, 24, HELPERS)]


def cut_and_resume(first: list, resume: list, cuts, steps: int, env=None, launcher: str | None = None) -> list[int]:
    """Start ``first``, signal its process group as ``cuts`` says ((signal, after step, processes to
    wait for: see :func:`signalled`)), continue it with ``resume`` and signal that as the next cut says, and
    so on, then let the last resume finish. Each stop: exit 75 (``launcher`` "torchrun": torchrun
    exits 1 with its own report of the signal it was sent), one line naming the signal and the
    checkpoint of the step it stopped after, the checkpoint in place, no traceback from any of
    speedrun's processes. Returns the steps stopped after."""
    stops, cmd = [], first
    for sig, after, in_eval in cuts:
        rc, out, err = signalled(cmd, sig, after, whole_group=True, env=env, in_evaluation=in_eval)
        said = f"exit {rc} after {signal.Signals(sig).name}\n{out[-3000:]}\n{err[-3000:]}"
        if launcher == "torchrun":
            assert rc == 1 and "SignalException" in err, said
            assert err.count("Traceback") == err.count("torch.distributed.elastic.multiprocessing.api.SignalException: "
                                                       "Process"), said
            assert "speedrun: error" not in err, said
        else:
            assert rc == RESUMABLE_EXIT and "Traceback" not in err and "error" not in err, said
        assert "Traceback" not in out, said
        lines = ANY_STOP.findall(out)
        assert len(lines) == 1 and out.count("speedrun: stopped") == 1, said
        name, during, step, total, path = lines[0]
        step = int(step)
        # a resumed run counts its progress lines on from the step it resumed at
        first = re.search(r"step (\d+)/", out)
        assert int(first.group(1)) == (stops[-1] + 1 if stops else 1), (stops, first.group(0))
        assert name == signal.Signals(sig).name and int(total) == steps and after <= step < steps
        # signalled as the evaluation after an epoch starts its workers, the run stops in it, before
        # its batch; or, where this process sent the signal late on a busy machine, after it, at one
        # of the next steps. Signalled mid-epoch, it stops at a step.
        if in_eval and during:
            assert during == f"the monitoring evaluation after epoch {after // 8}" and step == after, (during, step)
        else:
            assert not during and (not in_eval or step <= after + 3), (name, after, during, step)
        assert torch.load(path, weights_only=True)["step"] == step
        stops.append(step)
        cmd = resume
    proc = subprocess.run(resume, capture_output=True, text=True, env=env or plain_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return stops


def test_a_streamed_run_signalled_with_its_workers_stops_and_resumes_bit_for_bit(jpeg32, tmp_path):
    """SIGINT, SIGTERM and SIGUSR1 to the whole process group (the trainer, its data workers,
    multiprocessing's fork server and resource tracker), as a terminal's Ctrl-C and SLURM send
    them, in the middle of an epoch and as the evaluation after an epoch starts its workers:
    every helper leaves the stop to the trainer, which checkpoints at the next step boundary or,
    in the evaluation, before its batch (the resume evaluates again), and the run resumed six
    times ends with the uninterrupted run's weights, every tensor."""
    args = [*STREAMED, "--data-dir", str(jpeg32)]
    whole = subprocess.Popen([sys.executable, "-m", "speedrun", "train", *args, "--out", str(tmp_path / "whole")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=plain_env())
    run = tmp_path / "cut"
    speedrun_cmd = [sys.executable, "-m", "speedrun", "train"]
    stops = cut_and_resume([*speedrun_cmd, *args, "--log-every", "1", "--out", str(run)],
                           [*speedrun_cmd, "--resume", str(run), "--data-dir", str(jpeg32), "--log-every", "1"],
                           CUTS, 32)
    assert stops == sorted(stops)
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    assert equal_weights(tmp_path / "whole", run)


TWO = [*RESIDENT, "--set", "train.epochs=2"]
"""RESIDENT for two torchrun processes (--data-dir fashion_small): 32 steps. torchrun relays the
progress lines late, so a signal may land some steps after the line that prompted it."""


def launch() -> list[str]:
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.2"]


@pytest.fixture(scope="module")
def whole_two(fashion_small, tmp_path_factory) -> Path:
    """TWO on two torchrun processes, uninterrupted: the weights the signalled jobs must end with."""
    out = tmp_path_factory.mktemp("whole-two") / "run"
    proc = subprocess.run(torchrun_cmd(*TWO, "--data-dir", fashion_small, "--out", out, launcher=launch()),
                          capture_output=True, text=True, env=plain_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_a_signal_to_one_of_two_processes_stops_both_at_the_same_step(fashion_small, tmp_path, whole_two):
    """torchrun, gloo: SIGUSR1 to rank 1 alone; both ranks stop after the same step (rank 0's
    line names it), rank 0 writes the checkpoint, both exit resumable, and the resumed job ends
    with the uninterrupted job's weights, every tensor bit for bit (the batch-norm running
    statistics, which each rank keeps of its own batches, come back to each rank from the
    checkpoint's per-rank part)."""
    run = tmp_path / "cut"
    agent = subprocess.Popen(torchrun_cmd(*TWO, "--data-dir", fashion_small, "--log-every", "1", "--out", run,
                                          launcher=launch()),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=plain_env())
    seen = []
    for line in agent.stdout:
        seen.append(line)
        m = re.search(r"step (\d+)/", line)
        if m and int(m.group(1)) >= 3:
            rank1 = [p for p in worker_pids(agent.pid) if p[0] == 1][0][1]
            os.kill(rank1, signal.SIGUSR1)
            break
    out, err = agent.communicate(timeout=300)
    out = "".join(seen) + out
    # torchrun reports its workers' exit codes: both the resumable one
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert codes and set(codes) == {str(RESUMABLE_EXIT)}, err[-4000:]
    m = LINE.search(out)
    assert m and m.group(1) == "SIGUSR1" and out.count("speedrun: stopped by") == 1, out[-3000:]
    step = int(m.group(2))
    assert 3 <= step < 32 and torch.load(run / "checkpoint.pt", weights_only=True)["step"] == step
    resumed = subprocess.run(torchrun_cmd("--resume", run, "--data-dir", fashion_small, "--device", "cpu",
                                          launcher=launch()), capture_output=True, text=True, env=plain_env(),
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    ranks = torch.load(run / "checkpoint.pt", weights_only=True)["ranks"]
    assert len(ranks) == 2 and not all(torch.equal(a, b) for a, b in zip(ranks[0]["buffers"].values(),
                                                                          ranks[1]["buffers"].values()))
    assert equal_weights(whole_two, run)


def test_a_two_process_job_signalled_as_a_group_stops_and_resumes_bit_for_bit(fashion_small, tmp_path, whole_two):
    """Ctrl-C (SIGINT) to torchrun's process group, then SIGUSR1 as SLURM sends it ahead of the
    time limit (torchrun passing it on, as scripts/speedrun-torchrun.sbatch asks): torchrun hands
    each signal to both processes (each in a session of its own, with its helpers), which stop
    after the same step with one line and a checkpoint; the job resumed twice ends with the
    uninterrupted job's weights. torchrun itself ends with its own report of the signal (its
    SignalException), which is all it prints as a traceback."""
    env = {**plain_env(), "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}    # (as the script does)
    run = tmp_path / "cut"
    first = torchrun_cmd(*TWO, "--data-dir", fashion_small, "--log-every", "1", "--out", run, launcher=launch())
    again = torchrun_cmd("--resume", run, "--data-dir", fashion_small, "--device", "cpu", "--log-every", "1",
                         launcher=launch())
    stops = cut_and_resume(first, again, [(signal.SIGINT, 3, 0), (signal.SIGUSR1, 8, 0)], 32, env=env,
                           launcher="torchrun")
    assert stops[0] < stops[1]
    assert equal_weights(whole_two, run)


def worker_pids(agent_pid: int) -> list[tuple[int, int]]:
    from test_distributed import worker_pids as by_rank
    return sorted(by_rank(agent_pid).items())



def test_a_trainer_killed_outright_leaves_none_of_its_helpers_running(jpeg32, tmp_path):
    """SIGKILL to a streamed run's trainer alone (what the out-of-memory killer does): its data
    workers, forked by the fork server rather than by the trainer, end with it, and then the
    server and the resource tracker do; nothing of the run is left holding memory or its pipes."""
    cmd = [sys.executable, "-m", "speedrun", "train", *STREAMED, "--data-dir", str(jpeg32), "--log-every", "1",
           "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=plain_env(),
                            start_new_session=True)
    for line in proc.stdout:
        if "step 12/" in line:                      # (the training and the evaluation workers both started)
            helpers = descendants(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert len(helpers) >= 6, helpers         # the server, the tracker, two workers each for training and evaluation
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in helpers if Path(f"/proc/{pid}").exists()]
    assert not left, f"still running after the trainer was killed: {left}"
    proc.stdout.close()


@pytest.mark.parametrize("wait", ["pidfd", "poll"])
def test_a_worker_learns_of_its_trainers_end_with_or_without_a_pidfd(wait):
    """How a worker waits for its trainer's end (speedrun.stop_signals.wait_until_gone): the
    kernel's pidfd, or, on a kernel without pidfd_open (Linux before 5.3) or where a container
    forbids it, a check every poll interval; each returns once a real process has ended, not
    before."""
    import threading
    from speedrun.stop_signals import poll_until_gone, wait_until_gone
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    waiter = threading.Thread(target=(lambda: wait_until_gone(proc.pid)) if wait == "pidfd"
                              else (lambda: poll_until_gone(proc.pid, 0.05)), daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()                            # the process still runs
    proc.kill()
    proc.wait()
    waiter.join(5)
    assert not waiter.is_alive()


def test_ranks_agree_on_a_stop_in_an_evaluation_whatever_their_numbers_of_batches(tmp_path):
    """Two gloo processes under torchrun (tests/stop_agreement_job.py) run the engine's
    evaluation with the training loop's stop check over 3 and 1 batches (as a streamed rank's
    empty share of a short last batch leaves one rank fewer), or 2 and none, with a real
    SIGUSR1 that one rank sends itself: no signal, or one that comes as every rank's last batch
    is evaluated, lets both complete; one that reaches a rank while the other still evaluates
    (the rank past its last batch, or the one evaluating) stops both. Neither waits for ever."""
    import json
    job = Path(__file__).with_name("stop_agreement_job.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *launch(), "--nproc-per-node", "2",
                           str(job), str(tmp_path)], capture_output=True, text=True, env=plain_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert r0["uneven, no signal"] == {"complete": 15, "checks": 4, "received": None}
    assert r1["uneven, no signal"] == {"complete": 5, "checks": 2, "received": None}
    case = "the rank past its last batch is signalled while the other evaluates"
    assert r0[case] == {"stopped": "SIGUSR1", "checks": 2, "received": None}
    assert r1[case] == {"stopped": "SIGUSR1", "checks": 2, "received": "SIGUSR1"}
    case = "the evaluating rank is signalled while the other waits"
    assert r0[case] == {"stopped": "SIGUSR1", "checks": 3, "received": "SIGUSR1"}
    assert r1[case] == {"stopped": "SIGUSR1", "checks": 2, "received": None}
    case = "a signal during the last batch of all"
    assert r0[case] == {"complete": 15, "checks": 4, "received": "SIGUSR1"}
    assert r1[case] == {"complete": 5, "checks": 2, "received": None}
    case = "a rank with no batch at all"
    assert (r0[case], r1[case]) == ({"complete": 10, "checks": 3, "received": None},
                                    {"complete": 0, "checks": 1, "received": None})


def test_a_signal_to_one_of_two_processes_in_the_final_evaluation_stops_both(fashion_long_test, tmp_path):
    """torchrun, gloo: SIGUSR1 to rank 1 alone once the training is over (rank 0's steps.csv
    written), during the final evaluation that the two ranks share: both stop in it, after the
    same batch, and exit resumable; rank 0 writes the trained weights and a checkpoint with each
    rank's part, and the resumed job evaluates the same weights and finishes its record."""
    run = tmp_path / "cut"
    agent = subprocess.Popen(torchrun_cmd(*LONG_FINAL, "--data-dir", fashion_long_test, "--loggers", "csv", "--out", run,
                                          launcher=launch()),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=plain_env())
    steps = run / "steps.csv"
    while not (steps.is_file() and "\n8," in steps.read_text()):
        assert agent.poll() is None, agent.communicate()
        time.sleep(0.002)
    os.kill(dict(worker_pids(agent.pid))[1], signal.SIGUSR1)
    out, err = agent.communicate(timeout=300)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert codes and set(codes) == {str(RESUMABLE_EXIT)}, err[-4000:]
    m = IN_EVALUATION.search(out)
    assert m and m.group(1, 2, 3) == ("SIGUSR1", "the final evaluation", "8") and out.count("speedrun: stopped") == 1, \
        out[-3000:]
    assert "final evaluation done" not in out and "(under torchrun or srun, the same launch with --resume)" in out
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["interrupted"]["training_complete"] and len(state["ranks"]) == 2
    stopped = torch.load(run / "model.pt", weights_only=True)
    resumed = subprocess.run(torchrun_cmd("--resume", run, "--data-dir", fashion_long_test, "--device", "cpu",
                                          launcher=launch()), capture_output=True, text=True, env=plain_env(),
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "final evaluation done" in resumed.stdout
    final = torch.load(run / "model.pt", weights_only=True)
    assert final.keys() == stopped.keys() and all(torch.equal(final[k], stopped[k]) for k in final)
    s = summary(run)
    assert s["world_size"] == 2 and s["test_images"] == 10_000 and s["resumed_from_step"] == 8
