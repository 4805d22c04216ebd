"""A run stopped by a signal at a step boundary, as a cluster or a user stops it: real
processes signalled mid-epoch once their progress lines say so, the resumable exit code, the
one line naming the checkpoint, and a resume that ends with the weights of an uninterrupted
run bit for bit (resident and streamed data, one process and two under torchrun)."""
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
        lines = LINE.findall(out)
        assert len(lines) == 1 and out.count("speedrun: stopped") == 1, said
        name, step, total, path, _ = lines[0]
        step = int(step)
        # a resumed run counts its progress lines on from the step it resumed at
        first = re.search(r"step (\d+)/", out)
        assert int(first.group(1)) == (stops[-1] + 1 if stops else 1), (stops, first.group(0))
        assert name == signal.Signals(sig).name and int(total) == steps and after <= step < steps
        # (the evaluation after an epoch ends before the next step, after which the run stops; on a
        # busy machine this process may read the line and send the signal a step or two late)
        assert not in_eval or step <= after + 3, (name, after, step)
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
    every helper leaves the stop to the trainer, which checkpoints at the next step boundary, and
    the run resumed six times ends with the uninterrupted run's weights, every tensor."""
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
