"""Seconds per training step of the imagenette recipe's model alone (random data, no input
pipeline): bf16 autocast, channels_last, batch 128 at 128 px, torch.optim.SGD; eager or compiled
by inductor, batch norm in fp32 or bf16 (`--set model.norm.fp32=false`). The mean of 3 steps after
2 warm-up steps (compiled: the first steps include compiling).

Usage: .venv/bin/python benchmarks/imagenette_step.py [--compile] [-- --set key=value ...]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from speedrun.models import build_model
from speedrun.recipe import load_recipe


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--set", action="append", default=[], dest="sets")
    args = p.parse_args()
    torch.manual_seed(0)
    r = load_recipe("imagenette", args.sets)
    model = build_model(r.model, 3, 10).to(memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model)
    x = torch.randn(args.batch, 3, args.size, args.size).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for _ in range(2):
        step()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    dt = (time.perf_counter() - t0) / 3
    print(f"{args.sets} compile={args.compile}: {dt * 1000:.0f} ms/step, {args.batch / dt:.1f} images/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
