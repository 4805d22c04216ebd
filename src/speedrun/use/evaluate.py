"""``speedrun evaluate RUN_DIR``: the run's model on the run's own test set, through the same
pipeline and the engine's evaluation (the recipe's TTA, TTA fraction and evaluation batch
size), so the accuracies equal the ones the run recorded; then what a single number hides:
per-class precision, recall and F1, top-5, the confusion matrix and the most confident
mistakes, written into the run folder beside the run's own files (which are never touched).

A stop signal (SIGTERM, SIGUSR1, Ctrl-C) during the evaluation ends it before its next batch:
one line says so, nothing is written, and the exit code is 130 (there is nothing to continue
from; run it again). One that arrives once the evaluation is complete lets the files be written
(a second Ctrl-C interrupts at once, as ever).
"""
from __future__ import annotations

import csv
import io
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..data.pipeline.dataset import FolderSource, open_pipeline, open_source
from ..data.sources.folder import folder_splits
from ..engine.evaluate import EvaluationStopped, evaluate
from ..engine.flops import eval_chunk
from ..engine.runtime import compiled_model, device_name
from ..errors import DataError
from ..files import atomic_write_bytes, atomic_write_json, atomic_write_text, check_output_folder
from ..recipe import Recipe
from ..stop_signals import INTERRUPTED_EXIT, StopSignals
from ..report.evaluation import EVALUATION_FILES, confusion_figure, mistakes_figure
from .loaded import LoadedRun, check_classes, decode_images, load_run

MISTAKES_SHOWN = 16


@dataclass
class TestSet:
    """The run's test data as its pipeline serves it, and what names each image."""
    data: object                          # the pipeline (StreamedData or ResidentData)
    describe: str                         # where it came from
    files: list[str] | None               # a folder's files (relative to ``root``), else None
    root: Path | None
    arrays: torch.Tensor | None           # an array set's uint8 test images, else None


def _with_data_dir(recipe: Recipe, data_dir) -> Recipe:
    if data_dir is None or recipe.data.dataset not in ("folder", "npz"):
        return recipe
    return recipe.with_values({"data.path": str(data_dir)})


def open_test_set(loaded: LoadedRun, data_dir=None) -> TestSet:
    """The pipeline the run evaluated with, on ``data_dir``, else on the data where the run read
    it (summary.json's absolute ``data_path``, while it is there), else where the recipe and the
    usual places say. A folder's normalisation is the recorded one (the run measured it on a
    sample of its training images); an array set's is measured again by the pipeline and must
    agree with the record, or the data is not the run's."""
    if data_dir is None:
        recorded = loaded.data_path()
        data_dir = recorded if recorded and Path(recorded).exists() else None
    recipe, pre, rt = _with_data_dir(loaded.recipe, data_dir), loaded.preprocessing, loaded.runtime
    seed = recipe.train.seed
    if loaded.streamed:
        train, val = folder_splits(recipe.data.path, recipe.data.val_fraction, recipe.data.split_seed)
        check_classes(loaded, val.classes, str(recipe.data.path))
        h = loaded.image_size[0]
        source = FolderSource(train, val, loaded.channels, h, torch.tensor(pre["mean"], dtype=torch.float32),
                              torch.tensor(pre["std"], dtype=torch.float32), str(recipe.data.path))
        data = open_pipeline(source, recipe, rt, seed)
        return TestSet(data, f"{recipe.data.path}, {len(val)} validation images", val.files, val.root, None)
    recipe, source = open_source(recipe, data_dir)
    check_classes(loaded, list(source.classes), source.source)
    data = open_pipeline(source, recipe, rt, seed)
    for what in ("mean", "std"):
        measured = getattr(data, what).cpu()
        if not torch.allclose(measured, torch.tensor(pre[what]), rtol=1e-4, atol=1e-3):
            raise DataError(f"{source.source}: the training images' channel {what} "
                            f"({', '.join(f'{v:.2f}' for v in measured.tolist())}) is not the run's "
                            f"({', '.join(f'{v:.2f}' for v in pre[what])}); this is not the data the run was "
                            "trained on. Point --data-dir at that data")
    return TestSet(data, f"{source.source}, {len(source.test_y)} test images", None, None, source.test_x)


@dataclass
class Logits:
    """Per image, in test-set order: logits with TTA and of the plain view, label, index."""
    total: torch.Tensor
    plain: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor
    correct_tta: int
    correct_plain: int


def run_evaluation(loaded: LoadedRun, test: TestSet, stop: StopSignals | None = None) -> Logits:
    """The engine's evaluation of the whole test set, as at the end of the run, keeping the
    logits; with ``stop``, a signal it records ends the evaluation before the next batch
    (:class:`~speedrun.engine.evaluate.EvaluationStopped`)."""
    r, rt = loaded.recipe, loaded.runtime
    forward = loaded.model
    if rt.compile:                          # the run evaluated a compiled model: the same kernels
        _, forward, _ = compiled_model(("evaluate", str(loaded.folder)), lambda: loaded.model, rt)
    kept: list[tuple[torch.Tensor, ...]] = []
    indices: list[torch.Tensor] = []

    def batches():
        for x, y, idx in test.data.indexed_test_batches(r.eval.batch_size):
            indices.append(idx)
            yield x, y
    check = None if stop is None else (lambda running: stop.received if running else None)
    chunk = eval_chunk(r, loaded.channels, len(loaded.classes), loaded.image_size, rt.device.type)
    c_tta, c_plain, n = evaluate(forward, batches(), r.eval.tta, rt, r.eval.tta_fraction,
                                 on_batch=lambda total, plain, y: kept.append((total.cpu(), plain.cpu(), y.cpu())),
                                 stop=check, chunk=chunk)
    if not kept:
        raise DataError(f"{test.describe}: no test images could be read")
    total, plain, labels = (torch.cat(parts) for parts in zip(*kept))
    index = torch.cat([i for i in indices if len(i)])
    assert len(index) == n == len(labels)
    return Logits(total, plain, labels, index, int(c_tta), int(c_plain))


def per_class(confusion: np.ndarray, classes: list[str]) -> list[dict]:
    rows = []
    for k, name in enumerate(classes):
        tp, predicted, support = int(confusion[k, k]), int(confusion[:, k].sum()), int(confusion[k].sum())
        p = tp / predicted if predicted else None
        rec = tp / support if support else None
        f1 = 2 * p * rec / (p + rec) if p and rec else (0.0 if p is not None and rec is not None else None)
        rows.append({"class": name, "precision": p, "recall": rec, "f1": f1, "support": support,
                     "predicted": predicted})
    return rows


def top_k_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    return (logits.topk(k, dim=1).indices == labels[:, None]).any(1).sum().item() / len(labels)


def _image_name(test: TestSet, i: int) -> str:
    return test.files[i] if test.files is not None else f"test image {i}"


def mistake_images(loaded: LoadedRun, test: TestSet, index: list[int]) -> list[np.ndarray]:
    """The images as the model saw them (before normalising), uint8 H, W, C."""
    if test.arrays is not None:
        return [test.arrays[i].permute(1, 2, 0).numpy() for i in index]
    x, _, _ = decode_images(loaded, [test.root / test.files[i] for i in index])
    return list(x.permute(0, 2, 3, 1).numpy())


def predictions_csv(test: TestSet, out: Logits, classes: list[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["index", "image", "label", "predicted", "confidence", "predicted_no_tta"])
    prob = out.total.softmax(1)
    conf, pred = prob.max(1)
    for j, i in enumerate(out.index.tolist()):
        w.writerow([i, _image_name(test, i), classes[int(out.labels[j])], classes[int(pred[j])],
                    f"{float(conf[j]):.6f}", classes[int(out.plain[j].argmax())]])
    return buf.getvalue()


def evaluation_record(loaded: LoadedRun, test: TestSet, out: Logits, seconds: float) -> tuple[dict, np.ndarray]:
    classes, r, rt = loaded.classes, loaded.recipe, loaded.runtime
    n, k = len(out.labels), len(classes)
    pred = out.total.argmax(1)
    confusion = np.zeros((k, k), dtype=np.int64)
    np.add.at(confusion, (out.labels.numpy(), pred.numpy()), 1)
    acc, acc_plain = out.correct_tta / n, out.correct_plain / n
    summary = loaded.summary() or {}
    recorded = {key: summary.get(key) for key in ("test_acc", "test_acc_no_tta", "device", "device_name",
                                                  "precision", "compile")} if summary else None
    matches = None if not recorded or None in (recorded["test_acc"], recorded["test_acc_no_tta"]) else (
        recorded["test_acc"] == acc and recorded["test_acc_no_tta"] == acc_plain)
    conf = out.total.softmax(1).max(1).values
    wrong = torch.nonzero(pred != out.labels).flatten()
    worst = wrong[conf[wrong].argsort(descending=True, stable=True)][:MISTAKES_SHOWN].tolist()
    rows = per_class(confusion, classes)
    f1s = [c["f1"] for c in rows if c["f1"] is not None]
    return {
        "run": str(loaded.folder), "recipe": r.name, "dataset": r.data.dataset, "data": test.describe,
        "images": n, "skipped_images": test.data.skipped,
        "tta": r.eval.tta, "tta_fraction": r.eval.tta_fraction, "eval_batch_size": r.eval.batch_size,
        "test_acc": acc, "test_acc_no_tta": acc_plain, "recorded": recorded, "matches_record": matches,
        "top5_acc": top_k_accuracy(out.total, out.labels, 5) if k > 5 else None,
        "top5_acc_no_tta": top_k_accuracy(out.plain, out.labels, 5) if k > 5 else None,
        "macro_f1": sum(f1s) / len(f1s) if f1s else None,
        "classes": classes, "per_class": rows, "confusion": confusion.tolist(),
        "confusion_axes": "rows: true class, columns: predicted class (with TTA)",
        "mistakes": [{"index": int(out.index[j]), "image": _image_name(test, int(out.index[j])),
                      "true": classes[int(out.labels[j])], "predicted": classes[int(pred[j])],
                      "confidence": float(conf[j])} for j in worst],
        "files": {k: v for k, v in EVALUATION_FILES.items() if k != "record"},
        "device": rt.device.type, "device_name": device_name(rt.device), "precision": rt.precision,
        "compile": rt.compile, "seconds": seconds, "speedrun_version": __version__,
    }, confusion


def evaluate_command(args) -> int:
    stop = StopSignals()
    with stop.installed():
        try:
            return _evaluate_run(args, stop)
        except EvaluationStopped as stopped:
            print(f"speedrun: evaluate stopped by {signal.Signals(stopped.signum).name} during the evaluation of "
                  f"{args.run_dir}; nothing was written (run `speedrun evaluate {args.run_dir}` again)", flush=True)
            return INTERRUPTED_EXIT


def _evaluate_run(args, stop: StopSignals) -> int:
    from ..report.console import print_table
    started = time.perf_counter()
    folder = Path(args.run_dir)
    loaded = load_run(folder, args.device)
    check_output_folder(folder, "RUN_DIR")              # evaluate writes its files there: checked first
    test = open_test_set(loaded, args.data_dir)
    tta = loaded.recipe.eval.tta
    # from here a stop is read between batches: set before the line that says the evaluation started,
    # so that a Ctrl-C as that line appears stops it as any other, with its message
    stop.listening = True
    print(f"speedrun: evaluating {folder} on {test.describe}" + (f", {tta} TTA" if tta != "none" else ""),
          flush=True)
    out = run_evaluation(loaded, test, stop)            # complete: a signal from here on is only recorded
    record, confusion = evaluation_record(loaded, test, out, time.perf_counter() - started)
    mistakes = record["mistakes"]
    pictures = mistake_images(loaded, test, [m["index"] for m in mistakes])
    captions = [f"{m['true']} → {m['predicted']}\n{m['confidence']:.0%}" for m in mistakes]
    files = {name: folder / EVALUATION_FILES[name] for name in EVALUATION_FILES}
    atomic_write_bytes(files["confusion"], confusion_figure(confusion, loaded.classes))
    atomic_write_bytes(files["mistakes"], mistakes_figure(pictures, captions))
    atomic_write_text(files["predictions"], predictions_csv(test, out, loaded.classes))
    atomic_write_json(files["record"], record)           # last: it names the others
    if len(loaded.classes) <= PER_CLASS_PRINTED:
        _print_per_class(record["per_class"])
    print_table(f"evaluate {loaded.recipe.name} ({test.describe})", _rows(record, files))
    if stop.name is not None:
        print(f"speedrun: {stop.name} arrived as the evaluation ended: its files were written", flush=True)
    return 0


PER_CLASS_PRINTED = 30
"""Classes up to which evaluate prints the per-class table (evaluation.json always has it)."""


def _print_per_class(rows: list[dict]) -> None:
    from rich.table import Table

    from ..report.console import make_console
    table = Table("class", "precision", "recall", "F1", "images", title="per class (with TTA)")
    for c in rows:
        table.add_row(c["class"], _pct(c["precision"]), _pct(c["recall"]), _pct(c["f1"]), str(c["support"]))
    make_console().print(table)


def _rows(e: dict, files: dict) -> list[tuple[str, str]]:
    rows = [(f"accuracy ({e['tta']} TTA)", f"{e['test_acc']:.2%}"), ("without TTA", f"{e['test_acc_no_tta']:.2%}")]
    r = e["recorded"]
    if e["matches_record"] is not None:
        rows.append(("the run recorded", f"{r['test_acc']:.2%} ({r['test_acc_no_tta']:.2%} without TTA)"))
        rows.append(("equal to the record", "yes, exactly" if e["matches_record"] else
                     f"NO: the run evaluated on {r['device_name']} in {r['precision']}, this on {e['device_name']} in "
                     f"{e['precision']}; other kernels round differently (or the data changed)"))
    if e["top5_acc"] is not None:
        rows.append(("top-5 accuracy (TTA)", f"{e['top5_acc']:.2%}"))
    if e["macro_f1"] is not None:
        rows.append(("macro F1 (TTA)", f"{e['macro_f1']:.4f}"))
    if e["skipped_images"]:
        rows.append(("unreadable images skipped", str(e["skipped_images"])))
    rows += [("written into", f"{Path(e['run'])}: {', '.join(p.name for p in files.values())}"),
             ("seconds", f"{e['seconds']:.1f}")]
    return rows


def _pct(x) -> str:
    return "—" if x is None else f"{x:.1%}"

