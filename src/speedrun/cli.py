"""The ``speedrun`` command line."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import __version__


def _recipe_options(p, out_help: str, optional: bool = False) -> None:
    p.add_argument("recipe", nargs="?" if optional else None,
                   help="a shipped recipe name (see `speedrun recipes`) or a .toml path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.lr=0.5 (repeatable)")
    p.add_argument("--data-dir", help="folder holding the dataset (else $SPEEDRUN_DATA, ~/.cache/speedrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--seed", type=int, help="seed (train.seed); bench and ablate use seed, seed+1, ...")
    if out_help:
        p.add_argument("--out", type=Path, help=out_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speedrun", description="Train image classifiers to a target "
                                     "accuracy in the least time, and measure it honestly.")
    parser.add_argument("--version", action="version", version=f"speedrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train one recipe once and write a run record")
    _recipe_options(p, "run folder (default: a new folder under runs/)", optional=True)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint.pt")
    p.add_argument("--find-batch", action="store_true",
                   help="halve data.batch_size on out-of-memory until it fits (runtime.find_batch)")

    sub.add_parser("recipes", help="list the shipped recipes")

    p = sub.add_parser("bench", help="N seeded runs in one process, with statistics (bench.json)")
    _recipe_options(p, "folder for bench.json (default: a new folder under runs/)")
    p.add_argument("--runs", type=int, required=True, help="number of runs")

    p = sub.add_parser("compare", help="compare two bench records with Welch t-tests")
    p.add_argument("a", help="A: bench.json or its folder")
    p.add_argument("b", help="B: bench.json or its folder")
    p.add_argument("--region", default="train+eval", help="timing region (train+eval, end_to_end, run_start_to_stop)")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level (default 0.05)")
    p.add_argument("--json", help="also write the comparison to this JSON file")

    p = sub.add_parser("ablate", help="benchmark the recipe with each trick turned off in turn")
    _recipe_options(p, "folder for ablate.json and ablation.png (default: a new folder under runs/)")
    p.add_argument("--runs", type=int, required=True, help="runs per variant")
    p.add_argument("--tricks", help="comma-separated tricks to ablate (default: every trick the recipe uses)")
    p.add_argument("--ladder", help="comma-separated tricks to add back one by one, in this order")
    p.add_argument("--epochs-grid", help="fractions of the epochs to also run at, e.g. 0.6,0.8 "
                   "(to interpolate the epochs needed to reach the target)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted ablation in --out: keep "
                   "its finished variants, run the rest (same recipe, --set, --seed, --runs, grid)")

    p = sub.add_parser("flops", help="FLOPs per image and per run, peak, ideal time, data vs model time")
    _recipe_options(p, "")
    p.add_argument("--steps", type=int, default=10, help="training steps to time for the data/model split")
    p.add_argument("--json", help="also write the figures to this JSON file")

    p = sub.add_parser("report", help="an HTML (and Markdown) report of a run, bench or ablate folder")
    p.add_argument("target", help="a run folder, or a folder holding bench.json or ablate.json")

    data = sub.add_parser("data", help="prepare an image folder as arrays, or export a built-in set as a folder")
    dsub = data.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="decode an image folder once into a fixed-size uint8 .npz (memory-mapped)")
    p.add_argument("src", help="image folder (train/ and val/, or one folder to split)")
    p.add_argument("--size", type=int, required=True, help="side of the square images, in pixels")
    p.add_argument("--out", type=Path, required=True, help="the .npz file to write")
    p.add_argument("--val-fraction", type=float, default=0.0, help="held-out fraction when there is no val/")
    p.add_argument("--seed", type=int, default=0, help="seed of that split")
    p.add_argument("--workers", type=int, default=-1, help="decoding processes (default: one per core, at most 8)")
    p.add_argument("--skip-corrupt", action="store_true", help="skip unreadable images instead of stopping")
    p = dsub.add_parser("export", help="write a built-in dataset as train/<class>/ and val/<class>/ images")
    p.add_argument("dataset", choices=["cifar10", "cifar100", "fashion-mnist"])
    p.add_argument("--format", choices=["png", "jpeg"], default="png")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quality", type=int, default=95, help="JPEG quality")
    p.add_argument("--limit", type=int, help="only the first N images of each split")
    p.add_argument("--data-dir", help="where the dataset is (else $SPEEDRUN_DATA, ~/.cache/speedrun)")
    return parser


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    args.started = started
    from .errors import report_errors
    with report_errors() as status:
        status.code = dispatch(args)
    return status.code


def dispatch(args) -> int:
    if args.command == "train":
        from .train import train_command
        if args.find_batch:
            args.overrides.append("runtime.find_batch=true")
        return train_command(args)
    if args.command == "recipes":
        from .train import recipes_command
        return recipes_command(args)
    if args.command == "data":
        return data_command(args)
    from .bench import commands
    return getattr(commands, f"{args.command}_command")(args)


def data_command(args) -> int:
    from .data.prepare import export, prepare
    from .report.console import print_table
    if args.data_command == "prepare":
        out = prepare(args.src, args.size, args.out, args.val_fraction, args.seed, args.workers, args.skip_corrupt)
        print_table(f"prepared {args.src}", [(k, str(v)) for k, v in out.items()])
    else:
        out = export(args.dataset, args.format, args.out, args.data_dir, args.quality, limit=args.limit)
        print_table(f"exported {args.dataset}", [(k, str(v) if k != "classes" else str(len(v)))
                                                  for k, v in out.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
