"""The documented sbatch scripts on a real SLURM: Debian's munged, slurmctld and slurmd, started
here for this one host (everything under one temporary folder: configuration, key, state, logs,
with free ports), run scripts/speedrun.sbatch and scripts/speedrun-torchrun.sbatch with two CPU
processes to finished run records. CI installs the packages (.ci/run); without them these tests
fail, saying so. slurmd must run as root (it starts jobs as the submitting user)."""
from __future__ import annotations

import json
import os
import pwd
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel", "scontrol", "srun")
TINY = ["--set", "data.dataset=npz", "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=256",
        "--set", "train.epochs=1", "--device", "cpu"]
"""fashion-mnist on the 1,024-image slice: 4 steps of 256 images, 128 per process."""
CPU_JOB = ["--nodes", "1", "--time", "5"]
"""What every test job asks of sbatch: this one node, and a time limit so a hung job ends."""


def program(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")
    if not path:
        pytest.fail(f"{name} is not installed: these tests run a real SLURM on this machine; install it with "
                    "`apt-get install slurm-wlm munge` (as root, like .ci/run does)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def foreign_launcher_free(env: dict) -> dict:
    """The environment without the variables of a launcher this test itself may run under, so
    the job sees only what its own SLURM sets."""
    prefixes = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "TORCHELASTIC_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in env.items() if not k.startswith(prefixes) and k not in names}


class LocalSlurm:
    """munged, slurmctld and slurmd for this host alone, each a child process of the tests run
    in the foreground, all their files under ``root``."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.daemons: dict[str, subprocess.Popen] = {}

    # --- configuration --------------------------------------------------------------------
    def write_config(self) -> None:
        cpus = self._detected_cpus()
        first_job = random.randrange(1, 1000) * 10 + 100_000    # other clusters of this session differ
        lines = [
            "ClusterName=speedruntest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # a requeued job waits out the credentials' lifetime before it starts again (120 s by
            # default, 5 s here)
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            # ... and then for a scheduler pass to start it: the main one every second (60 s by
            # default, the backfill pass every 30 s), so it starts as its credentials expire
            "SchedulerParameters=sched_interval=1",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'slurmd.log'}",
            # no cgroups, no CPU binding, no accounting: processes are tracked by their parents
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            # finished jobs leave the controller after 5 s, so `sbatch --wait` polls every 2 s
            # (it backs off to 32 s when MinJobAge allows)
            "MinJobAge=5",
            f"FirstJobId={first_job}",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=local Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        # Slurm 22.05 loads a cgroup plugin even when no other plugin uses it ('disabled' came
        # later); the v1 plugin only loads, it touches no cgroup file with the plugins above.
        (self.root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        for d in ("state", "spool"):
            (self.root / d).mkdir()

    def _detected_cpus(self) -> int:
        """The CPUs slurmd will find here (`slurmd -C`): configuring more drains the node."""
        out = subprocess.run([program("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return int(fields.get("CPUs", os.cpu_count() or 1))

    @property
    def env(self) -> dict:
        return {**foreign_launcher_free(os.environ), "SLURM_CONF": str(self.conf)}

    # --- daemons --------------------------------------------------------------------------
    def start(self) -> None:
        self._start_munge()
        self._spawn("slurmctld", [program("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [program("slurmd"), "-D", "-f", str(self.conf), "-N", self.host])
        self._wait_for_idle_node(timeout=60)

    def _start_munge(self) -> None:
        """munged with a key of its own on a socket of its own, as the munge user (it refuses a
        key or socket folder others could change)."""
        folder = self.munge_socket.parent
        folder.mkdir(mode=0o755)
        key = folder / "munge.key"
        subprocess.run([program("mungekey"), "--create", "--keyfile", str(key)], check=True, timeout=30)
        munge = pwd.getpwnam("munge")
        for path in (folder, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        self._spawn("munged", [program("munged"), "--foreground", "--socket", str(self.munge_socket),
                               "--key-file", str(key), "--pid-file", str(folder / "munged.pid"),
                               "--seed-file", str(folder / "munged.seed"), "--log-file", str(folder / "munged.log")],
                    user=munge.pw_uid, group=munge.pw_gid)
        self._wait(lambda: self.munge_socket.exists(), 20, "munged did not create its socket")

    def _spawn(self, name: str, cmd: list[str], **kw) -> None:
        out = open(self.root / f"{name}.out", "wb")
        self.daemons[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                              cwd=self.root, **kw)
        out.close()

    def _wait_for_idle_node(self, timeout: float) -> None:
        def idle():
            out = subprocess.run([program("sinfo"), "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                                 env=self.env, timeout=20).stdout.split()
            return out == ["idle"]
        self._wait(idle, timeout, f"node {self.host} did not come up idle (sinfo)")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"{what}{'; ' + ', '.join(dead) + ' exited' if dead else ''}\n{self.logs()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel what still runs, then end the daemons, newest first."""
        if "slurmd" in self.daemons and self.daemons["slurmd"].poll() is None:
            subprocess.run([program("scancel"), "--full", "--partition", "local"], env=self.env,
                           capture_output=True, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.jobs():
                time.sleep(0.5)
        for proc in reversed(list(self.daemons.values())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

    def jobs(self) -> list[str]:
        out = subprocess.run([program("squeue"), "-h", "-o", "%i %T"], capture_output=True, text=True,
                             env=self.env, timeout=20)
        return out.stdout.splitlines() if out.returncode == 0 else []

    def logs(self, lines: int = 40) -> str:
        parts = []
        for path in sorted(self.root.rglob("*.log")) + sorted(self.root.glob("*.out")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name} ---\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- jobs -----------------------------------------------------------------------------
    def sbatch_wait(self, options: list, script: Path, args: list, cwd: Path, env: dict | None = None):
        """Submit ``script`` with ``args`` and wait for the job to end: (job id, exit code, log)."""
        cmd = [program("sbatch"), "--wait", "--parsable", "--output", str(cwd / "slurm-%j.out"),
               *map(str, options), str(script), *map(str, args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env={**self.env, **(env or {})},
                              timeout=300)
        job = proc.stdout.strip().split(";")[0]
        log = cwd / f"slurm-{job}.out"
        text = log.read_text(errors="replace") if job and log.is_file() else ""
        return job, proc.returncode, f"sbatch: {proc.stderr.strip()}\n--- job log ---\n{text}"


@pytest.fixture(scope="module")
def slurm():
    """A running one-node SLURM for this module's tests, ended and removed afterwards."""
    for name in PROGRAMS:
        program(name)
    if os.geteuid() != 0:
        pytest.fail("slurmd must run as root to start jobs; run these tests as root (CI does)")
    try:
        socket.gethostbyname(socket.gethostname().split(".")[0])
    except OSError:
        pytest.fail(f"this host's name {socket.gethostname()!r} does not resolve: jobs find their first node by "
                    "name (add it to /etc/hosts)")
    root = Path(tempfile.mkdtemp(prefix="speedrun-slurm-"))
    root.chmod(0o755)                                   # munged checks every folder above its socket
    cluster = LocalSlurm(root)
    try:
        cluster.write_config()
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def read_summary(folder: Path, log: str) -> dict:
    path = folder / "summary.json"
    assert path.is_file(), f"no run record at {folder}:\n{log}"
    return json.loads(path.read_text())


def test_sbatch_script_trains_with_two_srun_tasks(slurm, fashion_small, tmp_path):
    """scripts/speedrun.sbatch: srun starts 2 processes; speedrun reads SLURM's variables and
    meets at the first node on port 20000 + job id % 10000."""
    cpu = ["--ntasks-per-node", "2", "--cpus-per-task", "1", "--gpus-per-task", "0"]
    job, rc, log = slurm.sbatch_wait([*CPU_JOB, *cpu], REPO / "scripts" / "speedrun.sbatch",
                                     ["fashion-mnist", "--data-dir", fashion_small, *TINY, "--out", tmp_path / "run"],
                                     cwd=tmp_path, env={"SPEEDRUN_PYTHON": sys.executable})
    assert rc == 0, f"job {job} failed ({rc}):\n{log}\n{slurm.logs()}"
    s = read_summary(tmp_path / "run", log)
    assert (s["launcher"], s["world_size"], s["nodes"], s["processes_per_node"]) == ("slurm", 2, 1, 2), s
    assert (s["per_rank_batch"], s["batch_size"], s["steps"], s["backend"]) == (128, 256, 4, "gloo"), s
    assert 0.0 <= s["test_acc"] <= 1.0
    # only rank 0 writes and prints: one table, naming both processes
    assert log.count("test accuracy") == 1 and "2 (128 images each per step, 1 node)" in log, log


def submit_signal_and_wait(slurm, tmp_path, script: str, sbatch: list, args: list, run: Path | None, env: dict):
    """Submit ``script`` with ``args`` (48 steps, a progress line each), send the job SIGUSR1 once it
    is past step 3 (`scancel --signal=USR1`, as its --signal line has SLURM do ahead of the time
    limit), wait until the requeued job has finished ``run`` (None: the folder named by the job
    id); (job id, the log's text, the step the stop line names)."""
    submitted = subprocess.run([program("sbatch"), "--parsable", "--output", str(tmp_path / "slurm-%j.out"), *CPU_JOB,
                                *sbatch, str(REPO / "scripts" / script), *map(str, args)], capture_output=True,
                               text=True, cwd=tmp_path, env={**slurm.env, **env}, timeout=60)
    job = submitted.stdout.strip().split(";")[0]
    assert submitted.returncode == 0 and job, submitted.stderr
    log = tmp_path / f"slurm-{job}.out"
    text = lambda: log.read_text(errors="replace") if log.is_file() else ""
    deadline = time.monotonic() + 240
    while not re.search(r"step ([3-9]|[1-3]\d)/48", text()):
        assert time.monotonic() < deadline and "test accuracy" not in text(), f"{text()}\n{slurm.logs()}"
        time.sleep(0.1)
    subprocess.run([program("scancel"), "--signal=USR1", job], env=slurm.env, check=True, timeout=30)
    run = run or tmp_path / "runs" / f"fashion-mnist-{job}"
    while not (run / "summary.json").exists() or any(line.split()[0] == job for line in slurm.jobs()):
        assert time.monotonic() < deadline + 180, f"job {job} did not finish:\n{text()}\n{slurm.logs()}"
        time.sleep(0.5)
    stopped = re.search(rf"stopped by SIGUSR1 after step (\d+) of 48; .*SLURM job {job} requeued", text())
    assert stopped and text().count("speedrun: stopped by") == 1, f"{text()}\n{slurm.logs()}"     # rank 0 says it
    return job, text(), int(stopped.group(1))


@pytest.mark.slow
def test_torchrun_sbatch_script_trains_two_processes_and_a_signalled_job_requeues_itself(slurm, fashion_small,
                                                                                         tmp_path):
    """scripts/speedrun-torchrun.sbatch: one srun task runs torchrun with 2 processes, which meet
    at a c10d rendezvous named by the job id; without --out the run folder is named by it too.
    SIGUSR1 mid-epoch (the script's --signal line) reaches both processes through torchrun: they
    stop after the same step, rank 0 checkpoints and requeues the job, and the job, started
    again, continues the same folder to the end."""
    env = {"SPEEDRUN_PYTHON": sys.executable, "SPEEDRUN_NPROC_PER_NODE": "2", "SPEEDRUN_RDZV_PORT": str(free_port())}
    args = ["fashion-mnist", "--data-dir", fashion_small, "--device", "cpu", "--seed", "4", "--set", "data.dataset=npz",
            "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=64", "--set", "eval.tta=none",
            "--set", "train.epochs=3", "--log-every", "1"]          # 48 steps, 16 an epoch, 32 images a process
    job, text, step = submit_signal_and_wait(slurm, tmp_path, "speedrun-torchrun.sbatch",
                                             ["--gpus-per-node", "0", "--cpus-per-task", "2"], args, None, env)
    run = tmp_path / "runs" / f"fashion-mnist-{job}"
    s = read_summary(run, text)
    assert (s["launcher"], s["world_size"], s["nodes"], s["processes_per_node"]) == ("torchrun", 2, 1, 2), s
    assert (s["per_rank_batch"], s["batch_size"], s["backend"]) == (32, 64, "gloo"), s
    assert s["resumed_from_step"] == step < 48 and s["steps"] == 48, s
    assert text.count("test accuracy") == 1 and "2 (32 images each per step, 1 node)" in text, text


@pytest.mark.slow
def test_a_job_signalled_before_its_time_limit_requeues_itself_and_ends_with_the_uninterrupted_weights(
        slurm, fashion_small, tmp_path):
    """scripts/speedrun.sbatch with one task: SIGUSR1 (what its --signal line asks for ahead of the
    time limit) once the run is mid-epoch; the job checkpoints, requeues itself, starts again,
    continues its --out folder and finishes with the weights of an uninterrupted run."""
    import torch
    args = ["fashion-mnist", "--data-dir", fashion_small, "--device", "cpu", "--seed", "4", "--set", "data.dataset=npz",
            "--set", "model.widths=[16,32,32]", "--set", "data.batch_size=32", "--set", "eval.tta=none",
            "--set", "train.epochs=1.5"]                                    # 48 steps, 32 an epoch
    whole = subprocess.Popen([sys.executable, "-m", "speedrun", "train", *map(str, args), "--out",
                              str(tmp_path / "whole")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**foreign_launcher_free(os.environ), "OMP_NUM_THREADS": "1"})   # as the job's task
    run = tmp_path / "run"
    cpu = ["--ntasks-per-node", "1", "--cpus-per-task", "1", "--gpus-per-task", "0"]
    job, text, step = submit_signal_and_wait(slurm, tmp_path, "speedrun.sbatch", cpu,
                                             [*args, "--log-every", "1", "--out", run], run,
                                             {"SPEEDRUN_PYTHON": sys.executable})
    s = read_summary(run, text)
    assert s["resumed_from_step"] == step and s["steps"] == 48, s
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(run / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_task_srun_gave_one_gpu_uses_it(monkeypatch):
    """`srun --gpus-per-task=1` (scripts/speedrun.sbatch) shows each task only its own GPU, as
    its device 0: local rank 1 uses that one instead of failing for want of a second GPU. There
    is no GPU here, so torch is told the counts such processes see."""
    import torch

    from speedrun.engine.distributed import World, bind_device
    from speedrun.errors import DistributedError
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    second = dict(rank=3, size=4, local_rank=1, local_size=2, nodes=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bind_device(World(**second, launcher="slurm"), torch.device("cuda")) == torch.device("cuda", 0)
    with pytest.raises(DistributedError, match="local rank 1, but this node has 1 GPUs"):
        bind_device(World(**second, launcher="torchrun"), torch.device("cuda"))   # two processes, one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert bind_device(World(**second, launcher="slurm"), torch.device("cuda")) == torch.device("cuda", 1)
    assert chosen == [0, 1]
