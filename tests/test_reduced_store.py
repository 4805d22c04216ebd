"""The reduced store (`speedrun data prepare SRC --out STORE --reduce --max-side PX`): the folder
again as smaller JPEGs in its own layout, read by training as any folder; its refusals; and
benchmarks/decode_rate.py on a few images."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from speedrun.data.reduced_store import MANIFEST, reduce_store
from speedrun.data.sources.folder import folder_splits
from test_cli import speedrun
from test_failures import assert_unchanged, check_refused, small_folder, snapshot
from test_predict import FOLDER_RUN

ROOT = Path(__file__).resolve().parents[1]


def files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


@pytest.fixture(scope="module")
def store160(tmp_path_factory, imagenet224):
    """The 224 px photo folder reduced to 160 px by the real command (two pool workers)."""
    out = tmp_path_factory.mktemp("reduced") / "store-160"
    proc = speedrun("data", "prepare", imagenet224, "--out", out, "--reduce", "--max-side", 160, "--quality", 90,
                    "--workers", 2)
    assert "reduced" in proc.stdout and "resized" in proc.stdout
    return out


def test_a_store_keeps_every_image_split_and_class_with_the_longer_side_reduced(store160, imagenet224):
    assert files(store160) == files(imagenet224)                # every file, under its own name
    for (a, b) in zip(folder_splits(imagenet224, 0.0, 0), folder_splits(store160, 0.0, 0)):
        assert a.classes == b.classes and a.files == b.files and np.array_equal(a.labels, b.labels)
    train, val = folder_splits(store160, 0.0, 0)
    for images in (train, val):
        for i in range(0, len(images), 37):
            with Image.open(images.path(i)) as im:
                assert im.format == "JPEG" and im.size == (160, 160) and im.mode == "RGB"
    # the pixels are the source's, resized (antialiased), not something else
    path = val.path(5)
    src = np.asarray(Image.open(imagenet224 / "val" / path.relative_to(store160 / "val")).convert("RGB")
                     .resize((160, 160), Image.LANCZOS), dtype=np.float32)
    assert np.abs(np.asarray(Image.open(path), dtype=np.float32) - src).mean() < 4


def test_the_manifest_is_written_last_and_says_what_the_store_holds(store160, imagenet224):
    m = json.loads((store160 / MANIFEST).read_text())
    assert m["format"] == "speedrun reduced store" and m["source"] == str(imagenet224.resolve())
    assert m["max_side"] == 160 and m["quality"] == 90 and m["splits"] == ["train", "val"]
    for split in ("train", "val"):
        expected = {c.name: len(list(c.iterdir())) for c in (imagenet224 / split).iterdir()}
        assert m["counts"][split] == expected
    assert m["images"] == 768 and m["resized"] == 768 and m["copied"] == m["re-encoded"] == m["skipped"] == 0
    assert not [p for p in store160.parent.iterdir() if p.name.startswith(".")]     # no staging folder left
    assert (store160 / MANIFEST).stat().st_mtime >= max(p.stat().st_mtime for p in store160.rglob("*.jpg"))


def test_training_reads_a_store_as_a_folder(tmp_path, imagenet224):
    store = tmp_path / "store-32"
    m = reduce_store(imagenet224, store, 32, 90, workers=0)      # (in this process: the path without a pool)
    assert m["resized"] == 768
    run = tmp_path / "run"
    speedrun("train", "folder", "--data-dir", store, "--out", run, *FOLDER_RUN)
    summary = json.loads((run / "summary.json").read_text())
    assert Path(summary["data_path"]).resolve() == store.resolve() and 0 < summary["test_acc"] <= 1


def test_small_jpegs_are_copied_byte_for_byte(tmp_path, jpeg32):
    m = reduce_store(jpeg32, tmp_path / "store", 64, 90, workers=1)
    assert m["copied"] == 1024 and m["resized"] == m["re-encoded"] == 0
    assert files(tmp_path / "store") == files(jpeg32)
    assert all((tmp_path / "store" / f).read_bytes() == (jpeg32 / f).read_bytes() for f in files(jpeg32))


def make(path: Path, mode: str, size, fmt: str, value=100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == "I;16":
        Image.fromarray(np.full(size[::-1], 65535 // 2, dtype=np.uint16)).save(path, format=fmt)
    else:
        Image.new(mode, size, value).save(path, format=fmt)


def test_grey_stays_grey_and_other_modes_become_rgb_jpegs(tmp_path):
    src = tmp_path / "mixed"                        # one folder of classes, split when training
    make(src / "cat" / "a.jpg", "L", (300, 200), "JPEG")
    make(src / "cat" / "b.png", "RGBA", (400, 100), "PNG", (10, 200, 30, 128))
    make(src / "cat" / "c.png", "P", (50, 50), "PNG", 3)
    make(src / "dog" / "d.jpg", "RGB", (20, 20), "JPEG", (200, 10, 10))
    make(src / "dog" / "e.tif", "I;16", (300, 300), "TIFF")
    make(src / "dog" / "f.png", "RGB", (30, 30), "PNG", (1, 2, 3))
    make(src / "dog" / "f.jpg", "RGB", (30, 30), "JPEG", (9, 9, 9))
    m = reduce_store(src, tmp_path / "store", 64, 80, workers=0)
    store = tmp_path / "store"
    expect = {"cat/a.jpg": ("L", (64, 43)), "cat/b.jpg": ("RGB", (64, 16)), "cat/c.jpg": ("RGB", (50, 50)),
              "dog/d.jpg": ("RGB", (20, 20)), "dog/e.jpg": ("L", (64, 64)), "dog/f.jpg": ("RGB", (30, 30)),
              "dog/f.png.jpg": ("RGB", (30, 30))}
    assert files(store) == sorted(expect)
    for name, (mode, size) in expect.items():
        with Image.open(store / name) as im:
            assert (im.format, im.mode, im.size) == ("JPEG", mode, size), name
    assert (store / "dog/d.jpg").read_bytes() == (src / "dog/d.jpg").read_bytes()
    assert abs(np.asarray(Image.open(store / "dog/e.jpg")).mean() - 127.5) < 2   # 16 bits scaled, not clipped
    assert m["splits"] == ["."] and m["counts"] == {".": {"cat": 3, "dog": 4}}
    assert (m["copied"], m["resized"], m["re-encoded"]) == (2, 3, 2)
    train, val = folder_splits(store, 0.3, 0)
    assert train.classes == ["cat", "dog"] and len(train) + len(val) == 7


def test_a_train_only_folder_keeps_its_files_and_the_split_is_made_when_training(tmp_path, jpeg32):
    src = small_folder(jpeg32, tmp_path / "src", n_train=20, n_val=0)
    for folder in (src / "val").iterdir():
        folder.rmdir()
    (src / "val").rmdir()
    store = tmp_path / "store"
    reduce_store(src, store, 16, 90, workers=0)
    assert sorted(p.name for p in store.iterdir()) == [MANIFEST, "train"]
    for a, b in zip(folder_splits(src, 0.25, 3), folder_splits(store, 0.25, 3)):
        assert a.files == b.files and np.array_equal(a.labels, b.labels)


def test_tiny_imagenet_layout_keeps_its_annotations(tmp_path, tiny64):
    store = tmp_path / "store"
    reduce_store(tiny64, store, 32, 90, workers=1)
    assert (store / "val" / "val_annotations.txt").read_text() == (tiny64 / "val" / "val_annotations.txt").read_text()
    for a, b in zip(folder_splits(tiny64, 0.0, 0), folder_splits(store, 0.0, 0)):
        assert a.files == b.files and np.array_equal(a.labels, b.labels)
    with Image.open(store / "val" / "images" / "val_0.jpg") as im:
        assert im.size == (32, 32)


def test_refusals_are_one_line_and_leave_the_disk_as_it_was(tmp_path, jpeg32, cli):
    src = small_folder(jpeg32, tmp_path / "src", n_train=3, n_val=1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken.txt").write_text("the user's file\n")
    (tmp_path / "not-images").mkdir()
    (tmp_path / "not-images" / "notes.txt").write_text("no images here\n")
    before = snapshot(tmp_path)
    reduce = lambda *extra, out=tmp_path / "new": cli("data", "prepare", src, "--out", out, "--reduce", *extra)
    check_refused(reduce("--max-side", 320, out=tmp_path / "taken"), 2, tmp_path / "taken", "already exists")
    check_refused(reduce("--max-side", 320, out=tmp_path / "taken.txt"), 2, tmp_path / "taken.txt", "already exists")
    check_refused(reduce("--max-side", 320, out=src / "store"), 2, "inside the source folder")
    for bad in (8, 15, 4097):
        check_refused(reduce("--max-side", bad), 2, f"--max-side {bad}", "16 to 4096")
    for bad in (0, 101):
        check_refused(reduce("--max-side", 320, "--quality", bad), 2, f"--quality {bad}", "1 to 100")
    check_refused(reduce(), 2, "--max-side")
    check_refused(reduce("--max-side", 320, "--size", 32), 2, "--size")
    check_refused(cli("data", "prepare", src, "--out", tmp_path / "x.npz", "--max-side", 320), 2, "--reduce")
    check_refused(cli("data", "prepare", src, "--out", tmp_path / "x.npz"), 2, "--size")
    check_refused(cli("data", "prepare", tmp_path / "not-images", "--out", tmp_path / "new", "--reduce",
                      "--max-side", 320), 1, tmp_path / "not-images", "class sub-folders")
    check_refused(cli("data", "prepare", tmp_path / "missing", "--out", tmp_path / "new", "--reduce",
                      "--max-side", 320), 1, tmp_path / "missing", "no such folder")
    assert_unchanged(tmp_path, before)


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT's default disposition in the child: a test run that a shell started in the background
    (`cmd &`) ignores SIGINT, and a process started from it inherits that (Python then never raises
    KeyboardInterrupt, and the store is written to the end)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_an_interrupted_store_leaves_nothing(tmp_path, imagenet224):
    src = tmp_path / "src"          # the photos 16 times over (hard links: no copies), so that the store
    for f in imagenet224.rglob("*.jpg"):            # is still being written when the signal comes, however busy
        for k in range(16):                         # the machine (it is stopped early: the size costs nothing)
            dest = src / f.relative_to(imagenet224).parent / f"{k}-{f.name}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dest)
    before = snapshot(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "speedrun", "data", "prepare", str(src), "--out",
                             str(tmp_path / "store"), "--reduce", "--max-side", "32", "--workers", "1"],
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    deadline = time.monotonic() + 120

    def writing() -> bool:                          # a staged image written: the store is under way
        return any(f.is_file() for d in tmp_path.glob(".store-*") for f in d.rglob("*.jpg"))
    while not writing() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the store was finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)                 # Ctrl-C while the store is being written
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130 and "interrupted" in err, err
    assert_unchanged(tmp_path, before)


def test_an_unreadable_image_is_named_or_skipped_and_listed(tmp_path, jpeg32, cli):
    src = small_folder(jpeg32, tmp_path / "src", n_train=10, n_val=2)
    bad = src / "train" / "dog" / "broken.jpg"
    bad.write_bytes(min((src / "train" / "dog").iterdir()).read_bytes()[:300])      # truncated
    out = tmp_path / "new" / "store"                # its parent too is left behind on failure
    before = snapshot(tmp_path)
    args = ("data", "prepare", src, "--out", out, "--reduce", "--max-side", 16, "--workers", 1)
    check_refused(cli(*args), 1, bad, "cannot decode this image", "--skip-corrupt")
    assert_unchanged(tmp_path, before)
    rc, err = cli(*args, "--skip-corrupt")
    assert rc == 0 and not err
    m = json.loads((out / MANIFEST).read_text())
    assert m["skipped"] == 1 and m["skipped_files"][0]["path"] == str(bad)
    assert m["counts"]["train"] == {"cat": 10, "dog": 10} and not (out / "train" / "dog" / "broken.jpg").exists()


def test_decode_rate_benchmark_writes_its_record(tmp_path, data_dir):
    out = tmp_path / "decode-rate.json"
    args = ["--work", tmp_path / "work", "--data-dir", data_dir, "--limit", 50, "--side", 64, "--sides", "48,32",
            "--rounds", 1, "--size", 24, "--out", out]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_rate.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["benchmark"] == "decode rate per core" and "prediction" in record["prediction"]
    kinds = {(m["decoder"], m["images_from"]) for m in record["measurements"]}
    assert len(kinds) == 12 and all(m["median_images_per_cpu_s"] > 0 for m in record["measurements"])
    assert [(p["source"], p["max_side"]) for p in record["store_passes"]] == \
        [("cifar10 64 px", 48), ("cifar10 64 px", 32), ("photo-like 500x375", 48), ("photo-like 500x375", 32)]
    assert set(record["speedup_over_source"]["auto"]) == {n for _, n in kinds} - {"cifar10 64 px", "photo-like 500x375"}
    assert record["machine"]["cpu_model"] and record["torch_version"]
