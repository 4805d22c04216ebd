"""``speedrun predict RUN_DIR IMAGES...``: the classes a finished run gives image files, with
probabilities. Images are prepared as the run's evaluation prepared its own (``loaded.py``)
and fed to the model in batches on the device; with ``--tta`` every image gets the recipe's
test-time views. Files that are not readable images are named and skipped, and counted at
the end.
"""
from __future__ import annotations

import csv
import glob
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.sources.folder import IMAGE_EXTENSIONS
from ..engine.evaluate import tta_logits
from ..errors import DataError, UsageError
from ..files import atomic_write_text, check_output_file
from .loaded import LoadedRun, load_run, prepare_images

FORMATS = ("table", "csv", "json")


def image_paths(inputs: list[str]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(image files, [(input, why)] of inputs that name none): files as given, folders searched
    recursively for image extensions, glob patterns expanded (``**`` included); each file once,
    in the order given (a folder's and a pattern's files sorted)."""
    found, missing = [], []
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
            if not files:
                missing.append((path, f"a folder holding no images ({', '.join(sorted(IMAGE_EXTENSIONS))})"))
            found += files
        elif path.exists():
            found.append(path)
        elif glob.has_magic(text):
            matches = [Path(m) for m in sorted(glob.glob(text, recursive=True))]
            files = [m for m in matches if m.is_file()]
            for d in (m for m in matches if m.is_dir()):
                files += sorted(p for p in d.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
            if not files:
                missing.append((path, "the pattern matches no files"))
            found += files
        else:
            missing.append((path, "no such file or folder"))
    return list(dict.fromkeys(found)), missing


@dataclass
class Prediction:
    image: Path
    top: list[tuple[str, int, float]]           # (class, class index, probability), most probable first


@torch.no_grad()
def predict(loaded: LoadedRun, paths: list[Path], top_k: int = 1, tta: bool = False, batch_size: int = 256,
            on_skip=None) -> tuple[list[Prediction], list[tuple[Path, str]]]:
    """Predictions for the readable images among ``paths`` and [(path, why)] for the rest;
    ``on_skip(path, why)`` hears of each skipped file as it happens."""
    rt, model = loaded.runtime, loaded.model
    views = loaded.recipe.eval.tta if tta else "none"
    out, skipped = [], []
    for start in range(0, len(paths), batch_size):
        x, kept, bad = prepare_images(loaded, paths[start:start + batch_size])
        for path, why in bad:
            skipped.append((path, why))
            if on_skip:
                on_skip(path, why)
        if not kept:
            continue
        with rt.autocast():                      # the run's precision; its pipeline stored inputs in it too
            total, _ = tta_logits(model, x.to(rt.dtype), views, rt.memory_format)
        prob, idx = total.float().softmax(1).topk(top_k, dim=1)
        for path, p, i in zip(kept, prob.cpu().tolist(), idx.cpu().tolist()):
            out.append(Prediction(path, [(loaded.classes[c], c, q) for c, q in zip(i, p)]))
    return out, skipped


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------

def as_csv(preds: list[Prediction]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["image", "rank", "class", "class_index", "probability"])
    for p in preds:
        for rank, (name, c, q) in enumerate(p.top, 1):
            w.writerow([str(p.image), rank, name, c, f"{q:.6f}"])
    return buf.getvalue()


def as_json(preds: list[Prediction], skipped, loaded: LoadedRun, tta: str) -> str:
    return json.dumps({
        "run": str(loaded.folder), "recipe": loaded.recipe.name, "tta": tta,
        "predictions": [{"image": str(p.image), "top": [{"class": n, "class_index": c, "probability": q}
                                                        for n, c, q in p.top]} for p in preds],
        "skipped": [{"image": str(path), "reason": why} for path, why in skipped],
    }, indent=2) + "\n"


def as_table(preds: list[Prediction], top_k: int, width: int | None = None) -> str:
    from rich.console import Console
    from rich.table import Table
    table = Table("image", *(f"{'class' if top_k == 1 else f'#{r}'}" for r in range(1, top_k + 1)), box=None)
    for p in preds:
        table.add_row(str(p.image), *(f"{n} {q:.1%}" for n, _, q in p.top))
    buf = io.StringIO()
    Console(file=buf, width=width or 200, color_system=None).print(table)
    return buf.getvalue()


def predict_command(args) -> int:
    if args.format not in FORMATS:
        raise UsageError(f"--format {args.format!r}: choose one of {', '.join(FORMATS)}")
    if args.out is not None:
        check_output_file(args.out, "--out")             # before any work; an existing file is never replaced
    loaded = load_run(args.run_dir, args.device)
    if args.top_k > len(loaded.classes):
        raise UsageError(f"--top-k {args.top_k}: the run knows only {len(loaded.classes)} classes")
    paths, missing = image_paths(args.images)
    say = lambda path, why: print(f"speedrun: skipped {path}: {why}", file=sys.stderr)
    for path, why in missing:
        say(path, why)
    preds, skipped = predict(loaded, paths, args.top_k, args.tta, args.batch_size or loaded.recipe.eval.batch_size,
                             on_skip=say)
    skipped = missing + skipped
    if not preds:
        raise DataError(f"none of the {len(skipped)} input(s) given is a readable image (each is named above)")
    views = loaded.recipe.eval.tta if args.tta else "none"
    text = {"csv": lambda: as_csv(preds), "json": lambda: as_json(preds, skipped, loaded, views),
            "table": lambda: as_table(preds, args.top_k)}[args.format]()
    if args.out is not None:
        atomic_write_text(args.out, text)
    else:
        sys.stdout.write(text)
    if skipped:
        print(f"speedrun: {len(skipped)} of {len(skipped) + len(preds)} input(s) skipped (not readable images); "
              f"predicted {len(preds)}", file=sys.stderr)
    if args.out is not None:
        print(f"speedrun: wrote {len(preds)} predictions to {args.out}", file=sys.stderr)
    return 0
