"""Started by tests/test_stop_signals.py under torchrun, two gloo processes: the engine's
evaluation on each rank with the stop check the training loop gives it (each rank's own stop
signals, agreed by every rank), over batches of which the ranks need not have as many, and a
real stop signal that a rank sends itself as one of its batches is evaluated.

    torchrun --nproc-per-node 2 tests/stop_agreement_job.py OUT_DIR

Writes OUT_DIR/rank-R.json: for each case, what the evaluation on that rank ended with
('complete' and its image count, or the name of the signal that stopped it) and how many
times it asked the other rank.
"""
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from speedrun.engine.distributed import StopAgreement
from speedrun.engine.evaluate import EvaluationStopped, evaluate
from speedrun.stop_signals import StopSignals
from speedrun.world import detect

# case: ({rank: batches}, {rank: batch index during which it sends itself SIGUSR1})
CASES = {
    "uneven, no signal": ({0: 3, 1: 1}, {}),
    "the rank past its last batch is signalled while the other evaluates": ({0: 3, 1: 1}, {1: 0}),
    "the evaluating rank is signalled while the other waits": ({0: 3, 1: 1}, {0: 1}),
    "a signal during the last batch of all": ({0: 3, 1: 1}, {0: 2}),
    "a rank with no batch at all": ({0: 2, 1: 0}, {}),
}


def run_case(world, batches: int, signal_at: int | None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    data = [(torch.randn(5, 1, 8, 8), torch.randint(0, 3, (5,))) for _ in range(batches)]
    stop, agreement = StopSignals(), StopAgreement(world)
    asked = []

    def check(running: bool):
        asked.append(running)
        return agreement.in_evaluation(lambda: stop.received, running)

    def on_batch(total, plain, y):
        if len(asked) - 1 == signal_at:                  # (one check before each batch)
            os.kill(os.getpid(), signal.SIGUSR1)
    with stop.installed():
        stop.listening = True
        try:
            _, _, n = evaluate(model, data, "none", on_batch=on_batch, stop=check)
            ended = {"complete": n}
        except EvaluationStopped as stopped:
            ended = {"stopped": signal.Signals(stopped.signum).name}
    dist.barrier()
    return {**ended, "checks": len(asked), "received": stop.name}


def main() -> None:
    world = detect()
    dist.init_process_group("gloo")
    out = {name: run_case(world, batches[world.rank], at.get(world.rank)) for name, (batches, at) in CASES.items()}
    Path(sys.argv[1], f"rank-{world.rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
