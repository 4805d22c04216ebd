"""The ``speedrun`` command line."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import __version__


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train one recipe once and write a run record")
    p.add_argument("recipe", help="a shipped recipe name (see `speedrun recipes`) or a .toml path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.lr=0.5 (repeatable)")
    p.add_argument("--data-dir", help="folder holding the dataset (else $SPEEDRUN_DATA, ~/.cache/speedrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--seed", type=int, help="seed for initialisation and data order (train.seed)")
    p.add_argument("--out", type=Path, help="run folder (default: a new folder under runs/)")


def cmd_recipes(args) -> int:
    from .recipe import load_recipe, shipped_recipes
    from .report.console import Console, Table
    table = Table("recipe", "dataset", "target", "description")
    for name in sorted(shipped_recipes()):
        r = load_recipe(name)
        table.add_row(name, r.data.dataset, f"{r.target:.1%}", r.description)
    Console().print(table)
    return 0


def cmd_train(args) -> int:
    from .train import train_command
    return train_command(args)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(prog="speedrun", description=__doc__)
    parser.add_argument("--version", action="version", version=f"speedrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    sub.add_parser("recipes", help="list the shipped recipes")
    args = parser.parse_args(argv)
    args.started = started
    from .errors import report_errors
    with report_errors() as status:
        status.code = {"train": cmd_train, "recipes": cmd_recipes}[args.command](args)
    return status.code


if __name__ == "__main__":
    sys.exit(main())
