"""The per-step cost of the stop-signal check: what the training loop adds after every step so
that a signal to any rank stops all ranks after the same step. One process reads a flag; two
processes (gloo on this CPU, as torchrun starts them) all-reduce one integer held on the CPU.
Timed over many calls with nothing else running in the loop, so the figure is the check alone.

    python benchmarks/stop_check.py [--calls 2000] [--out benchmarks/results/stop-check-<cpu>.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from speedrun.engine.distributed import StopAgreement
from speedrun.files import atomic_write_json
from speedrun.report.environment import environment
from speedrun.stop_signals import StopSignals
from speedrun.world import World


def time_calls(check, calls: int) -> list[float]:
    """Microseconds per call, in 5 rounds of ``calls`` calls each (after 100 to warm up)."""
    for _ in range(100):
        check()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            check()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return rounds


def one_rank(rank: int, port: int, calls: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    agreement, stop = StopAgreement(World(rank=rank, size=2)), StopSignals()
    rounds = time_calls(lambda: agreement.signal(stop.received), calls)
    if rank == 0:
        out["two_processes_gloo_us"] = rounds
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    stop = StopSignals()
    single = StopAgreement(World())
    record = {"what": "microseconds per call of the loop's stop check (StopAgreement.signal), 5 rounds",
              "calls_per_round": args.calls, "one_process_us": time_calls(lambda: single.signal(stop.received),
                                                                          args.calls)}
    with mp.Manager() as manager:
        shared = manager.dict()
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(one_rank, args=(port, args.calls, shared), nprocs=2)
        record.update(shared)
    record["median_us"] = {k: statistics.median(v) for k, v in record.items() if k.endswith("_us")}
    env = environment()
    record["environment"] = env
    print({k: round(v, 2) for k, v in record["median_us"].items()})
    if args.out:
        atomic_write_json(args.out, record)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
