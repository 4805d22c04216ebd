"""What the ``bench``, ``compare``, ``ablate`` and ``flops`` commands share: the recipe and
device from the command line, the output folder, and how a statistic is printed."""
from __future__ import annotations

import math
import time
from pathlib import Path

from ..engine.runtime import pick_device, resolve_runtime
from ..errors import RunFolderError
from ..files import OutputFolder
from ..recipe import load_recipe
from ..report.bench_record import CI_METHOD


def fmt(d: dict, scale: float = 1.0, digits: int = 3) -> str:
    lo, hi = d["ci95"]
    std = "n/a" if math.isnan(d["std"]) else f"{d['std'] * scale:.{digits}f}"
    ci = "" if math.isnan(lo) else f"  [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"
    return f"{d['mean'] * scale:.{digits}f} ± {std}{ci}"


CI_CAPTION = f"95% CI: {CI_METHOD}; for times its lower end is cut at 0 s, the least possible value"


def out_folder(path: Path | None, kind: str, recipe: str, filename: str) -> OutputFolder:
    """The command's output folder, checked (nothing is written yet)."""
    folder = path or Path("runs") / f"{kind}-{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (folder / filename).exists():
        raise RunFolderError(f"{folder / filename} already exists; pass another --out folder so that no "
                             "record is overwritten")
    return OutputFolder(folder)


def recipe_and_device(args, defaults: list[str]):
    """The recipe with the command's defaults and the user's --set/--seed, and the device; the
    run itself is planned (data opened, runtime resolved, batch fitted) by plan_run."""
    overrides = defaults + list(args.overrides) + ([f"train.seed={args.seed}"] if args.seed is not None else [])
    recipe = load_recipe(args.recipe, overrides)
    device = pick_device(args.device)
    resolve_runtime(recipe.runtime, device)     # a runtime this device refuses stops here, before any output
    return recipe, device
