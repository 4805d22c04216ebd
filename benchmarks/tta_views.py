"""Test-time augmentation variants on one finished run's weights: a paired comparison.

Training noise (about 0.1 points between seeds on CIFAR-10) hides small differences between
TTA settings when each is trained anew; here every variant evaluates the same saved model on
the same test set, so a difference is the TTA's alone. Variants: each view set of the engine
(``eval.tta``) at several ``eval.tta_fraction`` values, and candidate view sets defined below
(more shifts, equal weights) that the engine does not offer. Usage:

    .venv/bin/python benchmarks/tta_views.py RUN_DIR [RUN_DIR ...] --out benchmarks/results/tta-views-....json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch.nn.functional as F

from speedrun.engine import evaluate as ev
from speedrun.files import atomic_write_json
from speedrun.report.environment import environment, git_state
from speedrun.use.evaluate import open_test_set
from speedrun.use.loaded import load_run

SHIFTS = [(1, 1), (-1, -1), (1, -1), (-1, 1)]


def _resized(size: int):
    """The image resized to ``size`` px (bilinear): a view at another scale. The speed net ends
    in a global max pool, so it takes any size; low-resolution early epochs (data.progressive)
    trained it on smaller objects than the test set's."""
    def view(x):
        return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return view


def _with_scales(sizes: tuple[int, ...], share: float) -> list:
    """The engine's six views at ``1 - share`` of the weight; the image resized to each of
    ``sizes`` px, and its mirror, sharing the rest equally."""
    extra = [v for size in sizes for v in (_resized(size), ev._compose(_resized(size), ev._mirror))]
    return [((1 - share) * w, view) for w, view in ev.TTA_VIEWS["flip_translate"]] + \
        [(share / len(extra), view) for view in extra]


CANDIDATES = {
    # the plain and mirrored views at 1/4 each, then all four diagonal one-pixel shifts, each
    # also mirrored, sharing the other half
    "flip_translate8": [(0.25, ev._identity), (0.25, ev._mirror)]
    + [(0.5 / 8, view) for d in SHIFTS for view in (ev._shift(*d), ev._compose(ev._shift(*d), ev._mirror))],
    # the engine's six views with equal weights
    "flip_translate_equal": [(1 / 6, view) for _, view in ev.TTA_VIEWS["flip_translate"]],
    # a second scale at a quarter of the weight: enlarged to 36 px, or shrunk to 28 px (a size
    # the early epochs trained at); both at half
    "flip_translate_up36": _with_scales((36,), 0.25),
    "flip_translate_down28": _with_scales((28,), 0.25),
    "flip_translate_scales": _with_scales((36, 28), 0.5),
}
VARIANTS = [("none", 1.0), ("flip", 1.0), ("flip_translate", 0.25), ("flip_translate", 0.5),
            ("flip_translate", 1.0), ("flip_translate8", 0.25), ("flip_translate8", 0.5),
            ("flip_translate_equal", 0.25), ("flip_translate_up36", 0.25), ("flip_translate_up36", 1.0),
            ("flip_translate_down28", 0.25), ("flip_translate_down28", 1.0), ("flip_translate_scales", 0.25),
            ("flip_translate_scales", 1.0)]


def variants_of(run_dir: Path) -> dict:
    loaded = load_run(run_dir, "cpu")
    test = open_test_set(loaded)
    rows = []
    for tta, fraction in VARIANTS:
        t0 = time.perf_counter()
        batches = ((x, y) for x, y, _ in test.data.indexed_test_batches(loaded.recipe.eval.batch_size))
        c_tta, c_plain, n = ev.evaluate(loaded.model, batches, tta, loaded.runtime, fraction)
        rows.append({"tta": tta, "fraction": fraction, "views": len(ev.TTA_VIEWS[tta]),
                     "test_acc": int(c_tta) / n, "test_acc_no_tta": int(c_plain) / n,
                     "seconds": time.perf_counter() - t0})
        print(f"{run_dir.name}: {tta:22s} {fraction:.2f}  {rows[-1]['test_acc']:.4f} "
              f"(plain {rows[-1]['test_acc_no_tta']:.4f})  {rows[-1]['seconds']:.1f} s", flush=True)
    return {"run": str(run_dir), "recipe": loaded.recipe.name, "seed": loaded.recipe.train.seed,
            "precision": loaded.runtime.precision, "variants": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default="", help="variants whose view set contains this text (default: all)")
    args = p.parse_args()
    VARIANTS[:] = [v for v in VARIANTS if args.only in v[0]]
    for name, views in CANDIDATES.items():
        ev.TTA_VIEWS.setdefault(name, views)
    record = {"benchmark": "tta_views", "timed": "evaluate() over the run's test set per variant, same weights",
              "variants": [f"{t}@{f}" for t, f in VARIANTS], "runs": [variants_of(r) for r in args.runs],
              "environment": {**environment(), **git_state()}}
    atomic_write_json(args.out, record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
