"""Where this process stands in a job: rank, world size, local rank and nodes, read from the
variables torchrun or SLURM's srun set (no torch import: the CLI reads it to prefix errors
and to refuse commands that run in one process only)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """This process's place in the job (one process, or one of ``size``)."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    nodes: int = 1
    launcher: str = "single"              # "torchrun" (or any launcher setting RANK/WORLD_SIZE), "slurm"
    restart: int = 0                      # starts of this job before this one: torchrun's restarts, SLURM's requeues
    job_id: str | None = None             # torchrun's run id or SLURM's job id

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict:
        return {"world_size": self.size, "nodes": self.nodes, "processes_per_node": self.local_size,
                "launcher": self.launcher}


def _int(env, *names, default=None):
    for n in names:
        if env.get(n, "").strip().lstrip("-").isdigit():
            return int(env[n])
    return default


def _tasks_per_node(text: str | None) -> int | None:
    """SLURM's task count per node, e.g. '2', '2(x3)' or '4,2': the first node's."""
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else None


def detect(env=None) -> World:
    """The world from the environment the launcher set: torchrun's (RANK, WORLD_SIZE,
    LOCAL_RANK, ...) or srun's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...); else one
    process. torchrun inside an srun allocation sets its own variables, which win; a requeued
    SLURM job (SLURM_RESTART_COUNT) counts as restarted under either."""
    env = os.environ if env is None else env
    requeued = _int(env, "SLURM_RESTART_COUNT", default=0)
    if "RANK" in env and "WORLD_SIZE" in env:
        size = _int(env, "WORLD_SIZE", default=1)
        local_size = _int(env, "LOCAL_WORLD_SIZE", default=size)
        return World(rank=_int(env, "RANK", default=0), size=size, local_rank=_int(env, "LOCAL_RANK", default=0),
                     local_size=local_size, nodes=_int(env, "GROUP_WORLD_SIZE", default=max(1, size // local_size)),
                     launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env else "env",
                     restart=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0) + requeued,
                     job_id=env.get("TORCHELASTIC_RUN_ID"))
    if _int(env, "SLURM_NTASKS", "SLURM_NPROCS", default=1) > 1 and "SLURM_PROCID" in env:
        size = _int(env, "SLURM_NTASKS", "SLURM_NPROCS")
        return World(rank=_int(env, "SLURM_PROCID"), size=size, local_rank=_int(env, "SLURM_LOCALID", default=0),
                     local_size=_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"))
                     or size, nodes=_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1),
                     launcher="slurm", restart=requeued, job_id=env.get("SLURM_JOB_ID"))
    return World(restart=requeued)


def process_age() -> float | None:
    """Seconds since this process started, from Linux's /proc (its start in clock ticks after
    boot, and the seconds since boot); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
