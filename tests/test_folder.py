"""Image folders, .npz arrays, prepare/export, and the streamed pipeline, on real CIFAR-10
images exported as files."""
import json
import os
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch

from speedrun.data import DataError
from speedrun.errors import RunFolderError
from speedrun.recipe import load_recipe
from speedrun.data.sources.arrays import load_npz, open_npz
from speedrun.data.sources.folder import decode, folder_splits, scan, split
from speedrun.data.prepare import export, prepare, worker_pool
from speedrun.data.pipeline.stream import Decoding, EpochSampler, ImageItems

from test_cli import speedrun
from test_distributed import processes
from test_failures import assert_unchanged, check_refused, small_folder, snapshot


@pytest.fixture(scope="session")
def jpeg_dir(jpeg32):
    """CIFAR-10's first 512 training and 512 test images as JPEG files (quality 95)."""
    return jpeg32


@pytest.fixture(scope="session")
def png_dir(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("export") / "fmnist-png"
    export("fashion-mnist", "png", out, data_dir, limit=300)
    return out


def test_export_writes_the_imagenet_layout_losslessly_for_png(png_dir, fashion):
    train, val = folder_splits(png_dir, 0.0, 0)
    assert len(train) == 300 and len(val) == 300
    assert train.classes == sorted(c.replace("/", "-") for c in fashion.classes)
    i = 7
    path = png_dir / "train" / fashion.classes[int(fashion.train_y[i])].replace("/", "-") / f"{i:05d}.png"
    img = decode(path.read_bytes(), path, 1)
    assert np.array_equal(img[:, :, 0], fashion.train_x[i, 0].numpy())          # PNG is exact


def test_jpeg_export_is_close_to_the_original(jpeg_dir, cifar10):
    i = 3
    cls = cifar10.classes[int(cifar10.train_y[i])]
    path = jpeg_dir / "train" / cls / f"{i:05d}.jpg"
    img = decode(path.read_bytes(), path, 3).astype(float)
    ref = cifar10.train_x[i].permute(1, 2, 0).numpy().astype(float)
    assert np.abs(img - ref).mean() < 6                                     # quality 95


def test_single_folder_split_is_stratified_and_fixed_by_the_seed(jpeg_dir):
    whole = scan(jpeg_dir / "train")
    tr, va = split(whole, 0.2, seed=1)
    tr2, va2 = split(whole, 0.2, seed=1)
    assert va.files == va2.files and set(tr.files).isdisjoint(va.files) and len(tr) + len(va) == len(whole)
    for label in range(10):
        n = int((whole.labels == label).sum())
        assert int((va.labels == label).sum()) == max(1, round(n * 0.2))
    _, va3 = split(whole, 0.2, seed=2)
    assert va3.files != va.files


def test_folder_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="no such folder"):
        folder_splits(tmp_path / "nope", 0.1, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class sub-folders"):
        folder_splits(tmp_path / "empty", 0.1, 0)
    (tmp_path / "one" / "cats").mkdir(parents=True)
    with pytest.raises(DataError, match="no images found"):
        folder_splits(tmp_path / "one", 0.1, 0)
    (tmp_path / "one" / "cats" / "a.png").write_bytes(b"")
    with pytest.raises(DataError, match="only one class folder \\('cats'\\)"):
        folder_splits(tmp_path / "one", 0.1, 0)
    (tmp_path / "one" / "dogs").mkdir()
    with pytest.raises(DataError, match="class folder\\(s\\) 'dogs' hold no images"):
        folder_splits(tmp_path / "one", 0.1, 0)
    (tmp_path / "one" / "dogs" / "b.png").write_bytes(b"")
    with pytest.raises(DataError, match="val_fraction"):
        folder_splits(tmp_path / "one", 0.0, 0)


def test_a_corrupt_jpeg_is_named(jpeg_dir, tmp_path):
    bad = tmp_path / "bad.jpg"
    good = next((jpeg_dir / "train" / "cat").iterdir())
    bad.write_bytes(good.read_bytes()[:200])                       # truncated JPEG
    with pytest.raises(DataError, match=r"bad\.jpg: cannot decode this image.*skip_corrupt"):
        decode(bad.read_bytes(), bad, 3)
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image at all")
    with pytest.raises(DataError, match=r"junk\.png: cannot decode"):
        decode(junk.read_bytes(), junk, 3)


def test_streamed_items_are_deterministic_per_seed_epoch_and_index(jpeg_dir):
    train, _ = folder_splits(jpeg_dir, 0.0, 0)
    items = ImageItems(train, Decoding(3, True, "random_resized", (0.3, 1.0), (0.75, 4 / 3), seed=5))
    a, b, c = items[(4, 24, 0)], items[(4, 24, 0)], items[(4, 24, 1)]
    assert a[0].shape == (24, 24, 3) and a[0].dtype == torch.uint8          # HWC; batches become NCHW views
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    sampler = EpochSampler(len(train), 256, seed=5, train=True, size=24)
    first = [list(b) for b in sampler]
    assert len(first) == len(train) // 256 and len({i for b in first for i, _, _ in b}) == 256 * len(first)
    sampler.set_epoch(0, 24, skip=3)
    assert [list(b) for b in sampler] == first[3:]


def test_prepare_writes_a_memory_mapped_npz_equal_to_decoding(jpeg_dir, tmp_path):
    out = tmp_path / "c.npz"
    info = prepare(jpeg_dir, 32, out, workers=2)
    assert info["train"] == 512 and info["test"] == 512 and info["channels"] == 3
    with zipfile.ZipFile(out) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    arrays = open_npz(out)
    assert isinstance(arrays["x_train"], np.memmap)
    ds = load_npz(out)
    train, _ = folder_splits(jpeg_dir, 0.0, 0)
    path = train.path(11)
    assert np.array_equal(ds.train_x[11].permute(1, 2, 0).numpy(), decode(path.read_bytes(), path, 3))
    assert ds.train_y[11] == train.labels[11] and ds.classes == train.classes
    with pytest.raises(RunFolderError, match="already exists"):
        prepare(jpeg_dir, 32, out)


def test_the_decoding_and_writing_workers_are_not_forked_from_this_process():
    # forking a process that has threads (torch's, the progress bar's) can copy a held lock into a
    # child that then waits forever: prepare's and export's pool workers come from a fork server
    torch.ones(512, 512) @ torch.ones(512, 512)     # this process has torch's threads running
    with worker_pool(1) as pool:
        assert pool._ctx.get_start_method() == "forkserver"
        server = pool.apply(os.getppid)
        assert server != os.getpid()
        assert len(os.listdir(f"/proc/{server}/task")) == 1      # the fork server has one thread


def test_a_run_from_weights_starts_the_workers_server_before_opening_them(jpeg_dir):
    """Where a folder may be streamed and weights are to be opened, the decoding workers' fork
    server starts first (its start overlaps the weights' opening); a folder decoded into a cache
    (data.cache=on) or read without workers starts none. Each case in a fresh process, whose
    children are then counted."""
    probe = ("import os, sys, time\n"
             "from speedrun.recipe import load_recipe\n"
             "from speedrun.data.pipeline.dataset import start_workers_early\n"
             "start_workers_early(load_recipe('folder', sys.argv[1:]))\n"
             "time.sleep(0.5)\n"
             "kids = [t for t in os.listdir('/proc') if t.isdigit() and "
             "open(f'/proc/{t}/stat').read().rsplit(')', 1)[1].split()[1] == str(os.getpid())]\n"
             "print(len(kids))\n")
    def children(*sets):
        proc = subprocess.run([sys.executable, "-c", probe, f"data.path={jpeg_dir}", *sets], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])
    assert children("data.workers=1") == 2          # the fork server and multiprocessing's resource tracker
    assert children("data.workers=1", "data.cache=on") == 0
    assert children("data.workers=0") == 0


def test_the_streamed_loaders_workers_are_not_forked_from_the_training_process(jpeg_dir):
    # a data-parallel run has gloo's threads running when its loaders start their workers; a fork
    # could copy a lock one of them holds into a worker that then waits forever (one such run
    # hung in CI): the workers come from the fork server, as prepare's do
    from speedrun.data.pipeline.dataset import open_pipeline, open_source
    from speedrun.data.augment.batch import BatchAugment
    from speedrun.engine.runtime import resolve_runtime
    recipe, source = open_source(load_recipe("folder", [f"data.path={jpeg_dir}", "data.workers=2",
                                                        "model.widths=[8,16,16]", "data.batch_size=128"]))
    runtime = resolve_runtime(recipe.runtime, torch.device("cpu"))
    data = open_pipeline(source, recipe, runtime, seed=0)
    torch.ones(512, 512) @ torch.ones(512, 512)           # this process has torch's threads running
    gen = torch.Generator().manual_seed(0)
    augment = BatchAugment(recipe.augment, data.n_train, data.image_size, gen, runtime.device, resized_crop=False)
    batches = data.epoch(0, recipe.data.batch_size, augment, gen)
    x, y = next(batches)
    assert x.shape == (128, 3, 32, 32) and y.shape == (128,)
    me, deadline = os.getpid(), time.monotonic() + 60
    while True:             # (a worker takes its name once it runs: the first batch can come before the second does)
        procs = processes()
        workers = [pid for pid, (name, parent) in procs.items()
                   if name == "pt_data_worker" and procs.get(parent, ("", 0))[1] == me]
        if len(workers) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(workers) >= 2                              # grandchildren: the train loader's two
    assert not [pid for pid, (name, parent) in procs.items() if name == "pt_data_worker" and parent == me]
    server = procs[workers[0]][1]
    assert len(os.listdir(f"/proc/{server}/task")) == 1   # forked from a single-threaded server
    batches.close()


def test_prepare_with_a_corrupt_image_in_a_real_process_names_it_or_skips_it(jpeg_dir, tmp_path):
    images = small_folder(jpeg_dir, tmp_path / "images", n_train=20, n_val=5)
    bad = images / "train" / "dog" / "broken.jpg"
    bad.write_bytes(sorted((images / "train" / "dog").iterdir())[0].read_bytes()[:300])   # truncated
    out = tmp_path / "new" / "x.npz"                # its folder too is left behind on failure
    before = snapshot(tmp_path)

    def prepare_command(*extra):                    # the pool's workers in a fresh process, as users run it
        return subprocess.run([sys.executable, "-m", "speedrun", "data", "prepare", str(images), "--size", "32",
                               "--out", str(out), "--workers", "2", *extra],
                              capture_output=True, text=True, timeout=120)
    check_refused(prepare_command(), 1, bad, "cannot decode this image", "--skip-corrupt")
    assert_unchanged(tmp_path, before)
    proc = prepare_command("--skip-corrupt")
    assert proc.returncode == 0, proc.stderr
    ds = load_npz(out)
    assert len(ds.train_y) == 40 and len(ds.test_y) == 10


def test_npz_with_hwc_arrays_and_bad_inputs(tmp_path):
    x = np.random.default_rng(0).integers(0, 255, (20, 8, 8, 3), dtype=np.uint8)
    y = np.arange(20) % 4
    np.savez(tmp_path / "a.npz", x_train=x, y_train=y, x_test=x[:5], y_test=y[:5])
    ds = load_npz(tmp_path / "a.npz")
    assert ds.train_x.shape == (20, 3, 8, 8) and torch.equal(ds.train_x[2], torch.from_numpy(x[2]).permute(2, 0, 1))
    assert ds.num_classes == 4
    np.savez(tmp_path / "b.npz", x_train=x, y_train=y)
    with pytest.raises(DataError, match=r"missing arrays \['x_test', 'y_test'\]"):
        load_npz(tmp_path / "b.npz")
    np.savez(tmp_path / "c.npz", x_train=x.astype(np.float32), y_train=y, x_test=x[:5], y_test=y[:5])
    with pytest.raises(DataError, match="must be uint8"):
        load_npz(tmp_path / "c.npz")
    (tmp_path / "d.npz").write_bytes((tmp_path / "a.npz").read_bytes()[:300])
    with pytest.raises(DataError, match="not a readable .npz"):
        load_npz(tmp_path / "d.npz")


QUICK = ["--set", "train.epochs=16", "--set", "model.widths=[16,32,32]", "--set", "data.batch_size=256",
         "--set", "eval.every=0",
         "--set", "eval.tta=flip"]


@pytest.fixture(scope="module")
def streamed(jpeg_dir, tmp_path_factory):
    """The 32 px JPEG folder, hard-linked into a folder whose name holds quotes and a backslash,
    trained streamed by one worker process: (that folder, the run folder, the command's output)."""
    root = tmp_path_factory.mktemp("streamed")
    weird = _linked_copy(jpeg_dir, root / 'my "data" \\ it\'s')
    out = root / "run"
    proc = speedrun("train", "folder", "--data-dir", weird, "--out", out, *QUICK, "--set", "data.workers=1")
    return weird, out, proc


@pytest.mark.slow
def test_folder_trains_streamed_and_prepared_trains_resident(streamed, npz32, tmp_path):
    """The folder streamed (above) and decoded once by `speedrun data prepare` (the npz32
    fixture) then trained resident: both learn, and alike."""
    _, out, _ = streamed
    s = json.loads((out / "summary.json").read_text())
    config = (out / "config.toml").read_text()
    assert "image_size = 32" in config and "eval_crop = 1.0" in config          # chosen from the data
    speedrun("train", "folder", "--set", "data.dataset=npz", "--data-dir", npz32, "--out", tmp_path / "r", *QUICK)
    r = json.loads((tmp_path / "r" / "summary.json").read_text())
    # 32 steps on 512 images (about 27%): both above chance (10%, std 1.3 points on 512 images),
    # and the two paths agree
    assert s["test_acc"] > 0.18 and r["test_acc"] > 0.18
    assert abs(s["test_acc"] - r["test_acc"]) < 0.1


def test_unreadable_images_stop_the_run_or_are_skipped_and_counted(jpeg_dir, tmp_path):
    import shutil
    copy = tmp_path / "data"
    shutil.copytree(jpeg_dir, copy)
    victims = sorted((copy / "train" / "dog").iterdir())[:3]
    for v in victims:
        v.write_bytes(b"\xff\xd8\xff garbage")
    one_epoch = [*QUICK, "--set", "train.epochs=1"]                  # every training image once
    proc = speedrun("train", "folder", "--data-dir", copy, "--out", tmp_path / "a", *one_epoch, check=False)
    assert proc.returncode == 1 and "cannot decode this image" in proc.stderr and "dog" in proc.stderr
    assert "skip_corrupt" in proc.stderr
    proc = speedrun("train", "folder", "--data-dir", copy, "--out", tmp_path / "b", *one_epoch,
                    "--set", "data.skip_corrupt=true")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["skipped_images"] >= 3 and "unreadable images skipped" in proc.stdout


def test_host_and_device_random_resized_boxes_follow_the_same_rule():
    import random
    from speedrun.data.augment.resized_crop import sample_rrc_boxes
    from speedrun.data.pipeline.stream import rrc_box
    h, w, scale, ratio = 60, 90, (0.2, 0.9), (0.75, 4 / 3)
    host = np.array([rrc_box(h, w, scale, ratio, random.Random(i)) for i in range(4000)])
    dev = sample_rrc_boxes(4000, h, w, scale, ratio, torch.Generator().manual_seed(0), "cpu").numpy()
    for boxes in (host, dev):
        top, left, bh, bw = boxes.T
        assert (top >= 0).all() and (left >= 0).all() and (top + bh <= h).all() and (left + bw <= w).all()
    area = lambda b: (b[:, 2] * b[:, 3]).mean() / (h * w)
    aspect = lambda b: np.log(b[:, 3] / b[:, 2]).mean()
    assert abs(area(host) - area(dev)) < 0.02 and abs(aspect(host) - aspect(dev)) < 0.03


def test_streamed_run_resumes_bit_for_bit_from_a_mid_epoch_checkpoint(jpeg_dir, tmp_path):
    import shutil
    # 2 epochs of 4 steps: the last checkpoint, at step 6, is in the middle of the second epoch,
    # so the resume re-seeds a later epoch's workers and crops and continues inside it
    args = ["--data-dir", jpeg_dir, *QUICK, "--set", "train.epochs=2", "--set", "data.batch_size=128",
            "--set", "checkpoint.every_steps=3", "--set", "augment.crop=random_resized",
            "--set", "augment.rrc_scale=[0.5, 1.0]"]
    speedrun("train", "folder", "--out", tmp_path / "whole", *args)       # 8 steps; last checkpoint at 6
    cut = tmp_path / "cut"
    cut.mkdir()
    for name in ("config.toml", "checkpoint.pt"):
        shutil.copy(tmp_path / "whole" / name, cut / name)
    assert torch.load(cut / "checkpoint.pt", weights_only=True)["step"] == 6
    speedrun("train", "--resume", cut, "--data-dir", jpeg_dir)
    a = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    b = torch.load(cut / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _linked_copy(src, dst):
    """``dst``: the folder ``src`` with every file hard-linked (a copy where links are refused)."""
    import shutil
    shutil.copytree(src, dst, copy_function=_link_or_copy)
    return dst


def _link_or_copy(src, dst):
    import shutil
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def test_a_data_folder_with_quotes_and_a_backslash_in_its_name_is_read_where_it_is(streamed, jpeg_dir, tmp_path):
    """The folder --data-dir names is the one the run reads and records, whatever characters its
    name holds, and `speedrun evaluate --data-dir` reads another such folder as given."""
    weird, out, proc = streamed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_path"] == str(weird) and load_recipe(str(out / "config.toml")).data.path == str(weird)
    assert "test accuracy" in proc.stdout and summary["test_acc"] > 0.18        # learned (chance: 10%)
    other = _linked_copy(jpeg_dir, tmp_path / "back\\slash")
    speedrun("evaluate", out, "--data-dir", other, "--device", "cpu")
    e = json.loads((out / "evaluation.json").read_text())
    assert str(other) in e["data"] and e["matches_record"] is True and e["images"] == 512


def test_npz_members_hold_exactly_the_kept_rows_in_order(tmp_path, monkeypatch):
    """prepare's .npz members (np.load reads them back, checking each member's CRC): every row,
    or the kept ones of a mask (skipped images at the ends, alone, in runs, all), in slices
    smaller than a run, and a member of strings."""
    import zipfile
    from speedrun.data import prepare as prep
    monkeypatch.setattr(prep, "MEMBER_SLICE", 3 * 192)             # three rows a slice
    arr = np.random.default_rng(0).integers(0, 256, (50, 3, 8, 8), dtype=np.uint8)
    rng = np.random.default_rng(1)
    masks = [None, np.ones(50, bool), np.zeros(50, bool), np.arange(50) % 2 == 0, rng.random(50) < 0.7,
             np.r_[np.zeros(5, bool), np.ones(40, bool), np.zeros(5, bool)], np.arange(50) != 17]
    for k, mask in enumerate(masks):
        path = tmp_path / f"m{k}.npz"
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            prep._write_member(zf, "x", arr, mask)
            prep._write_member(zf, "classes", np.asarray(["cat", "dog", "bird"]))
        with np.load(path) as z:
            assert np.array_equal(z["x"], arr if mask is None else arr[mask]), k
            assert z["classes"].tolist() == ["cat", "dog", "bird"]
