"""Using a finished run: `speedrun predict` and `speedrun evaluate` on a folder run trained for
real (a subprocess) on the CIFAR-10 JPEG export, and the shared loader they stand on."""
import csv
import hashlib
import io
import json
import shutil

import pytest
import torch

from speedrun.cli import main
from speedrun.data.pipeline.dataset import FolderSource, open_pipeline
from speedrun.data.sources.folder import folder_splits
from speedrun.use import load_run, prepare_images
from test_cli import speedrun

FOLDER_RUN = ["--set", "model.widths=[16,32,32]", "--set", "data.batch_size=128", "--set", "train.epochs=1",
              "--set", "data.workers=1", "--set", "eval.batch_size=200", "--device", "cpu"]
RUN_FILES = ("config.toml", "model.pt", "summary.json", "metrics.jsonl", "preprocessing.json")


def digests(folder):
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in RUN_FILES}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, jpeg32):
    """A `folder` run (4 steps) on jpeg32 in a real process, then `speedrun evaluate` on it:
    (run folder, evaluation.json, predictions.csv rows, digests of the run's files before)."""
    run = tmp_path_factory.mktemp("use") / "run"
    speedrun("train", "folder", "--data-dir", jpeg32, "--out", run, *FOLDER_RUN)
    before = digests(run)
    assert main(["evaluate", str(run), "--device", "cpu"]) == 0
    rows = list(csv.DictReader((run / "predictions.csv").open()))
    return run, json.loads((run / "evaluation.json").read_text()), rows, before


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------
# evaluate
# ------------------------------------------------------------------------------------------

def test_evaluate_reproduces_the_recorded_accuracy_exactly(evaluated):
    run, e, rows, before = evaluated
    summary = json.loads((run / "summary.json").read_text())
    assert e["test_acc"] == summary["test_acc"] and e["test_acc_no_tta"] == summary["test_acc_no_tta"]
    assert e["matches_record"] is True and e["tta"] == summary["tta"] == "flip_translate"
    assert e["images"] == 512 and e["eval_batch_size"] == 200            # three batches, the last one partial
    # the per-image predictions are the ones the accuracies count
    assert len(rows) == 512 and [int(r["index"]) for r in rows] == list(range(512))
    assert sum(r["predicted"] == r["label"] for r in rows) / 512 == summary["test_acc"]
    assert sum(r["predicted_no_tta"] == r["label"] for r in rows) / 512 == summary["test_acc_no_tta"]
    assert digests(run) == before                                        # the run's own files untouched


def test_evaluate_writes_per_class_figures_and_mistakes(evaluated):
    run, e, rows, _ = evaluated
    confusion = torch.tensor(e["confusion"])
    assert confusion.shape == (10, 10) and confusion.sum() == 512
    assert confusion.trace().item() / 512 == e["test_acc"]
    for k, c in enumerate(e["per_class"]):
        assert c["class"] == e["classes"][k] and c["support"] == confusion[k].sum().item()
        if c["recall"] is not None:
            assert c["recall"] == confusion[k, k].item() / c["support"]
    assert e["top5_acc"] >= e["test_acc"] and 0 < e["top5_acc"] <= 1
    by_image = {r["image"]: r for r in rows}
    confidences = [m["confidence"] for m in e["mistakes"]]
    assert 0 < len(e["mistakes"]) <= 16 and confidences == sorted(confidences, reverse=True)
    for m in e["mistakes"]:
        r = by_image[m["image"]]
        assert m["true"] == r["label"] != m["predicted"] == r["predicted"]
    wrong = [float(r["confidence"]) for r in rows if r["predicted"] != r["label"]]
    assert confidences[0] == pytest.approx(max(wrong), abs=1e-6)
    for name in ("confusion.png", "mistakes.png"):
        assert (run / name).read_bytes()[:4] == b"\x89PNG"
    assert not list(run.glob(".*.tmp"))


# ------------------------------------------------------------------------------------------
# predict
# ------------------------------------------------------------------------------------------

def some_val_images(rows, jpeg32, n=8):
    """``n`` validation images, as varied in their predicted class as the model allows."""
    by_class = {}
    for r in rows:
        by_class.setdefault(r["predicted_no_tta"], []).append(r)
    picked = []
    while len(picked) < n:
        for group in by_class.values():
            if group and len(picked) < n:
                picked.append(group.pop(0))
    return [jpeg32 / "val" / r["image"] for r in picked], picked


def test_prepared_images_are_the_runs_evaluation_batch_bit_for_bit(evaluated, jpeg32):
    run, *_ = evaluated
    loaded = load_run(run, "cpu")
    r, pre = loaded.recipe, loaded.preprocessing
    train, val = folder_splits(jpeg32, r.data.val_fraction, r.data.split_seed)
    source = FolderSource(train, val, pre["channels"], pre["image_size"][0], torch.tensor(pre["mean"]),
                          torch.tensor(pre["std"]), str(jpeg32))
    x_eval, _ = next(iter(open_pipeline(source, r, loaded.runtime, 0).test_batches(r.eval.batch_size)))
    x, kept, skipped = prepare_images(loaded, [val.path(i) for i in range(len(x_eval))])
    assert skipped == [] and len(kept) == len(x_eval) == 200 and x.dtype == torch.float32
    # the pipeline stores batches in the run's precision (bf16 where "auto" chose it): the same cast
    assert x_eval.dtype == loaded.runtime.dtype and torch.equal(x.to(x_eval.dtype), x_eval)


def test_predict_gives_the_classes_of_the_runs_evaluation(evaluated, jpeg32, tmp_path):
    run, _, rows, _ = evaluated
    paths, picked = some_val_images(rows, jpeg32)
    assert len({r["predicted_no_tta"] for r in picked}) >= 2          # else the comparison would prove little
    out = tmp_path / "p.csv"
    proc = speedrun("predict", run, *paths, "--format", "csv", "--out", out, "--device", "cpu", "--batch-size", 3)
    assert "wrote 8 predictions" in proc.stderr
    got = list(csv.DictReader(out.open()))
    assert [g["image"] for g in got] == [str(p) for p in paths]
    assert [g["class"] for g in got] == [r["predicted_no_tta"] for r in picked]
    assert all(g["rank"] == "1" for g in got)


def test_predict_with_tta_gives_the_evaluations_tta_classes(evaluated, jpeg32, tmp_path, capsys):
    run, _, rows, _ = evaluated
    paths, picked = some_val_images(rows, jpeg32)
    code, out, _ = run_cli(capsys, "predict", run, *paths, "--tta", "--format", "json", "--device", "cpu")
    got = json.loads(out)
    assert code == 0 and got["tta"] == "flip_translate" and got["skipped"] == []
    assert [p["top"][0]["class"] for p in got["predictions"]] == [r["predicted"] for r in picked]
    assert [p["top"][0]["probability"] for p in got["predictions"]] == pytest.approx(
        [float(r["confidence"]) for r in picked], abs=2e-6)


def test_predict_top_k_formats_folders_and_globs(evaluated, jpeg32, capsys):
    run, *_ = evaluated
    code, out, _ = run_cli(capsys, "predict", run, jpeg32 / "val" / "frog", "--top-k", 3, "--format", "json",
                           "--device", "cpu")
    preds = json.loads(out)["predictions"]
    assert code == 0 and len(preds) == len(list((jpeg32 / "val" / "frog").glob("*.jpg")))
    for p in preds:
        probs = [t["probability"] for t in p["top"]]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6
        assert len({t["class"] for t in p["top"]}) == 3
    code, out, _ = run_cli(capsys, "predict", run, str(jpeg32 / "val" / "**" / "0000*.jpg"), "--top-k", 2,
                           "--format", "csv", "--device", "cpu")
    table = list(csv.reader(io.StringIO(out)))
    assert code == 0 and table[0] == ["image", "rank", "class", "class_index", "probability"]
    assert len(table) > 3 and len(table[1:]) % 2 == 0 and {r[1] for r in table[1:]} == {"1", "2"}
    code, out, _ = run_cli(capsys, "predict", run, jpeg32 / "val" / "cat" / "00000.jpg", "--device", "cpu")
    assert code == 0 and "00000.jpg" in out and "%" in out


# ------------------------------------------------------------------------------------------
# failures: one line each, nothing written
# ------------------------------------------------------------------------------------------

def test_an_image_that_is_not_one_is_named_skipped_and_counted(evaluated, jpeg32, tmp_path, capsys):
    run, *_ = evaluated
    bad = tmp_path / "notes.jpg"
    bad.write_text("not a picture")
    good = jpeg32 / "val" / "dog" / "00012.jpg"
    code, out, err = run_cli(capsys, "predict", run, bad, good, tmp_path / "absent.png", "--format", "csv",
                             "--device", "cpu")
    assert code == 0 and len(out.splitlines()) == 2 and str(good) in out
    assert f"skipped {bad}: cannot decode this image" in err and "absent.png: no such file" in err
    assert "2 of 3 input(s) skipped" in err and "Traceback" not in err
    code, out, err = run_cli(capsys, "predict", run, bad, "--device", "cpu")
    assert code == 1 and "none of the 1 input(s) given is a readable image" in err and out == ""


def test_predict_and_evaluate_refuse_what_is_not_a_finished_run(evaluated, tmp_path, capsys):
    run, *_ = evaluated
    img = tmp_path / "x.png"
    code, _, err = run_cli(capsys, "predict", tmp_path / "nowhere", img)
    assert code == 2 and "no such run folder" in err and len(err.splitlines()) == 1
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished, ignore=shutil.ignore_patterns("model.pt", "evaluation.json", "*.png", "*.csv"))
    for command in (["predict", unfinished, img], ["evaluate", unfinished]):
        code, _, err = run_cli(capsys, *command)
        assert code == 2 and "not a finished run: missing model.pt" in err and "must have finished" in err
        assert len(err.splitlines()) == 1
    assert not (unfinished / "evaluation.json").exists()
    (unfinished / "model.pt").write_bytes((run / "model.pt").read_bytes()[:5000])        # truncated
    code, _, err = run_cli(capsys, "evaluate", unfinished)
    assert code == 1 and "model.pt: cannot read the weights" in err and len(err.splitlines()) == 1
    assert not (unfinished / "evaluation.json").exists()


def test_predict_options_are_checked_before_any_work(evaluated, jpeg32, tmp_path, capsys):
    run, *_ = evaluated
    img = jpeg32 / "val" / "cat" / "00000.jpg"
    code, _, err = run_cli(capsys, "predict", run, img, "--format", "xml")
    assert code == 2 and "--format 'xml': choose one of table, csv, json" in err
    code, _, err = run_cli(capsys, "predict", run, img, "--top-k", 11, "--device", "cpu")
    assert code == 2 and "only 10 classes" in err
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    code, _, err = run_cli(capsys, "predict", run, img, "--out", blocker / "p.csv")
    assert code == 2 and "is a file, so no folder can be made under it" in err
    code, _, err = run_cli(capsys, "predict", run, img, "--out", blocker)
    assert code == 2 and "already exists" in err and blocker.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_evaluate_refuses_data_that_is_not_the_runs(evaluated, jpeg32, tmp_path, capsys):
    run, *_ = evaluated
    other = tmp_path / "other"
    for split in ("train", "val"):
        for name in ("apples", "pears"):
            (other / split / name).mkdir(parents=True)
            shutil.copy(jpeg32 / "val" / "cat" / "00000.jpg", other / split / name / "a.jpg")
    before = sorted(p.name for p in run.iterdir())
    code, _, err = run_cli(capsys, "evaluate", run, "--data-dir", other, "--device", "cpu")
    assert code == 1 and "its classes (apples, pears) are not the run's (airplane, automobile" in err
    assert len(err.splitlines()) == 1 and sorted(p.name for p in run.iterdir()) == before


def array_run(folder, npz):
    """A run folder on arrays made by hand (untrained weights): what train writes, without training."""
    from speedrun.data.sources.arrays import load_npz
    from speedrun.data.pipeline.resident import ResidentData
    from speedrun.models import build_model
    from speedrun.recipe import load_recipe
    recipe = load_recipe("fashion-mnist", ["data.dataset=npz", f"data.path={str(npz)!r}", "model.widths=[8,8,8]"])
    ds = load_npz(npz)
    data = ResidentData(ds, torch.device("cpu"), torch.float32, torch.channels_last)
    folder.mkdir()
    (folder / "config.toml").write_text(recipe.to_toml())
    torch.save(build_model(recipe.model, 1, 10).state_dict(), folder / "model.pt")
    (folder / "preprocessing.json").write_text(json.dumps({
        "dataset": "npz", "channels": 1, "image_size": [28, 28], "resize": "to_image_size", "eval_crop": 1.0,
        "decoder": "auto", "mean": data.mean.tolist(), "std": data.std.tolist(), "classes": ds.classes,
        "tta": "flip_translate"}))
    return ds, data


def test_an_array_runs_images_are_prepared_as_its_pipeline_did(fashion_small, tmp_path):
    from PIL import Image
    ds, data = array_run(tmp_path / "run", fashion_small)
    paths = []
    for i in range(8):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(ds.test_x[i, 0].numpy()).save(paths[-1])
    loaded = load_run(tmp_path / "run", "cpu")
    x, kept, skipped = prepare_images(loaded, paths)
    x_eval, _ = next(iter(data.test_batches(8)))
    assert kept == paths and skipped == [] and torch.equal(x, x_eval)
    big = tmp_path / "big.png"                         # another size: brought to 28 x 28
    Image.fromarray(ds.test_x[0, 0].numpy()).resize((56, 70)).convert("RGB").save(big)
    x, _, _ = prepare_images(loaded, [big])
    assert x.shape == (1, 1, 28, 28) and (x - x_eval[:1]).abs().mean() < 0.5
