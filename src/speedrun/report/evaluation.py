"""A run's evaluation (``speedrun evaluate``) in pictures and in its report: the confusion
matrix, a grid of the most confident mistakes, and the report's per-class section read back
from ``evaluation.json`` and the pictures beside it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import RecordError
from ..files import read_text
from .plots import _png, plt

EVALUATION_FILES = {"record": "evaluation.json", "confusion": "confusion.png", "mistakes": "mistakes.png",
                    "predictions": "predictions.csv"}
"""What ``speedrun evaluate`` writes into a run folder (and rewrites on a second evaluate)."""

ANNOTATE_UP_TO = 20
"""Classes up to which the confusion matrix is written out in cells, tables and ticks."""


def confusion_figure(matrix: np.ndarray, classes: list[str]) -> bytes:
    """Rows: true class, columns: predicted; colour: the share of the row (recall on the diagonal)."""
    k = len(classes)
    rows = matrix.sum(axis=1, keepdims=True)
    share = np.divide(matrix, rows, out=np.zeros(matrix.shape, dtype=float), where=rows > 0)
    side = min(12.0, 2.5 + 0.45 * k)
    fig, ax = plt.subplots(figsize=(side + 1.2, side))
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    if k <= ANNOTATE_UP_TO:
        ax.set_xticks(range(k), classes, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(k), classes, fontsize=8)
        for i in range(k):
            for j in range(k):
                if matrix[i, j]:
                    ax.text(j, i, str(int(matrix[i, j])), ha="center", va="center", fontsize=7,
                            color="white" if share[i, j] > 0.5 else "black")
    ax.set(xlabel="predicted class", ylabel="true class", title=f"confusion matrix ({int(matrix.sum())} images)")
    return _png(fig)


def mistakes_figure(images: list[np.ndarray], captions: list[str], columns: int = 4) -> bytes:
    """A grid of images (uint8 H, W, C) with a caption each; an empty grid says so."""
    n = len(images)
    rows = max(1, -(-n // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(2.3 * columns, 2.5 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, img, caption in zip(axes.flat, images, captions):
        ax.imshow(img[:, :, 0] if img.shape[2] == 1 else img, cmap="gray" if img.shape[2] == 1 else None,
                  vmin=0, vmax=255, interpolation="nearest")
        ax.set_title(caption, fontsize=8)
    if not n:
        axes[0, 0].text(0, 0.5, "no mistakes", fontsize=12)
    fig.suptitle("most confident mistakes (true → predicted, confidence)", fontsize=10)
    return _png(fig)


def _pct(x) -> str:
    return "—" if x is None else f"{x:.2%}"


def evaluation_section(folder: Path) -> tuple[list[tuple[str, str]], list, list] | None:
    """(facts, tables, figures) for a run's report from what ``speedrun evaluate`` wrote, or
    None where it has not been run."""
    path = folder / EVALUATION_FILES["record"]
    if not path.is_file():
        return None
    try:
        e = json.loads(read_text(path, "evaluation.json"))
        facts = [(f"evaluation: accuracy ({e['tta']} TTA)", _pct(e["test_acc"])),
                 ("evaluation: accuracy without TTA", _pct(e["test_acc_no_tta"])),
                 ("evaluation: equals the run's recorded accuracy",
                  {True: "yes, exactly", False: "no", None: "no record to compare"}[e["matches_record"]])]
        if e.get("top5_acc") is not None:
            facts.append(("evaluation: top-5 accuracy (TTA)", _pct(e["top5_acc"])))
        facts.append(("evaluation: images", f"{e['images']} ({e['data']})"))
        per_class = [[c["class"], _pct(c["precision"]), _pct(c["recall"]), _pct(c["f1"]), str(c["support"])]
                     for c in e["per_class"]]
        tables = [("per class (with TTA)", ["class", "precision", "recall", "F1", "images"], per_class)]
        classes = e["classes"]
        if len(classes) <= ANNOTATE_UP_TO:
            tables.append(("confusion matrix (rows: true class, columns: predicted)", ["true \\ predicted", *classes],
                           [[c, *map(str, row)] for c, row in zip(classes, e["confusion"])]))
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise RecordError(f"{path}: not a complete evaluation record ({type(err).__name__}: {str(err)[:100]}); run "
                          f"`speedrun evaluate {folder}` again") from None
    figures = []
    for name, caption in (("confusion", "confusion matrix (evaluation, with TTA)"),
                          ("mistakes", "the most confident mistakes (evaluation)")):
        png = folder / EVALUATION_FILES[name]
        if png.is_file():
            figures.append((name, caption, png.read_bytes()))
    return facts, tables, figures
