"""A run stopped by a signal at a step boundary, as a cluster or a user stops it: real
processes signalled mid-epoch once their progress lines say so, the resumable exit code, the
one line naming the checkpoint, and a resume that ends with the weights of an uninterrupted
run bit for bit (resident and streamed data, one process and two under torchrun)."""
import os
import re
import signal
import subprocess
import sys
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
            "--set", "data.batch_size=64", "--set", "eval.tta=none", "--set", "eval.every=0",
            "--set", "train.epochs=1", "--set", "data.workers=1"]
"""the 512-image JPEG folder (--data-dir jpeg32), decoded by a worker process: 8 steps."""
LINE = re.compile(r"speedrun: stopped by (SIG\w+) after step (\d+) of (\d+); checkpoint: (\S+); "
                  r"continue with `speedrun train --resume (\S+)`")


def plain_env() -> dict:
    """This environment without a launcher's variables (no SLURM job to requeue)."""
    return {k: v for k, v in job_env().items() if not k.startswith("SLURM_")}


def signalled(cmd: list, sig: int, after_step: int, whole_group: bool = False, env=None):
    """Run ``cmd`` (which prints a progress line per step), send ``sig`` once it reports step
    ``after_step``, and wait for it: (exit code, stdout, stderr). ``whole_group``: signal every
    process of its group (its data workers too), as a terminal's Ctrl-C and SLURM do."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or plain_env(), start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r"step (\d+)/", line)
        if m and int(m.group(1)) >= after_step:
            (os.killpg if whole_group else os.kill)(proc.pid, sig)
            break
    out, err = proc.communicate(timeout=300)
    return proc.returncode, "".join(seen) + out, err


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


@pytest.mark.parametrize("sig, periodic", [(signal.SIGTERM, []), (signal.SIGUSR1, ["checkpoint.every_steps=3"])],
                         ids=["SIGTERM-no-periodic-checkpoints", "SIGUSR1-after-a-periodic-checkpoint"])
def test_a_signalled_run_stops_at_a_step_with_a_checkpoint_and_resumes_bit_for_bit(fashion_small, tmp_path, sig,
                                                                                   periodic, whole):
    """... to the bit of the run that was never stopped (and, with periodic checkpoints, of one
    that wrote none: writing them changes no weight)."""
    args = [*RESIDENT, "--data-dir", str(fashion_small), *sum((["--set", s] for s in periodic), [])]
    run = tmp_path / "cut"
    rc, out, err = signalled([sys.executable, "-m", "speedrun", "train", *args, "--log-every", "1", "--out", str(run)],
                             sig, after_step=4)
    step = check_stopped(rc, out, err, sig, run, 8, 4)
    assert step > 3            # after the last periodic checkpoint before the signal (step 3), where there is one
    speedrun("train", "--resume", run, "--data-dir", fashion_small, env=plain_env())
    assert equal_weights(whole, run)


def test_a_signal_during_the_final_evaluation_lets_the_run_finish_and_says_so(fashion_small, tmp_path):
    """After the last step there is nothing left to resume: the evaluation ends, the record is
    written, exit 0, and a line says the signal came too late to stop anything."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "speedrun", "train", *RESIDENT, "--data-dir", str(fashion_small), "--set",
           "eval.tta=flip_translate", "--out", str(run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=plain_env())
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "final evaluation:" in line:
            os.kill(proc.pid, signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    out = "".join(seen) + out
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert (f"speedrun: SIGTERM arrived after the last training step: the run finished its final evaluation and "
            f"its record in {run} is complete") in out
    assert (run / "summary.json").is_file() and (run / "model.pt").is_file() and not LINE.search(out)


def test_a_streamed_run_signalled_with_its_workers_stops_and_resumes_bit_for_bit(jpeg32, tmp_path):
    """SIGTERM to the whole process group: the data worker leaves it to the trainer."""
    args = [*STREAMED, "--data-dir", str(jpeg32)]
    whole = subprocess.Popen([sys.executable, "-m", "speedrun", "train", *args, "--out", str(tmp_path / "whole")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=plain_env())
    run = tmp_path / "cut"
    rc, out, err = signalled([sys.executable, "-m", "speedrun", "train", *args, "--log-every", "1", "--out", str(run)],
                             signal.SIGTERM, after_step=3, whole_group=True)
    check_stopped(rc, out, err, signal.SIGTERM, run, 8, 3)
    speedrun("train", "--resume", run, "--data-dir", jpeg32, env=plain_env())
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    assert equal_weights(tmp_path / "whole", run)


def test_a_signal_to_one_of_two_processes_stops_both_at_the_same_step(fashion_small, tmp_path):
    """torchrun, gloo: SIGUSR1 to rank 1 alone; both ranks stop after the same step (rank 0's
    line names it), rank 0 writes the checkpoint, both exit resumable, and the resumed job ends
    with the uninterrupted job's weights, every tensor bit for bit (the batch-norm running
    statistics, which each rank keeps of its own batches, come back to each rank from the
    checkpoint's per-rank part)."""
    # 32 steps: torchrun relays the progress lines late, so the signal may land some steps after the
    # line that prompted it
    args = [*RESIDENT, "--set", "train.epochs=2", "--data-dir", fashion_small]
    launch = lambda: ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval",
                      "0.2"]
    whole = subprocess.Popen(torchrun_cmd(*args, "--out", tmp_path / "whole", launcher=launch()),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=plain_env())
    run = tmp_path / "cut"
    agent = subprocess.Popen(torchrun_cmd(*args, "--log-every", "1", "--out", run, launcher=launch()),
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
    assert whole.wait(timeout=300) == 0, whole.stderr.read()[-4000:]
    ranks = torch.load(run / "checkpoint.pt", weights_only=True)["ranks"]
    assert len(ranks) == 2 and not all(torch.equal(a, b) for a, b in zip(ranks[0]["buffers"].values(),
                                                                          ranks[1]["buffers"].values()))
    assert equal_weights(tmp_path / "whole", run)


def worker_pids(agent_pid: int) -> list[tuple[int, int]]:
    from test_distributed import worker_pids as by_rank
    return sorted(by_rank(agent_pid).items())

