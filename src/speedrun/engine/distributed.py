"""Data-parallel training on PyTorch's own engine: torch.distributed with the processes that
torchrun (or SLURM's srun) starts, gloo on CPUs and NCCL on GPUs.

Every process builds the same model from the same seed (no broadcast: a checksum compared
across ranks at the start proves it), trains on its own slice of every global batch, and
DistributedDataParallel averages the gradients, overlapped with the backward pass in
buckets of ``distributed.bucket_mb``. Only rank 0 prints and writes; evaluation is split
across ranks and the counts summed, so accuracy is over the whole test set exactly once.
"""
from __future__ import annotations

import os
import re
import subprocess
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import compat
from ..errors import DistributedError, RecipeError
from ..world import World, detect  # noqa: F401  (detect: part of this module's interface)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list ('node[07-09,12],gpu3' -> 'node07'), by `scontrol
    show hostnames` where it exists, else by reading the list's own syntax."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    m = re.match(r"([^\[]*)\[([^\]]+)\]", first)
    if not m:
        return first
    lo = m.group(2).split(",")[0].split("-")[0]
    return m.group(1) + lo


def rendezvous_from_slurm(env=None) -> None:
    """srun starts the processes but no rendezvous: rank 0's host (the first of the job's
    nodes) and a port derived from the job id, unless MASTER_ADDR / MASTER_PORT are set."""
    env = os.environ if env is None else env
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1")
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 10000)


def backend_for(choice: str, device: torch.device) -> str:
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if choice == "nccl" and device.type != "cuda":
        raise RecipeError("distributed.backend='nccl' needs CUDA devices; on CPUs use 'gloo' (or 'auto')")
    return choice


def start(world: World, device: torch.device, backend: str, timeout_s: float) -> None:
    """Join the job's process group (a no-op for one process)."""
    if not world.distributed or dist.is_initialized():
        return
    if world.launcher == "slurm":
        rendezvous_from_slurm()
    try:
        dist.init_process_group(backend, rank=world.rank, world_size=world.size, store=_fresh_store(world, timeout_s),
                                timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    except (RuntimeError, ValueError) as err:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise DistributedError(f"rank {world.rank} of {world.size} could not join the job at {where} "
                               f"({str(err).splitlines()[0][:300]}); check that every process was started with "
                               "the same rendezvous address and port and can reach rank 0's host") from None


def _fresh_store(world: World, timeout_s: float):
    """The rendezvous store for this start of the job. torchrun keeps one store for all of a
    job's restarts, so after ``--max-restarts`` the new processes may read the addresses the
    dead ones published and hang or be refused (seen in about half of the restarts here).
    Each rank counts its starts in the store and every start of the job gets its own prefix
    (all ranks start once per attempt, since torchrun restarts them all). None: the usual
    environment rendezvous (no torchrun agent store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world.size, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    start_number = store.add(f"speedrun/starts/rank-{world.rank}", 1)
    return dist.PrefixStore(f"speedrun/start-{start_number}", store)


def finish(world: World, timeout_s: float) -> None:
    """Wait, at the end of a finished run, until every rank has finished too: a rank that hangs
    after its last collective would otherwise keep the job alive forever. gloo names the ranks
    that did not arrive; NCCL's barrier times out like any collective."""
    if not world.distributed:
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as err:
        late = re.search(r"Ranks? ([\d, ]+) failed to pass", str(err))       # gloo's monitored barrier
        who = f"rank(s) {late.group(1).strip()}" if late else "another rank"
        raise DistributedError(f"rank {world.rank} of {world.size} finished, but {who} did not within "
                               f"distributed.timeout_s={timeout_s:g} s (hung or died); the run record was "
                               "written by rank 0") from None


def stop() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def bind_device(world: World, requested: torch.device) -> torch.device:
    """Each process uses the GPU of its local rank; a process srun started that sees one GPU
    only uses that one (`srun --gpus-per-task=1` shows each task just its own GPU)."""
    if requested.type != "cuda" or not world.distributed:
        return requested
    count = torch.cuda.device_count()
    index = 0 if world.launcher == "slurm" and count == 1 else world.local_rank
    if index >= count:
        raise DistributedError(f"rank {world.rank} has local rank {world.local_rank}, but this node has "
                               f"{count} GPUs; start at most one process per GPU")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# ------------------------------------------------------------------------------------------
# Collectives the loop uses (each a no-op in one process)
# ------------------------------------------------------------------------------------------

def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t)
    return t


def all_gather_tensor(t: torch.Tensor, world: World) -> list[torch.Tensor]:
    if not world.distributed:
        return [t]
    out = [torch.empty_like(t) for _ in range(world.size)]
    dist.all_gather(out, t)
    return out


def gather_objects(obj, world: World, group=None) -> list | None:
    """Every rank's ``obj`` on rank 0 (None on the others; ``[obj]`` in one process)."""
    if not world.distributed:
        return [obj]
    out = [None] * world.size if world.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def broadcast_object(obj, world: World):
    """Rank 0's ``obj`` on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_same_start(model: nn.Module, world: World, device: torch.device) -> None:
    """Every rank must start from the same weights (built from the same seed; nothing is
    broadcast). Compares a checksum of every tensor across ranks and names the ranks that
    differ from rank 0."""
    if not world.distributed:
        return
    state = [t for t in model.state_dict().values() if t.is_floating_point()]
    weights = torch.arange(1, 1 + sum(t.numel() for t in state), dtype=torch.float64, device=device)
    flat = torch.cat([t.detach().double().flatten() for t in state])
    mine = torch.stack([flat.sum(), (flat * weights).sum() / weights.numel()])
    gathered = all_gather_tensor(mine, world)
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if bad:
        raise DistributedError(f"ranks {bad} start from other weights than rank 0 (their parameter checksums "
                               "differ): every rank must build the model from the same recipe and seed "
                               "(train.seed / --seed); was one started with other arguments?")


def check_compiled_buckets(bucket_mb: float, world: World, compiled: bool,
                           first_bucket_bytes: int = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)) -> None:
    """Refuse gradient buckets smaller than DDP's first one (1 MiB) in a compiled data-parallel
    run: dynamo cuts the compiled model at the bucket boundaries and stops with an assertion
    when the first bucket is the larger (found by benchmarks/step_structure.py). Eager DDP
    takes any size."""
    if compiled and world.distributed and bucket_mb * (1 << 20) < first_bucket_bytes:
        raise RecipeError(f"distributed.bucket_mb={bucket_mb:g} is smaller than DistributedDataParallel's first "
                          f"gradient bucket ({first_bucket_bytes / (1 << 20):g} MiB), which torch.compile's "
                          "data-parallel graph splitting does not allow; use at least "
                          f"{first_bucket_bytes / (1 << 20):g}, or runtime.compile=off")


def wrap(model: nn.Module, cfg, world: World, device: torch.device) -> nn.Module:
    """DistributedDataParallel: gradients averaged in buckets of ``cfg.bucket_mb`` while the
    backward pass runs; no broadcast at construction (the start was checked identical) and none
    of buffers per step (batch-norm statistics are averaged before each evaluation); optionally
    bf16 or fp16 gradients on the wire."""
    if not world.distributed:
        return model
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cfg.bucket_mb,
        **compat.ddp_options())
    if cfg.compression != "none":
        ddp.register_comm_hook(None, compression_hook(cfg.compression, dist.get_backend()))
    return ddp


def compression_hook(dtype_name: str, backend: str):
    """A DDP communication hook that all-reduces each gradient bucket in bf16 or fp16 (half the
    bytes on the wire) and writes the mean back in the gradients' own precision: torch's own
    hooks, except bf16 on gloo, which torch's hook refuses (it asks for NCCL)."""
    if dtype_name == "fp16":
        return default_hooks.fp16_compress_hook
    if backend == "nccl":
        return default_hooks.bf16_compress_hook

    def bf16_on_gloo(group, bucket):
        group = group or dist.group.WORLD
        grads = bucket.buffer()
        low = grads.to(torch.bfloat16).div_(group.size())

        def write_back(fut):
            return grads.copy_(fut.value()[0])
        return dist.all_reduce(low, group=group, async_op=True).get_future().then(write_back)
    return bf16_on_gloo


def no_sync(module: nn.Module):
    """A context in which backward passes accumulate gradients without all-reducing them
    (every micro-batch but the last of a step)."""
    inner = getattr(module, "_orig_mod", module)            # a compiled DDP module
    return inner.no_sync() if isinstance(inner, nn.parallel.DistributedDataParallel) else nullcontext()


def norm_group(sync_ranks: int, world: World):
    """The process group batch norm is computed over: None for each rank on its own (1), the
    whole job (0), or consecutive groups of ``sync_ranks`` ranks. Every rank calls this."""
    if not world.distributed or sync_ranks == 1:
        return None
    if sync_ranks == 0 or sync_ranks >= world.size:
        return dist.group.WORLD
    if world.size % sync_ranks:
        raise RecipeError(f"model.norm.sync_ranks={sync_ranks} must divide the number of processes ({world.size})")
    group, _ = dist.new_subgroups(group_size=sync_ranks)
    return group


def _norm_statistics(model: nn.Module) -> list[torch.Tensor]:
    return [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for b in (m.running_mean, m.running_var) if b is not None]


def average_norm_statistics(model: nn.Module, world: World) -> torch.Tensor | None:
    """Make every rank's batch-norm running statistics the mean over ranks (each rank's own
    batches moved them), so evaluation on any rank uses the same model. Returns this rank's
    own statistics as they were, in one flat tensor, for :func:`restore_norm_statistics`
    (None in one process, or without batch norm)."""
    if not world.distributed:
        return None
    stats = _norm_statistics(model)
    if not stats:
        return None
    flat = torch.cat([b.flatten() for b in stats])
    own = flat.clone()
    dist.all_reduce(flat)
    flat /= world.size
    torch._foreach_copy_(stats, list(flat.split([b.numel() for b in stats])))
    return own


@torch.no_grad()
def restore_norm_statistics(model: nn.Module, own: torch.Tensor | None) -> None:
    """Put back the statistics :func:`average_norm_statistics` returned (an evaluation that
    was stopped: the checkpoint keeps each rank's own statistics, as after the last step)."""
    if own is None:
        return
    stats = _norm_statistics(model)
    torch._foreach_copy_(stats, list(own.split([b.numel() for b in stats])))


LOCAL_FAILURES = ("cuda error", "cuda out of memory", "illegal memory access", "unhandled cuda error",
                  "cublas_status", "cudnn_status", "device-side assert", "out of memory")
PEER_FAILURES = ("connection closed", "connection reset", "connection refused", "broken pipe", "timed out",
                 "timeout", "by peer", "remote process", "peer closed", "communicator was aborted",
                 "socket closed", "read error", "unexpected eof")


def lost_peer(err: BaseException) -> bool:
    """Whether a collective failed because another process went away or timed out, from the
    exception alone: network and timeout errors (gloo's "Connection closed by peer" and
    "Timed out waiting", NCCL's aborted communicator, torch's DistNetworkError) are about the
    other ranks; an error of this process's own GPU (a CUDA error, out of memory, an illegal
    memory access, NCCL's "unhandled cuda error") is not, even when NCCL reports it."""
    text = str(err).lower()
    if any(k in text for k in LOCAL_FAILURES):
        return False
    network_error = getattr(torch.distributed, "DistNetworkError", None)
    if network_error is not None and isinstance(err, network_error):
        return True
    return any(k in text for k in PEER_FAILURES)


class StopAgreement:
    """Whether any rank received a stop signal, agreed by all ranks at a step boundary so that
    every rank stops after the same step: a MAX all-reduce of one integer held on the CPU, over
    gloo (the job's own group on CPUs, a second gloo group beside NCCL), so the device's queue
    gets no synchronisation. Every rank constructs it and calls :meth:`signal` at the same steps."""

    def __init__(self, world: World):
        self.world = world
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.group = None
        if world.distributed and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")

    def signal(self, received: int | None) -> int | None:
        """The signal some rank received (the highest number where several did), or None."""
        if not self.world.distributed:
            return received
        self.flag[0] = received or 0
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(self.flag[0]) or None

    def in_evaluation(self, received, running: bool) -> int | None:
        """The stop check of a sharded evaluation, called by every rank before each of its
        batches (``running``) and after its last; ``received()``: the signal this rank has
        received, or None. Ranks need not have as many batches (a
        streamed rank's share of a short last batch, or one whose images were all unreadable
        and skipped, yields none), so the check is not tied to batches: each call is one MAX
        all-reduce of (signal, still running) on the CPU, and a rank past its last batch calls
        again until no rank runs. Every rank therefore makes the same number of calls and
        sees the same answers: a signal while some rank still evaluates (all stop after the
        same call), or the evaluation complete (None; a signal that arrives as it ends is
        left to the next step boundary)."""
        if not self.world.distributed:
            return received() if running else None
        box = torch.zeros(2, dtype=torch.int32)
        while True:
            box[0], box[1] = received() or 0, int(running)
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
            signum, anyone = int(box[0]), bool(box[1])
            if not anyone:
                return None
            if signum:
                return signum
            if running:
                return None

    def wait_for_all(self) -> None:
        """Every rank past this point (rank 0 has written the checkpoint)."""
        if self.world.distributed:
            dist.barrier(group=self.group)
