"""Data-parallel training with real processes: torchrun and gloo on this CPU, two hosts in
network namespaces, a worker killed mid-run, a rank started with another seed."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speedrun.data.pipeline.shard import Shard
from speedrun.recipe import load_recipe

SMALL = ["--set", "data.dataset=npz", "--set", "model.widths=[8,16,16]", "--set", "eval.tta=flip",
         "--device", "cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return out


def torchrun_cmd(*args, nproc: int = 2, launcher=()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *(launcher or ["--standalone"]),
            "--nproc-per-node", str(nproc), "-m", "speedrun", "train", *map(str, args)]


def processes() -> dict[int, tuple[str, int]]:
    """Every process on this machine: pid -> (name, parent pid), from /proc."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:                                   # ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[int(pid)] = (name, int(rest[1]))
    return out


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first)."""
    parents = {p: parent for p, (_, parent) in processes().items()}
    out, todo = [], [pid]
    while todo:
        this = todo.pop(0)
        kids = [p for p, parent in parents.items() if parent == this]
        out += kids
        todo += kids
    return out


def run(cmd, timeout=300, **kw):
    """``cmd`` to the end. One that hangs past ``timeout`` fails the test with the Python stack of
    every thread of every process it started (PYTHONFAULTHANDLER: each dumps them on SIGABRT),
    so that a rare hang in CI can be read from its log."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env(PYTHONFAULTHANDLER="1"), **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [*reversed(descendants(proc.pid)), proc.pid]:       # the deepest first
                try:
                    os.kill(pid, signal.SIGABRT)
                except ProcessLookupError:
                    pass
            try:
                out, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            pytest.fail(f"hung for {timeout} s: {' '.join(map(str, cmd))}\n{out[-3000:]}\n{err[-20000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def single(*args, timeout=300):
    return run([sys.executable, "-m", "speedrun", "train", *map(str, args)], timeout)


def weights(folder: Path) -> dict:
    return {k: v for k, v in torch.load(folder / "model.pt", weights_only=True).items() if v.is_floating_point()}


def relative_difference(a: dict, b: dict) -> float:
    fa, fb = (torch.cat([d[k].double().flatten() for k in sorted(a)]) for d in (a, b))
    return float((fa - fb).norm() / fa.norm())


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def logged_steps(folder: Path) -> list[int]:
    """The step numbers in a run's steps.csv (--log csv), in file order."""
    return [int(line.split(",")[0]) for line in (folder / "steps.csv").read_text().splitlines()[1:]]


def ok(proc) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-12000:]}"
    return proc.stdout


# ------------------------------------------------------------------------------------------
# sharding (no processes needed)
# ------------------------------------------------------------------------------------------

def test_ranks_share_every_micro_batch_so_together_they_see_what_one_process_sees():
    for world, micro, batch in [(2, 1, 256), (4, 2, 64), (3, 1, 10), (2, 4, 32)]:
        shares = [Shard(r, world, micro).train_positions(batch) for r in range(world)]
        flat = [list(range(batch)[s]) if isinstance(s, slice) else list(s) for s in shares]
        assert sorted(sum(flat, [])) == list(range(batch))              # disjoint, complete
        if micro > 1:     # rank r's j-th micro-batch lies inside the global j-th micro-batch
            m = batch // micro
            for pos in flat:
                per = len(pos) // micro
                assert all(j * m <= p < (j + 1) * m for j in range(micro) for p in pos[j * per:(j + 1) * per])
    assert Shard(0, 1, 4).train_positions(32) == slice(0, 32)


# ------------------------------------------------------------------------------------------
# acceptance 1: two processes train what one process trains
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory, fashion_small):
    """One process and two (torchrun, gloo) at the same global batch, batch norm synchronised
    across the processes, with gradient accumulation (no_sync on the first micro-batch). In fp32:
    bf16's rounding of activations makes the two differ by ~1e-3 after these 8 steps whatever DDP
    does (measured where "auto" picks bf16)."""
    root = tmp_path_factory.mktemp("ddp")
    common = ["fashion-mnist", "--data-dir", fashion_small, *SMALL, "--set", "data.batch_size=256",
              "--set", "train.epochs=2", "--set", "train.accumulate=2", "--set", "runtime.precision=fp32",
              "--set", "eval.tta_fraction=1.0",                       # (partial TTA picks per rank's share)
              "--set", "model.norm.sync_ranks=0"]                     # (the last two are replaced below)
    ok(single(*common, "--out", root / "one"))
    two = run(torchrun_cmd(*common, "--out", root / "two", "--loggers", "csv"))
    ok(two)
    local = run(torchrun_cmd(*common[:-2], "--set", "model.norm.sync_ranks=1", "--out", root / "local"))
    ok(local)
    return root, two, common


def test_two_processes_train_the_same_weights_as_one(one_and_two):
    root, _, _ = one_and_two
    one, two = summary(root / "one"), summary(root / "two")
    assert one["steps"] == two["steps"] == 8 and one["batch_size"] == two["batch_size"] == 256
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert (one["per_rank_batch"], two["per_rank_batch"]) == (256, 128)
    diff = relative_difference(weights(root / "one"), weights(root / "two"))
    assert diff < 1e-5, diff
    # every test image counted exactly once, on both ranks' shares together
    assert one["test_acc"] == pytest.approx(two["test_acc"], abs=1 / 256 + 1e-9)


def test_the_comparison_can_fail_batch_norm_per_process_trains_other_weights(one_and_two):
    root, _, _ = one_and_two
    assert summary(root / "local")["norm_sync_ranks"] == 1
    assert relative_difference(weights(root / "one"), weights(root / "local")) > 1e-3


def test_only_rank_0_prints_and_the_record_names_the_job(one_and_two):
    root, two, _ = one_and_two
    s = summary(root / "two")
    assert (s["launcher"], s["backend"], s["nodes"], s["processes_per_node"]) == ("torchrun", "gloo", 1, 2)
    assert s["bucket_mb"] == 25.0 and s["compression"] == "none" and s["norm_sync_ranks"] == 0
    assert two.stdout.count("test accuracy") == 1 and two.stdout.count("epoch 2/2 done") == 1
    assert "2 (128 images each per step, 1 node)" in two.stdout
    assert sorted(p.name for p in (root / "two").iterdir()) == ["config.toml", "epochs.csv", "metrics.jsonl",
                                                                 "model.pt", "preprocessing.json", "steps.csv",
                                                                 "summary.json"]
    # --log csv (spelt --loggers: torchrun's parser takes --log for an abbreviation of its --log-dir):
    # rank 0 alone logs each step once (two writers would append every row twice)
    assert logged_steps(root / "two") == list(range(1, 9))


@pytest.mark.parametrize("field", ["distributed.compression=bf16"])
def test_compressed_gradients_train_nearly_the_same_weights(one_and_two, field):
    """bf16 all-reduce (our hook on gloo; small buckets, so several per step): not bit-identical
    to fp32 all-reduce, but close. (fp16, torch's own hook, runs in the two-hosts test.)"""
    root, _, common = one_and_two
    precision = field.split("=")[1]
    out = root / f"two-{precision}"
    ok(run(torchrun_cmd(*common, "--set", field, "--set",
                        "distributed.bucket_mb=0.01", "--set", "distributed.backend=gloo", "--out", out)))
    s = summary(out)
    assert s["compression"] == precision and s["bucket_mb"] == 0.01 and s["backend"] == "gloo"
    diff = relative_difference(weights(root / "two"), weights(out))
    assert 1e-7 < diff < 2e-2, diff


def test_a_batch_that_does_not_split_over_the_processes_is_refused(tmp_path, fashion_small):
    odd = run(torchrun_cmd("fashion-mnist", "--data-dir", fashion_small, *SMALL, "--set", "train.epochs=1",
                           "--set", "data.batch_size=255", "--out", tmp_path / "odd"))
    assert odd.returncode != 0
    ours = [line for line in odd.stderr.splitlines() if line.startswith("speedrun: ")]
    # each rank refuses; the first to exit ends the job, so the other may be stopped before it prints
    assert 1 <= len(ours) <= 2 and all("data.batch_size=255 does not split evenly over 2 processes" in x
                                       for x in ours)
    # the one traceback is torchrun's own report of the failed workers, not ours
    assert odd.stderr.count("Traceback") == 1 and "ChildFailedError" in odd.stderr
    assert not (tmp_path / "odd").exists()


def test_compiled_ddp_refuses_buckets_smaller_than_ddps_first_one(tmp_path, fashion_small):
    """dynamo's DDP graph splitter asserts when the first bucket (1 MiB) is the larger one:
    the field is named instead, and nothing is written."""
    from speedrun.engine.distributed import check_compiled_buckets
    from speedrun.errors import RecipeError
    from speedrun.world import World
    two = World(rank=0, size=2)
    check_compiled_buckets(0.5, World(), compiled=True)             # one process: no DDP
    check_compiled_buckets(0.5, two, compiled=False)                # eager DDP takes any size
    check_compiled_buckets(1.0, two, compiled=True)
    with pytest.raises(RecipeError, match=r"\bdistributed\.bucket_mb=0\.5 is smaller than .* first gradient bucket"):
        check_compiled_buckets(0.5, two, compiled=True)
    proc = subprocess.run(torchrun_cmd("fashion-mnist", "--data-dir", fashion_small, *SMALL, "--set", "train.epochs=1",
                                       "--set", "runtime.compile=on", "--set", "distributed.bucket_mb=0.5",
                                       "--out", tmp_path / "small"),
                          capture_output=True, text=True, timeout=300, env=env(SPEEDRUN_COMPILE_BACKEND="aot_eager"))
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("speedrun: ")]
    assert ours and all("bucket_mb=0.5 is smaller than DistributedDataParallel" in x for x in ours), proc.stderr[-3000:]
    assert "AssertionError" not in proc.stderr
    assert not (tmp_path / "small").exists()


DDP_ADAMW = ["optim.name=adamw", "optim.lr=0.002", "optim.lr_scaling=sqrt", "optim.weight_decay=0.05",
             "optim.norm_bias_lr_mult=1.0", "optim.layer_decay=0.8"]


def test_a_streamed_folder_trains_the_same_on_two_processes_as_on_one(tmp_path, jpeg32):
    """JPEG folders through DataLoader workers: the sampler gives each rank its share of every
    batch (re-seeded per epoch), the validation set is split over the ranks and counted once.
    Trained with AdamW and layer decay (one_and_two trains SGD): the ranks' Adam moments and
    step counters, fed the all-reduced gradients, keep the weights one process trains. Adam
    divides each gradient element by its own running size, so the all-reduce's rounding moves
    the weights more than under SGD: on a 2-core Zen 3 these runs differed by 1.3e-5 (SGD's by
    5e-6; at the matrix entry's 40 times larger LR by 1e-3 to 4e-3, where one process run with 1
    and with 2 threads already differed by 1e-3), and by 4.4e-4 with batch norm per process."""
    common = ["folder", "--data-dir", jpeg32, "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=128",
              "--set", "eval.batch_size=100", "--set", "train.epochs=2", "--set", "data.workers=1",
              "--set", "model.norm.sync_ranks=0", "--set", "eval.tta=flip", "--device", "cpu",
              "--set", "runtime.precision=fp32",                      # (see one_and_two)
              *sum((["--set", s] for s in DDP_ADAMW), [])]
    ok(single(*common, "--out", tmp_path / "one"))
    ok(run(torchrun_cmd(*common, "--out", tmp_path / "two")))
    one, two = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert one["steps"] == two["steps"] == 8 and two["per_rank_batch"] == 64
    assert load_recipe(str(tmp_path / "two" / "config.toml")).optim.name == "adamw"
    assert relative_difference(weights(tmp_path / "one"), weights(tmp_path / "two")) < 1e-4
    # 512 validation images in batches of 100 (the last of 12), split over 2 ranks: counted once
    assert one["test_acc"] * 512 == pytest.approx(round(one["test_acc"] * 512))
    assert abs(one["test_acc"] - two["test_acc"]) <= 1 / 512 + 1e-9


@pytest.fixture(scope="module")
def emulated(tmp_path_factory, fashion_small):
    """LARS at a global batch of 1,024: two processes with 2 micro-batches of 256 each, and one
    process emulating them with 4 micro-batches; batch norm per micro-batch (as per GPU)."""
    root = tmp_path_factory.mktemp("emulated")
    common = ["fashion-mnist", "--data-dir", fashion_small, *SMALL, "--set", "data.batch_size=1024",
              "--set", "train.epochs=3", "--set", "optim.name=lars", "--set", "optim.lr=20.0",
              "--set", "optim.lr_scaling=sqrt", "--set", "optim.ref_batch=512",
              "--set", "schedule={kind='poly', warmup_epochs=1, power=2.0}", "--set", "train.label_smoothing=0.1"]
    ok(single(*common, "--set", "train.accumulate=4", "--out", root / "one"))
    ok(run(torchrun_cmd(*common, "--set", "train.accumulate=2", "--out", root / "two")))
    return root


def test_one_device_emulates_the_large_batch_of_several_with_accumulation(emulated):
    one, two = summary(emulated / "one"), summary(emulated / "two")
    assert one["steps"] == two["steps"] == 3 and one["batch_size"] == two["batch_size"] == 1024
    assert relative_difference(weights(emulated / "one"), weights(emulated / "two")) < 1e-5


def test_commands_that_run_in_one_process_refuse_a_multi_process_launch(tmp_path, fashion_small):
    for command in (["bench", "fashion-mnist", "--runs", "2"], ["ablate", "fashion-mnist", "--runs", "2"], ["flops", "fashion-mnist"]):
        proc = subprocess.run([sys.executable, "-m", "speedrun", *command, "--out", str(tmp_path / "x")]
                              if command[0] != "flops" else [sys.executable, "-m", "speedrun", *command],
                              capture_output=True, text=True, timeout=60, env=env(RANK="1", WORLD_SIZE="2"))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"speedrun: error: rank 1/2: speedrun {command[0]} ") and "torchrun" in proc.stderr
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------
# acceptance 2: two hosts (network namespaces joined by a veth pair)
# ------------------------------------------------------------------------------------------

@pytest.fixture
def two_hosts():
    """Two network namespaces, 10.231.0.1 and 10.231.0.2, joined by a veth pair (needs root);
    removed afterwards."""
    tag = f"sr{os.getpid() % 100000}"
    hosts = (f"{tag}a", f"{tag}b")
    sh = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True, text=True)
    try:
        for h in hosts:
            sh("netns", "add", h)
        sh("link", "add", f"{tag}-0", "type", "veth", "peer", "name", f"{tag}-1")
        for i, h in enumerate(hosts):
            sh("link", "set", f"{tag}-{i}", "netns", h)
            sh("-n", h, "addr", "add", f"10.231.0.{i + 1}/24", "dev", f"{tag}-{i}")
            sh("-n", h, "link", "set", f"{tag}-{i}", "up")
            sh("-n", h, "link", "set", "lo", "up")
        yield hosts
    finally:
        for h in hosts:
            subprocess.run(["ip", "netns", "del", h], capture_output=True)


def test_two_torchrun_agents_on_two_hosts_form_one_job(two_hosts, tmp_path, fashion_small):
    out = tmp_path / "two-hosts"
    agents = []
    for node, host in enumerate(two_hosts):
        launcher = ["--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "10.231.0.1:29400", "--rdzv-id", "two-hosts", "--local-addr",
                    f"10.231.0.{node + 1}", "--rdzv-conf", f"is_host={int(node == 0)}"]
        cmd = ["ip", "netns", "exec", host, *torchrun_cmd(
            "fashion-mnist", "--data-dir", fashion_small, *SMALL, "--set", "data.batch_size=256",
            "--set", "train.epochs=1", "--set", "distributed.compression=fp16", "--out", out, nproc=1,
            launcher=launcher)]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(
            GLOO_SOCKET_IFNAME=f"{two_hosts[0][:-1]}-{node}")))
    results = [a.communicate(timeout=240) for a in agents]
    for a, (o, e) in zip(agents, results):
        assert a.returncode == 0, f"{o[-2000:]}\n{e[-4000:]}"
    s = summary(out)
    assert (s["world_size"], s["nodes"], s["processes_per_node"], s["per_rank_batch"]) == (2, 2, 1, 128)
    assert s["launcher"] == "torchrun" and s["steps"] == 4 and s["compression"] == "fp16"
    printed = [o.count("test accuracy") for o, _ in results]
    assert sorted(printed) == [0, 1]


# ------------------------------------------------------------------------------------------
# acceptance 4: a worker dies mid-run
# ------------------------------------------------------------------------------------------

def worker_pids(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the speedrun processes below a torchrun agent."""
    found = {}
    for pid, (_, parent) in processes().items():
        if parent != agent_pid:
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = pid
    return found


def start_and_signal_rank_1(tmp_path, fashion_small, restarts: int, sig=signal.SIGKILL):
    """Start a 2-process job that checkpoints every 4 steps; once the first checkpoint is
    written, send rank 1 ``sig``. Returns (agent, run folder, {rank: pid}, time of the signal)."""
    out = tmp_path / "run"
    cmd = torchrun_cmd("fashion-mnist", "--data-dir", fashion_small, *SMALL, "--set", "data.batch_size=64",
                       "--set", "train.epochs=6", "--set", "checkpoint.every_steps=4",
                       "--set", "distributed.timeout_s=10", "--out", out, "--loggers", "csv",
                       launcher=["--standalone", "--max-restarts", str(restarts), "--monitor-interval", "0.2"])
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    deadline = time.monotonic() + 120
    while not (out / "checkpoint.pt").exists():
        assert agent.poll() is None, agent.communicate()
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.02)
    pids = worker_pids(agent.pid)
    assert set(pids) == {0, 1}, pids
    os.kill(pids[1], sig)
    return agent, out, pids, time.monotonic()


def start_and_kill_rank_1(tmp_path, fashion_small, restarts: int):
    """As above with SIGKILL; returns (agent, run folder, stdout, stderr, seconds from the kill
    to the job's end)."""
    agent, out, _, killed = start_and_signal_rank_1(tmp_path, fashion_small, restarts)
    o, e = agent.communicate(timeout=240)
    return agent, out, o, e, time.monotonic() - killed


def test_a_killed_worker_is_restarted_and_the_job_resumes_from_its_checkpoint(tmp_path, fashion_small):
    agent, out, o, e, _ = start_and_kill_rank_1(tmp_path, fashion_small, restarts=1)
    assert agent.returncode == 0, f"{o[-2000:]}\n{e[-4000:]}"
    s = summary(out)
    assert s["steps"] == 96 and s["world_size"] == 2
    assert s["resumed_from_step"] is not None and 4 <= s["resumed_from_step"] < 96
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert logged_steps(out) == list(range(1, 97))          # the restarted job's logs: every step once


def test_without_restarts_a_killed_worker_ends_the_job_naming_its_rank(tmp_path, fashion_small):
    agent, out, o, e, seconds = start_and_kill_rank_1(tmp_path, fashion_small, restarts=0)
    assert agent.returncode != 0 and seconds < 60
    assert re.search(r"rank\s*:?\s*1\b", e), e[-3000:]                 # torchrun's failure report
    assert (out / "checkpoint.pt").exists() and not (out / "summary.json").exists()


def test_a_hung_worker_ends_the_job_after_the_timeout(tmp_path, fashion_small):
    """Rank 1 stopped (SIGSTOP) mid-run: rank 0's collective times out after
    distributed.timeout_s (10 s) and it exits with an error, which ends the job: torchrun
    stops the other workers (a stopped one only dies once continued, or by the SIGKILL torchrun
    sends 30 s later; the test continues it to save those 30 s)."""
    agent, out, pids, stopped = start_and_signal_rank_1(tmp_path, fashion_small, restarts=0, sig=signal.SIGSTOP)
    while Path(f"/proc/{pids[0]}").exists() and time.monotonic() - stopped < 120:
        time.sleep(0.05)
    seconds = time.monotonic() - stopped
    os.kill(pids[1], signal.SIGCONT)
    o, e = agent.communicate(timeout=120)
    assert agent.returncode != 0 and 10 <= seconds < 40, seconds
    assert "speedrun: error: rank 0/2: rank 0 of 2 lost contact with the other processes" in e
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*exitcode\s*:\s*1\b", e), e[-3000:]
    assert (out / "checkpoint.pt").exists() and not (out / "summary.json").exists()


# ------------------------------------------------------------------------------------------
# acceptance 5: one rank started with another seed
# ------------------------------------------------------------------------------------------

def test_a_rank_started_with_another_seed_is_named_at_start(tmp_path, fashion_small):
    port = free_port()
    procs = []
    for rank, seed in [(0, 1), (1, 2)]:
        cmd = [sys.executable, "-m", "speedrun", "train", "fashion-mnist", "--data-dir", str(fashion_small), *SMALL,
               "--set", "data.batch_size=256", "--set", "train.epochs=1", "--seed", str(seed),
               "--out", str(tmp_path / "run")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port))))
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 1 and "Traceback" not in e, e
        assert "ranks [1] start from other weights than rank 0" in e and "--seed" in e
    assert outs[1][1].startswith("speedrun: error: rank 1/2:")
    assert not (tmp_path / "run").exists()
