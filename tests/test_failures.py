"""Every failure ends in one clear message, and a refused command changes nothing on disk.

Each class of failure found by the reliability probe is driven through the real command
line in a subprocess (``python -m speedrun``), asserting the exit code (1: data and runtime
failures, 2: bad options, recipes and output paths), a message that names the culprit (the
file, field, option or step), no traceback, and a snapshot of the disk (relative paths and
sha256 of every file) equal before and after. Further cases of the same class call
``speedrun.cli.main`` in this process, which is the same code path minus the interpreter
start-up. Read-only and full disks are real tmpfs mounts (the tests run as root, where
chmod stops nothing); the data are the real CIFAR-10 and Fashion-MNIST files.
"""
import errno
import gzip
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from speedrun.data.sources.skipped import listed, skipped_line
from speedrun.engine.checkpoint import FORMAT as CHECKPOINT_FORMAT
from speedrun.errors import RunFolderError
from speedrun.files import atomic_torch_save, atomic_write_json, make_folder
from speedrun.recipe import shipped_recipes

from test_cli import speedrun

# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------

ERROR_LINE = re.compile(r"^speedrun(?: [\w-]+)*: error: ", re.M)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: relative path -> sha256 of its bytes ('dir' for folders)."""
    entries = {}
    for path in sorted(Path(root).rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            entries[rel] = "link -> " + os.readlink(path)
        elif path.is_dir():
            entries[rel] = "dir"
        else:
            entries[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


def assert_unchanged(root: Path, before: dict[str, str]) -> None:
    after = snapshot(root)
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    assert not (added or removed or changed), f"disk changed: added {added}, removed {removed}, changed {changed}"


def outcome(result) -> tuple[int, str]:
    if isinstance(result, subprocess.CompletedProcess):
        return result.returncode, result.stderr
    return result


def check_refused(result, code: int, *culprits) -> str:
    """Exit ``code``, exactly one ``speedrun...: error:`` line, no traceback, every culprit named."""
    rc, err = outcome(result)
    assert rc == code, f"exit code {rc}, expected {code}; stderr:\n{err}"
    assert "Traceback" not in err and "internal error" not in err, err
    assert len(ERROR_LINE.findall(err)) == 1, f"not one error message:\n{err}"
    for culprit in culprits:
        assert str(culprit) in err, f"{str(culprit)!r} is not named in:\n{err}"
    return err


@pytest.fixture(autouse=True)
def isolated(tmp_path, tmp_path_factory, monkeypatch):
    """Run in tmp_path (so a default runs/ folder would show in its snapshot), with a private
    home and crash folder outside it, and no network."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
    monkeypatch.setenv("SPEEDRUN_CRASH_DIR", str(tmp_path_factory.mktemp("crashes")))
    monkeypatch.setenv("SPEEDRUN_MIRROR", "http://127.0.0.1:9/")


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(name, size)``: a fresh tmpfs mounted at tmp_path/name, unmounted afterwards."""
    mounted = []

    def mount(name: str, size: str = "4m") -> Path:
        point = tmp_path / name
        point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], check=True)
        mounted.append(point)
        return point
    yield mount
    for point in reversed(mounted):
        if subprocess.run(["umount", str(point)]).returncode:
            subprocess.run(["umount", "-l", str(point)], check=True)


def read_only(point: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
    with pytest.raises(OSError):                    # really read-only, even for root
        (point / "probe").write_bytes(b"x")


def fill(point: Path, leave: int = 512 * 1024) -> None:
    """Fill the disk at ``point`` with a file, leaving about ``leave`` bytes free."""
    free = shutil.disk_usage(point).free
    (point / "filler").write_bytes(bytes(max(0, free - leave)))
    assert shutil.disk_usage(point).free < 1 << 20


def fill_up(point: Path) -> None:
    """Fill the disk at ``point`` to its last byte: a file written until the disk refuses more."""
    fd = os.open(point / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)
    assert shutil.disk_usage(point).free == 0


def small_args(data, dataset: str = "npz", batch: int = 256) -> list:
    """cifar10-94 shrunk to a few seconds on the CPU, on an .npz file or an image folder."""
    return ["cifar10-94", "--set", f"data.dataset={dataset}", "--data-dir", data, "--set", "model.widths=[8,16,16]",
            "--set", f"data.batch_size={batch}", "--set", "train.epochs=0.5", "--set", "eval.tta=none"]


def tiny_fashion(data) -> list:
    """fashion-mnist on the Fashion-MNIST slice, shrunk as :func:`small_args` (a second or two)."""
    return ["fashion-mnist", *small_args(data)[1:]]


def small_folder(src: Path, dest: Path, classes=("cat", "dog"), n_train: int = 40, n_val: int = 10) -> Path:
    """A copy of part of an exported image folder: the first images of a few classes."""
    for split, n in (("train", n_train), ("val", n_val)):
        for cls in classes:
            (dest / split / cls).mkdir(parents=True)
            for f in sorted((src / split / cls).iterdir())[:n]:
                shutil.copyfile(f, dest / split / cls / f.name)
    return dest


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(path: Path, side: int = 30000) -> Path:
    """A 1 kB PNG whose header claims side x side RGB pixels (2.7 GB decoded)."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr)
                     + png_chunk(b"IDAT", zlib.compress(bytes(1000))) + png_chunk(b"IEND", b""))
    return path


def jpeg_bomb(src: Path, path: Path, side: int = 65000) -> Path:
    """A real small JPEG whose SOF0 header is patched to claim side x side pixels."""
    data = bytearray(src.read_bytes())
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", side, side)
    path.write_bytes(bytes(data))
    return path


def bench_record(accs, seconds) -> dict:
    return {"recipe": "fashion-mnist", "environment": {"device_name": "cpu"},
            "runs": [{"seed": i, "test_acc": a, "test_acc_no_tta": a, "times": {"train+eval": t}}
                     for i, (a, t) in enumerate(zip(accs, seconds))]}


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, cifar_small) -> Path:
    """A finished run (config.toml, metrics.jsonl, checkpoint.pt after step 1 of 2, model.pt,
    summary.json) of the shrunk cifar10-94 on 1,024 real CIFAR-10 images. Tests copy it."""
    out = tmp_path_factory.mktemp("trained") / "run"
    speedrun("train", *small_args(cifar_small), "--set", "checkpoint.every_steps=1", "--out", out)
    return out


def killed_run(trained_run: Path, dest: Path) -> Path:
    """The state a run killed after its checkpoint (step 1), before the end of its epoch,
    leaves: config.toml and checkpoint.pt."""
    shutil.copytree(trained_run, dest)
    for name in ("summary.json", "model.pt", "metrics.jsonl"):
        (dest / name).unlink()
    return dest


# ------------------------------------------------------------------------------------------
# An unexpected exception: one line and the path of the saved traceback
# ------------------------------------------------------------------------------------------

def test_an_unexpected_exception_prints_one_line_and_saves_the_traceback(tmp_path):
    crashes = tmp_path / "crashes"
    code = ("import sys; from speedrun import cli; cli.dispatch = lambda args: 1/0; "
            "sys.exit(cli.main(['recipes']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPEEDRUN_CRASH_DIR": str(crashes)})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "speedrun: internal error: ZeroDivisionError: division by zero"
    saved = list(crashes.iterdir())
    assert len(saved) == 1 and str(saved[0]) in proc.stderr
    text = saved[0].read_text()
    assert "Traceback (most recent call last)" in text and "ZeroDivisionError: division by zero" in text
    assert "in main" in text and "in <lambda>" in text          # where it was raised, frame by frame


# ------------------------------------------------------------------------------------------
# Output paths: checked before any work, refused with exit 2, nothing written
# ------------------------------------------------------------------------------------------

def test_output_paths_are_checked_before_any_work(tmp_path, tmpfs, cli, trained_run, cifar_small, jpeg32,
                                                  data_dir):
    blocker = tmp_path / "blocker"                  # a user's file where an output would go
    blocker.write_text("the user's notes\n")
    ro, full = tmpfs("ro"), tmpfs("full")
    for disk in (ro, full):
        shutil.copytree(trained_run, disk / "run")  # for `report`, which writes into the run
    blocked_run = shutil.copytree(trained_run, tmp_path / "blocked-run")
    (blocked_run / "report_files").write_text("the user's file, where the report's images go\n")
    fill(full)
    read_only(ro)
    images = small_folder(jpeg32, tmp_path / "images", n_train=4, n_val=2)
    bench_a = write_json(tmp_path / "a" / "bench.json", bench_record([0.9, 0.91], [10.0, 11.0]))
    bench_b = write_json(tmp_path / "b" / "bench.json", bench_record([0.9, 0.92], [8.0, 9.0]))
    before = snapshot(tmp_path)

    # through the real command: a run folder on a read-only disk
    proc = speedrun("train", *small_args(cifar_small), "--out", ro / "new-run", check=False)
    check_refused(proc, 2, f"--out {ro / 'new-run'}", "read-only")

    folder_outputs = {
        "train": lambda out: ["train", *small_args(cifar_small), "--out", out],
        "bench": lambda out: ["bench", *small_args(cifar_small), "--runs", 2, "--out", out],
        "data export": lambda out: ["data", "export", "cifar10", "--data-dir", data_dir, "--limit", 1, "--out", out],
    }
    file_outputs = {
        "data prepare": ("--out", ".npz", lambda out: ["data", "prepare", images, "--size", 32, "--out", out]),
        "compare": ("--json", ".json", lambda out: ["compare", bench_a, bench_b, "--json", out]),
    }
    cases = []
    for name, args in folder_outputs.items():
        cases += [(name, args(blocker), "--out", blocker, "a file is in the way|exists and is not an empty folder"),
                  (name, args(ro / "x"), "--out", ro / "x", "read-only"),
                  (name, args(full / "x"), "--out", full / "x", "free"),
                  (name, args(blocker / "x" / "y"), "--out", blocker / "x" / "y", "is a file")]
    for name, (option, ext, args) in file_outputs.items():
        cases += [(name, args(blocker), option, blocker, "already exists"),
                  (name, args(ro / f"x{ext}"), option, ro / f"x{ext}", "read-only"),
                  (name, args(full / f"x{ext}"), option, full / f"x{ext}", "free"),
                  (name, args(blocker / "x" / f"y{ext}"), option, blocker / "x" / f"y{ext}", "is a file")]
    for name, args, option, path, why in cases:
        err = check_refused(cli(*args), 2)
        assert re.search(re.escape(f"{option} {path}") + "[: ]", err), (name, err)   # the path as given
        assert re.search(why, err), (name, err)
    # report writes into the folder it reports on
    check_refused(cli("report", blocked_run), 2, blocked_run / "report_files", "a file is in the way")
    check_refused(cli("report", ro / "run"), 2, ro / "run", "read-only")
    check_refused(cli("report", full / "run"), 2, full / "run", "free")
    check_refused(cli("report", blocker / "run"), 1, blocker / "run", "not a folder")
    assert_unchanged(tmp_path, before)


def test_a_full_disk_is_refused_before_work_and_named_when_a_write_fails(tmp_path, tmpfs, cifar_small):
    full = tmpfs("full")
    fill(full)
    before = snapshot(tmp_path)
    proc = speedrun("train", *small_args(cifar_small), "--out", full / "run", check=False)
    check_refused(proc, 2, f"--out {full / 'run'}", "KiB free")
    assert "steps in" not in proc.stdout + proc.stderr      # refused before training began
    assert_unchanged(tmp_path, before)

    # mid-write: torch.save's own failure is a cryptic RuntimeError ...
    nearly = tmpfs("nearly", "4m")
    fill(nearly, leave=256 * 1024)
    weights = {"w": torch.zeros(1 << 20)}          # 4 MiB
    with pytest.raises(RuntimeError, match="unexpected pos|failed writing"):
        torch.save(weights, nearly / "raw.pt")
    (nearly / "raw.pt").unlink()
    # ... which the atomic writer turns into one naming the file, leaving no temporary file
    with pytest.raises(RunFolderError, match="disk is full") as err:
        atomic_torch_save(nearly / "model.pt", weights)
    assert str(nearly / "model.pt") in str(err.value)
    assert sorted(p.name for p in nearly.iterdir()) == ["filler"]


def test_a_run_folder_on_a_full_disk_is_refused_in_one_line_and_the_disk_left_as_it_was(tmpfs, fashion_small):
    full = tmpfs("full", "1m")
    (full / "existing").mkdir()                     # the user's empty folder, made before the disk filled
    fill_up(full)                                   # (folders and empty files can still be made on it)
    before = snapshot(full)
    for out in (full / "run", full / "existing", full / "existing" / "a" / "b"):
        proc = speedrun("train", *tiny_fashion(fashion_small), "--out", out, check=False)
        check_refused(proc, 2, f"--out {out}", "the disk is full")
        assert_unchanged(full, before)              # no lock file, no folder, no temporary file


def test_a_run_folder_on_a_read_only_disk_is_refused_in_one_line_and_the_disk_left_as_it_was(tmpfs,
                                                                                              fashion_small):
    ro = tmpfs("ro", "1m")
    (ro / "existing").mkdir()
    (ro / "killed").mkdir()                         # a run's folder whose run was killed, its lock file left
    (ro / "killed" / ".speedrun.lock").write_text("4194304\n")
    read_only(ro)
    before = snapshot(ro)
    for out in (ro / "run", ro / "existing", ro / "existing" / "a" / "b", ro / "killed"):
        proc = speedrun("train", *tiny_fashion(fashion_small), "--out", out, check=False)
        check_refused(proc, 2, f"--out {out}", "the file system is read-only")
    assert_unchanged(ro, before)


def test_a_full_cache_disk_never_ends_a_run_in_a_traceback_and_is_left_as_it_was(tmp_path, tmpfs, fashion_small,
                                                                                  monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)      # (compiled code goes to $SPEEDRUN_CACHE)
    cache = tmpfs("cache", "1m")
    fill_up(cache)
    before = snapshot(cache)
    env = {"SPEEDRUN_CACHE": str(cache / "speedrun")}
    # the FLOP counts kept for the next run are optional: the run finishes, and says they were not kept
    proc = speedrun("train", *tiny_fashion(fashion_small), "--out", tmp_path / "run", env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and not ERROR_LINE.search(proc.stderr), proc.stderr
    assert proc.stderr.count("speedrun: note: FLOP counts are not kept") == 1, proc.stderr
    assert f"{cache / 'speedrun' / 'counts.json'} for the next run: the disk is full" in proc.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
    assert_unchanged(cache, before)
    # the decoded images a run trains from and the code it compiles must be written: refused before any work
    images = tmp_path / "images"                    # (refused before decoding: any few images do)
    for i, (split, cls) in enumerate([(s, c) for s in ("train", "val") for c in ("cat", "dog")] * 4):
        (images / split / cls).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((32, 32, 3), 8 * i, np.uint8)).save(images / split / cls / f"{i}.png")
    cases = {"decoded-image cache": [*small_args(images, "folder", batch=8), "--set", "data.cache=on"],
             "compile cache": [*tiny_fashion(fashion_small), "--set", "runtime.compile=on"]}
    for what, args in cases.items():
        out = tmp_path / what.replace(" ", "-")
        proc = speedrun("train", *args, "--out", out, env=env, check=False)
        check_refused(proc, 2, f"the {what} {cache / 'speedrun'}", "0 bytes free", "$SPEEDRUN_CACHE")
        assert not out.exists()
        assert_unchanged(cache, before)


def test_a_write_that_fails_for_want_of_space_removes_the_folders_it_made(tmpfs):
    full = tmpfs("full", "1m")
    fill_up(full)
    before = snapshot(full)
    with pytest.raises(RunFolderError, match="the disk is full") as err:
        atomic_write_json(full / "a" / "b" / "record.json", {"x": 1})
    assert str(full / "a" / "b" / "record.json") in str(err.value)
    assert_unchanged(full, before)
    # out of inodes after the first two of three folders: those two are removed again
    few = tmpfs("few", "1m")
    subprocess.run(["mount", "-o", "remount,nr_inodes=3", str(few)], check=True)
    with pytest.raises(RunFolderError, match="the disk is full") as err:
        make_folder(few / "a" / "b" / "c")
    assert str(few / "a" / "b" / "c") in str(err.value)
    assert list(few.iterdir()) == []


# ------------------------------------------------------------------------------------------
# Records, checkpoints and files that are not what speedrun wrote
# ------------------------------------------------------------------------------------------

def test_structurally_wrong_records_and_checkpoints_are_named(tmp_path, cli, trained_run):
    good = write_json(tmp_path / "good" / "bench.json", bench_record([0.9, 0.91], [10.0, 11.0]))
    wrong_entry = bench_record([0.9, 0.91], [10.0, 11.0])
    wrong_entry["runs"][1]["test_acc"] = "high"
    wrong_entry = write_json(tmp_path / "wrong-entry" / "bench.json", wrong_entry)
    a_list = write_json(tmp_path / "a-list" / "bench.json", [1, 2, 3])
    runs_dict = write_json(tmp_path / "runs-dict" / "bench.json", {**bench_record([0.9], [1.0]), "runs": {"a": 1}})
    no_summary = write_json(tmp_path / "no-summary" / "bench.json", bench_record([0.9, 0.91], [10.0, 11.0]))

    report_summary = shutil.copytree(trained_run, tmp_path / "report-summary")
    write_json(report_summary / "summary.json", {"recipe": "cifar10-94"})      # keys missing
    report_list = shutil.copytree(trained_run, tmp_path / "report-list")
    write_json(report_list / "summary.json", ["not", "a", "summary"])

    garbage = killed_run(trained_run, tmp_path / "garbage-ckpt")
    (garbage / "checkpoint.pt").write_text('{"step": 3}\n')
    a_tensor_list = killed_run(trained_run, tmp_path / "list-ckpt")
    torch.save([torch.zeros(3)], a_tensor_list / "checkpoint.pt")
    incomplete = killed_run(trained_run, tmp_path / "incomplete-ckpt")
    torch.save({"format": CHECKPOINT_FORMAT, "step": "three"}, incomplete / "checkpoint.pt")
    old_format = killed_run(trained_run, tmp_path / "old-ckpt")       # written by an earlier speedrun
    torch.save({"format": CHECKPOINT_FORMAT - 1, "step": 3}, old_format / "checkpoint.pt")
    before = snapshot(tmp_path)

    proc = speedrun("compare", good, wrong_entry, check=False)
    check_refused(proc, 1, wrong_entry, "runs[1].test_acc")
    check_refused(cli("compare", a_list, good), 1, a_list)
    check_refused(cli("compare", good, runs_dict, "--json", tmp_path / "c.json"), 1, runs_dict, "'runs'")
    check_refused(cli("report", no_summary.parent), 1, no_summary.parent)          # no 'summary'
    check_refused(cli("report", report_summary), 1, report_summary)
    check_refused(cli("report", report_list), 1, report_list / "summary.json")
    check_refused(cli("train", "--resume", garbage), 1, garbage / "checkpoint.pt")
    check_refused(cli("train", "--resume", a_tensor_list), 1, a_tensor_list / "checkpoint.pt", "list")
    check_refused(cli("train", "--resume", incomplete), 1, incomplete / "checkpoint.pt", "step")
    check_refused(cli("train", "--resume", old_format), 1, old_format / "checkpoint.pt",
                  f"format {CHECKPOINT_FORMAT - 1}", "start again")
    assert_unchanged(tmp_path, before)


def test_files_that_are_not_utf8_are_named(tmp_path, cli, trained_run, cifar_small):
    recipe = tmp_path / "latin1.toml"
    text = shipped_recipes()["cifar10-94"].read_text().replace('description = "', 'description = "caf\xe9 ', 1)
    recipe.write_bytes(text.encode("latin-1"))
    assert b"caf\xe9" in recipe.read_bytes()
    bench = tmp_path / "bench" / "bench.json"
    bench.parent.mkdir()
    bench.write_bytes(b'{"recipe": "caf\xe9", "runs": []}')
    report = shutil.copytree(trained_run, tmp_path / "report")
    (report / "summary.json").write_bytes(b'{"recipe": "caf\xe9"}')
    resume = killed_run(trained_run, tmp_path / "resume")
    (resume / "config.toml").write_bytes((resume / "config.toml").read_bytes().replace(b'"', b'"\xff', 1))
    good = write_json(tmp_path / "good" / "bench.json", bench_record([0.9, 0.91], [10.0, 11.0]))
    before = snapshot(tmp_path)

    proc = speedrun("train", recipe, "--set", "data.dataset=npz", "--data-dir", cifar_small, "--out",
                    tmp_path / "run", check=False)
    check_refused(proc, 2, recipe, "UTF-8")
    check_refused(cli("compare", bench, good), 1, bench, "UTF-8")
    check_refused(cli("report", report), 1, report / "summary.json", "UTF-8")
    check_refused(cli("train", "--resume", resume), 2, resume / "config.toml", "UTF-8")
    assert_unchanged(tmp_path, before)


# ------------------------------------------------------------------------------------------
# Images: decompression bombs, 16-bit and float pixels, too few or empty classes
# ------------------------------------------------------------------------------------------

def test_a_decompression_bomb_in_val_stops_the_run_naming_it_and_keeps_the_weights(tmp_path, jpeg32):
    images = small_folder(jpeg32, tmp_path / "images")
    bomb = png_bomb(images / "val" / "dog" / "huge.png")
    before = snapshot(images)
    out = tmp_path / "run"
    proc = speedrun("train", *small_args(images, "folder", batch=32), "--set", "train.epochs=1", "--out", out,
                    check=False)
    # the whole epoch was trained (steps 1 and 2) before the final evaluation met the bomb
    check_refused(proc, 1, bomb, "decompression bomb", "after step 2", out / "last_good.pt")
    assert "2 steps in 1 epoch, batch 32" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.toml", "last_good.pt"]
    state = torch.load(out / "last_good.pt", weights_only=True)     # the trained weights, kept
    assert state and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert_unchanged(images, before)


def test_decompression_bombs_are_refused_naming_the_file_or_skipped_when_asked(tmp_path, cli, jpeg32):
    images = small_folder(jpeg32, tmp_path / "images", n_train=8, n_val=2)
    jpeg = jpeg_bomb(next((images / "train" / "cat").iterdir()), images / "train" / "cat" / "huge.jpg")
    before = snapshot(tmp_path)
    err = check_refused(cli("data", "prepare", images, "--size", 32, "--out", tmp_path / "x.npz", "--workers", 1),
                        1, jpeg, "decompression bomb")
    assert "65000x65000" in err
    assert_unchanged(tmp_path, before)

    # skipped and counted with data.skip_corrupt, in train/ and val/ alike
    skip = small_folder(jpeg32, tmp_path / "skip")
    png_bomb(skip / "train" / "cat" / "huge.png")
    png_bomb(skip / "val" / "cat" / "huge.png")
    rc, err = cli("train", *small_args(skip, "folder", batch=32), "--set", "data.skip_corrupt=true",
                  "--out", tmp_path / "run")
    assert rc == 0, err
    assert 1 <= json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_images"] <= 2


def test_skipped_images_are_named_at_the_end_and_in_the_summary(tmp_path, jpeg32):
    """With data.skip_corrupt each skipped image is counted once however often it was met, and
    named with why: in one line at the end of the run and in summary.json; `data prepare
    --skip-corrupt` names them too."""
    images = small_folder(jpeg32, tmp_path / "images")
    bomb = png_bomb(images / "val" / "cat" / "huge.png")
    broken = images / "train" / "dog" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8\xff not a JPEG after all")
    out = tmp_path / "run"
    proc = speedrun("train", *small_args(images, "folder", batch=32), "--set", "train.epochs=1",
                    "--set", "data.skip_corrupt=true", "--out", out)
    summary = json.loads((out / "summary.json").read_text())
    named = {e["path"]: e["reason"] for e in summary["skipped_files"]}
    assert summary["skipped_images"] == 2 and set(named) == {str(bomb), str(broken)}
    assert summary["skipped_files_not_listed"] == 0
    assert "pixels, over the limit of 89,478,485 (a decompression bomb" in named[str(bomb)]
    assert named[str(broken)].startswith("cannot decode this image")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("speedrun: skipped ")]
    assert len(lines) == 1 and lines[0].startswith("speedrun: skipped 2 unreadable images (data.skip_corrupt): ")
    assert str(bomb) in lines[0] and str(broken) in lines[0] and f"all are listed in {out / 'summary.json'}" in lines[0]

    proc = speedrun("data", "prepare", images, "--size", 32, "--out", tmp_path / "x.npz", "--workers", 1,
                    "--skip-corrupt")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("speedrun: skipped ")]
    assert len(lines) == 1 and "skipped 2 unreadable images" in lines[0]
    assert str(bomb) in lines[0] and str(broken) in lines[0]


def test_many_skipped_images_are_listed_up_to_a_cap_and_counted():
    files = {f"/data/train/cat/{i:03d}.jpg": "cannot decode this image (not a recognised image format)"
             for i in range(150)}
    record = listed(files, 150)
    assert len(record["skipped_files"]) == 100 and record["skipped_files_not_listed"] == 50
    assert record["skipped_files"][0] == {"path": "/data/train/cat/000.jpg",
                                          "reason": "cannot decode this image (not a recognised image format)"}
    line = skipped_line({e["path"]: e["reason"] for e in record["skipped_files"]}, 150, "run/summary.json")
    assert line.count("/data/train/cat/") == 5 and "; and 145 more; 100 are listed by name in run/summary.json" in line
    assert skipped_line({"a.png": "why"}, 1, "s.json") == \
        "skipped 1 unreadable image (data.skip_corrupt): a.png (why); all are listed in s.json"


def write_png16(path: Path, values: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(values.astype(np.uint16)).save(path)


def test_16_bit_images_are_scaled_and_float_images_refused(tmp_path, cli):
    rng = np.random.default_rng(0)
    images, expected = tmp_path / "images16", {}
    for split, n in (("train", 2), ("val", 1)):
        for cls in ("dark", "light"):
            for k in range(n):
                values = rng.integers(0, 65536, size=(32, 32))
                write_png16(images / split / cls / f"{k}.png", values)
                expected.setdefault(split, []).append(values / 257)   # sorted by class, then file
    with Image.open(images / "train" / "dark" / "0.png") as im:
        assert im.mode.startswith("I")                            # really 16-bit on disk
    out = tmp_path / "x16.npz"
    proc = speedrun("data", "prepare", images, "--size", 32, "--out", out, "--workers", 1, check=False)
    assert proc.returncode == 0, proc.stderr
    with np.load(out) as npz:
        for split, key in (("train", "x_train"), ("val", "x_test")):
            got = npz[key].astype(np.float64)
            assert got.shape == (len(expected[split]), 1, 32, 32)
            assert np.abs(got[:, 0] - np.stack(expected[split])).max() <= 0.5 + 1e-9   # scaled, not clipped
        assert npz["x_train"].max() >= 250 and len(np.unique(npz["x_train"])) > 200

    floats = tmp_path / "floats"
    shutil.copytree(images, floats)
    tiff = floats / "train" / "light" / "depth.tif"
    Image.fromarray(rng.random((32, 32), dtype=np.float32)).save(tiff)
    with Image.open(tiff) as im:
        assert im.mode == "F"
    before = snapshot(tmp_path)
    check_refused(cli("data", "prepare", floats, "--size", 32, "--out", tmp_path / "f.npz", "--workers", 1),
                  1, tiff, "floating-point")
    assert_unchanged(tmp_path, before)


def test_folders_with_one_class_or_an_empty_class_are_refused(tmp_path, cli, jpeg32):
    one = small_folder(jpeg32, tmp_path / "one", classes=("cat",))
    empty = small_folder(jpeg32, tmp_path / "empty", n_train=4, n_val=2)
    (empty / "train" / "horse").mkdir()
    (empty / "train" / "horse" / "README.txt").write_text("images to come\n")
    before = snapshot(tmp_path)
    proc = speedrun("train", *small_args(one, "folder", batch=16), "--out", tmp_path / "run", check=False)
    check_refused(proc, 1, one / "train", "only one class folder ('cat')")
    check_refused(cli("data", "prepare", one, "--size", 32, "--out", tmp_path / "one.npz"), 1, one / "train", "'cat'")
    check_refused(cli("data", "prepare", empty, "--size", 32, "--out", tmp_path / "e.npz"), 1, empty / "train",
                  "'horse'", "hold no images")
    check_refused(cli("train", *small_args(empty, "folder", batch=4), "--out", tmp_path / "run"), 1,
                  empty / "train", "'horse'")
    assert_unchanged(tmp_path, before)


# ------------------------------------------------------------------------------------------
# .npz arrays: empty, and labels that are not class numbers
# ------------------------------------------------------------------------------------------

def test_an_empty_npz_is_named(tmp_path, cli, cifar_small):
    with np.load(cifar_small) as src:
        x_test, y_test = src["x_test"], src["y_test"]
    no_images = tmp_path / "no-images.npz"
    np.savez(no_images, x_train=np.zeros((0, 3, 32, 32), np.uint8), y_train=np.zeros(0, np.int64),
             x_test=x_test, y_test=y_test)
    no_arrays = tmp_path / "no-arrays.npz"
    np.savez(no_arrays)
    zero_bytes = tmp_path / "zero-bytes.npz"
    zero_bytes.write_bytes(b"")
    before = snapshot(tmp_path)
    proc = speedrun("train", *small_args(no_images), "--out", tmp_path / "run", check=False)
    check_refused(proc, 1, no_images, "x_train holds no images")
    check_refused(cli("train", *small_args(no_arrays), "--out", tmp_path / "run"), 1, no_arrays, "missing arrays")
    check_refused(cli("train", *small_args(zero_bytes), "--out", tmp_path / "run"), 1, zero_bytes, ".npz")
    assert_unchanged(tmp_path, before)


def test_a_huge_label_is_refused_naming_it(tmp_path, cifar_small):
    with np.load(cifar_small) as src:
        arrays = {k: src[k] for k in ("x_train", "y_train", "x_test", "y_test")}   # no class names
    arrays["y_train"] = arrays["y_train"].astype(np.int64)
    arrays["y_train"][5] = 10 ** 12
    huge = tmp_path / "huge-label.npz"
    np.savez(huge, **arrays)
    before = snapshot(tmp_path)
    proc = speedrun("train", *small_args(huge), "--out", tmp_path / "run", check=False)
    check_refused(proc, 1, huge, "1,000,000,000,000")
    assert_unchanged(tmp_path, before)


# ------------------------------------------------------------------------------------------
# Distillation teachers
# ------------------------------------------------------------------------------------------

def test_every_failure_of_the_distillation_teacher_is_named(tmp_path, cli, trained_run, cifar_small, fashion_small):
    missing = tmp_path / "nowhere" / "model.pt"
    lone = tmp_path / "lone" / "model.pt"                    # weights without their run's config.toml
    lone.parent.mkdir()
    shutil.copyfile(trained_run / "model.pt", lone)
    not_weights = tmp_path / "not-weights"
    not_weights.mkdir()
    shutil.copyfile(trained_run / "config.toml", not_weights / "config.toml")
    (not_weights / "model.pt").write_text("these are notes, not weights\n")
    with np.load(cifar_small) as src:                        # five classes of CIFAR-10 images
        five = tmp_path / "five.npz"
        np.savez(five, x_train=src["x_train"], y_train=src["y_train"] % 5, x_test=src["x_test"],
                 y_test=src["y_test"] % 5, classes=src["classes"][:5])
    teacher = trained_run / "model.pt"                       # 10 classes of 3-channel images
    before = snapshot(tmp_path)
    teach = lambda path: ["--set", f"distill.teacher={path}", "--out", tmp_path / "run"]

    proc = speedrun("train", *small_args(fashion_small), *teach(teacher), check=False)
    check_refused(proc, 1, f"distill.teacher={teacher}", "3-channel", "1-channel")
    check_refused(cli("train", *small_args(cifar_small), *teach(missing)), 1, f"distill.teacher={missing}",
                  "no such file")
    check_refused(cli("train", *small_args(cifar_small), *teach(lone)), 1, f"distill.teacher={lone}", "config.toml")
    check_refused(cli("train", *small_args(cifar_small), *teach(not_weights / "model.pt")), 1,
                  f"distill.teacher={not_weights / 'model.pt'}", "cannot read the weights")
    check_refused(cli("train", *small_args(five), *teach(teacher)), 1, f"distill.teacher={teacher}",
                  "10 classes", "5 classes")
    assert_unchanged(tmp_path, before)


# ------------------------------------------------------------------------------------------
# Options: refused by the parser with the option named
# ------------------------------------------------------------------------------------------

def test_run_counts_and_epoch_grids_that_are_not_numbers_are_refused(tmp_path, cli, cifar_small):
    before = snapshot(tmp_path)
    proc = speedrun("bench", *small_args(cifar_small), "--runs", 0, check=False)
    check_refused(proc, 2, "argument --runs", "0")
    check_refused(cli("bench", *small_args(cifar_small), "--runs", -1), 2, "argument --runs", "-1")
    check_refused(cli("ablate", *small_args(cifar_small), "--runs", 1, "--epochs-grid", "abc"), 2,
                  "argument --epochs-grid", "'abc'")
    check_refused(cli("ablate", *small_args(cifar_small), "--runs", 1, "--epochs-grid", "0.5,1.5"), 2,
                  "argument --epochs-grid", "1.5")
    assert_unchanged(tmp_path, before)


def test_values_once_silently_accepted_are_refused(tmp_path, cli, data_dir):
    a = write_json(tmp_path / "a" / "bench.json", bench_record([0.9, 0.91], [10.0, 11.0]))
    b = write_json(tmp_path / "b" / "bench.json", bench_record([0.9, 0.92], [8.0, 9.0]))
    before = snapshot(tmp_path)
    proc = speedrun("compare", a, b, "--alpha", -3, check=False)
    check_refused(proc, 2, "argument --alpha", "-3")
    assert "verdict" not in proc.stdout.lower() and "faster" not in proc.stdout
    check_refused(cli("compare", a, b, "--alpha", 1.5), 2, "argument --alpha")
    export = ["data", "export", "cifar10", "--data-dir", data_dir, "--out", tmp_path / "x"]
    check_refused(cli(*export, "--limit", 0), 2, "argument --limit", "0")
    check_refused(cli(*export, "--limit", -5), 2, "argument --limit", "-5")
    check_refused(cli(*export, "--format", "jpeg", "--quality", 1000), 2, "argument --quality", "1000")
    assert_unchanged(tmp_path, before)


def test_a_bad_value_is_blamed_on_the_set_that_gave_it_and_one_from_the_file_on_the_file(tmp_path, cli):
    shipped = shipped_recipes()["fashion-mnist"]
    text = shipped.read_text()
    assert '[data]\ndataset = "fashion-mnist"\n' in text
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    too_large, without_stop = recipes / "too-large.toml", recipes / "without-stop.toml"
    too_large.write_text(text.replace("[data]\n", "[data]\nholdout = 2\n", 1))
    without_stop.write_text(text.replace("[data]\n", "[data]\nholdout = 0.2\n", 1))
    out = ["--out", tmp_path / "run"]
    before = snapshot(tmp_path)
    range_error = "bad recipe value for 'data.holdout' (got 2): Input should be less than or equal to 0.5"
    cross_error = "data.holdout = 0.2 does nothing with train.stop_at_target = False"
    # a value out of range, and one a check across sections refuses, each given by a --set
    err = check_refused(cli("train", "fashion-mnist", "--set", "optim.lr=1", "--set", "data.holdout=2", *out), 2,
                        f"speedrun: error: --set data.holdout=2: {range_error}")
    assert str(shipped) not in err and "optim.lr" not in err
    err = check_refused(cli("train", "fashion-mnist", "--set", "data.holdout=0.2", *out), 2,
                        f"speedrun: error: --set data.holdout=0.2: {cross_error}")
    assert str(shipped) not in err
    # a --set a later one replaced gave nothing
    err = check_refused(cli("train", "fashion-mnist", "--set", "data.holdout=0.1", "--set", "train.stop_at_target=true",
                            "--set", "data.holdout=0.7", *out), 2, "speedrun: error: --set data.holdout=0.7: bad recipe "
                        "value for 'data.holdout' (got 0.7)")
    assert "data.holdout=0.1" not in err and "stop_at_target" not in err
    # the same values from a recipe file are the file's, whatever else is set
    err = check_refused(cli("train", too_large, "--set", "optim.lr=1", *out), 2, f"speedrun: error: {too_large}: "
                        f"{range_error}")
    assert "--set" not in err
    check_refused(cli("train", without_stop, "--set", "optim.lr=1", *out), 2,
                  f"speedrun: error: {without_stop}: {cross_error}")
    # ... and each error names where its own value came from
    check_refused(cli("train", too_large, "--set", "optim.lr=-1", *out), 2, f"speedrun: error: {too_large}: "
                  f"{range_error}; --set optim.lr=-1: bad recipe value for 'optim.lr' (got -1)")
    assert_unchanged(tmp_path, before)


def test_a_kernel_search_on_a_cpu_is_refused_at_start_saying_what_to_set(tmp_path, cli, cifar_small):
    """runtime.compile_mode=max-autotune would crash inductor's CPU matrix-multiply template
    after minutes of compiling: refused before the data is read or a run folder made."""
    before = snapshot(tmp_path)
    check_refused(cli("train", *small_args(cifar_small), "--device", "cpu", "--out", tmp_path / "runs",
                      "--set", "runtime.compile=on", "--set", "runtime.compile_mode=max-autotune"),
                  2, "runtime.compile_mode='max-autotune'", "runtime.compile_mode=default")
    assert_unchanged(tmp_path, before)


@pytest.mark.parametrize("sets, culprits", [
    (["optim.layer_decay=0"], ["optim.layer_decay", "greater than 0"]),
    (["optim.layer_decay=1.5"], ["optim.layer_decay", "less than or equal to 1"]),
    (["optim.betas=[0.8, 0.99]"], ["optim.betas = [0.8, 0.99] does nothing with optim.name = 'sgd'", "lamb and adamw"]),
    (["optim.eps=1e-7"], ["optim.eps = 1e-07 does nothing with optim.name = 'sgd'"]),
    (["optim.name=adamw", "optim.lr=1e-3", "optim.trust_coefficient=0.01"],
     ["optim.trust_coefficient = 0.01 does nothing with optim.name = 'adamw'", "only lars"]),
    (["optim.name=adamw", "optim.lr=1e-3", "optim.adapt_bias_norm=true"], ["optim.adapt_bias_norm"]),
    (["optim.name=adamw", "optim.lr=1e-3", "optim.betas=[0.9, 1.0]"], ["optim.betas", "below 1"]),
    (["optim.layer_decay=0.75", "finetune.lr_first=0.1"], ["optim.layer_decay = 0.75", "finetune.lr_first = 0.1"]),
], ids=["layer-decay-0", "layer-decay-1.5", "betas-on-sgd", "eps-on-sgd", "trust-on-adamw", "adapt-on-adamw",
        "beta-of-1", "layer-decay-and-lr-first"])
def test_optimizer_fields_that_are_out_of_range_or_do_nothing_are_refused(tmp_path, cli, cifar_small, sets, culprits):
    """optim.layer_decay outside (0, 1], an optimizer's own fields given to another, and the two
    spellings of per-block LRs at once: one line naming the fields, nothing written."""
    before = snapshot(tmp_path)
    check_refused(cli("train", *small_args(cifar_small), "--out", tmp_path / "run",
                      *sum((["--set", s] for s in sets), [])), 2, *culprits)
    assert_unchanged(tmp_path, before)


def test_a_recipe_name_cannot_place_the_run_outside_runs(tmp_path, cli, cifar_small):
    text = shipped_recipes()["cifar10-94"].read_text()
    assert text.startswith('name = "cifar10-94"\n')
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    up = recipes / "up.toml"
    up.write_text(text.replace('name = "cifar10-94"', 'name = "../../escaped"', 1))
    absolute = recipes / "absolute.toml"
    absolute.write_text(text.replace('name = "cifar10-94"', f'name = "{tmp_path / "outside" / "run"}"', 1))
    before = snapshot(tmp_path)
    args = small_args(cifar_small)[1:]                   # the recipe options, without the name
    proc = speedrun("train", up, *args, check=False)
    check_refused(proc, 2, up, "'name'", "../../escaped")
    check_refused(cli("train", absolute, *args), 2, absolute, "'name'")
    check_refused(cli("bench", absolute, *args, "--runs", 1), 2, absolute, "'name'")
    assert_unchanged(tmp_path, before)
    assert not (tmp_path.parent / "escaped").exists() and not list(tmp_path.parent.glob("escaped-*"))


# ------------------------------------------------------------------------------------------
# Nothing the user wrote is deleted or overwritten
# ------------------------------------------------------------------------------------------

def test_the_users_folder_beside_the_official_archive_is_kept(tmp_path, data_dir, cifar_archive):
    shared = data_dir                                       # the real, official CIFAR-10 files
    root = tmp_path / "data"
    (root / "cifar-10-batches-py").mkdir(parents=True)
    notes = root / "cifar-10-batches-py" / "my-notes.txt"
    notes.write_text("my own notes on CIFAR-10, kept in the folder of its name\n")
    archive = root / "cifar-10-python.tar.gz"
    shutil.copyfile(cifar_archive, archive)                 # (the real files, packed once per session)
    archive_digest = hashlib.sha256(archive.read_bytes()).hexdigest()

    out = tmp_path / "export"
    proc = speedrun("data", "export", "cifar10", "--data-dir", root, "--limit", 1, "--out", out, check=False)
    assert proc.returncode == 0, proc.stderr
    assert notes.read_text() == "my own notes on CIFAR-10, kept in the folder of its name\n"
    for f in sorted((shared / "cifar-10-batches-py").iterdir()):     # moved in beside it, complete
        assert (root / "cifar-10-batches-py" / f.name).read_bytes() == f.read_bytes(), f.name
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == archive_digest
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-batches-py", "cifar-10-python.tar.gz"]
    assert len(list(out.rglob("*.png"))) == 2


def test_a_refused_resume_changes_nothing_and_the_plain_resume_still_works(tmp_path, trained_run):
    run = killed_run(trained_run, tmp_path / "killed")
    before = snapshot(tmp_path)
    proc = speedrun("train", "--resume", run, "--set", "eval.tta=flip", check=False)
    assert_unchanged(tmp_path, before)                  # config.toml was rewritten here before
    check_refused(proc, 2, f"--resume {run}", "--set eval.tta=flip", "nothing was changed")

    proc = speedrun("train", "--resume", run, check=False)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 2 and summary["tta"] == "none"
    assert (run / "config.toml").read_bytes() == (trained_run / "config.toml").read_bytes()


def test_a_resume_without_its_config_and_an_unknown_recipe_are_named(tmp_path, cli, trained_run):
    run = killed_run(trained_run, tmp_path / "killed")
    (run / "config.toml").unlink()
    before = snapshot(tmp_path)
    err = check_refused(speedrun("train", "--resume", run, check=False), 2, f"--resume {run}: {run / 'config.toml'} "
                        "is missing", "cannot be resumed", "put the run's config.toml back")
    assert "no recipe named" not in err
    # two sentences, with or without a name to suggest
    check_refused(cli("train", "zzzz"), 2, "no recipe named 'zzzz' and no such file. Shipped recipes: ")
    check_refused(cli("train", "cifar10"), 2, "no recipe named 'cifar10' and no such file; did you mean "
                  "'cifar10-94'? Shipped recipes: ")
    assert_unchanged(tmp_path, before)


def test_a_missing_data_set_leaves_the_disk_as_it_was(tmp_path):
    """Neither the --data-dir folder (nor its parents) nor ~/.cache/speedrun is made by a command
    refused for want of its data, nor by the failed download before the refusal."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "SPEEDRUN_DATA": "", "SPEEDRUN_MIRROR": "http://127.0.0.1:9/"}
    before = snapshot(tmp_path)
    where = tmp_path / "x" / "y" / "z"
    check_refused(speedrun("train", "cifar10-94", "--data-dir", where, "--out", tmp_path / "run", env=env,
                           check=False), 1, "dataset 'cifar10' not found", where, "the download failed")
    check_refused(speedrun("train", "fashion-mnist", env=env, check=False), 1, "dataset 'fashion-mnist' not found",
                  home / ".cache" / "speedrun")
    check_refused(speedrun("data", "export", "cifar10", "--data-dir", where, "--out", tmp_path / "png", env=env,
                           check=False), 1, "dataset 'cifar10' not found")
    assert_unchanged(tmp_path, before)


def test_an_interrupted_run_is_not_taken_as_the_out_folder_of_a_new_run(tmp_path, cli, trained_run, cifar_small):
    run = killed_run(trained_run, tmp_path / "killed")
    before = snapshot(tmp_path)
    proc = speedrun("train", *small_args(cifar_small), "--out", run, check=False)
    check_refused(proc, 2, run, f"speedrun train --resume {run}", "checkpoint.pt")
    assert_unchanged(tmp_path, before)


# ------------------------------------------------------------------------------------------
# Bounded memory: a gzip that expands without end
# ------------------------------------------------------------------------------------------

PEAK_RSS = ("import resource, subprocess, sys; "
            "rc = subprocess.run([sys.executable, '-m', 'speedrun', *sys.argv[1:]]).returncode; "
            "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def test_a_gzip_that_expands_hugely_is_refused_with_bounded_memory(tmp_path, data_dir):
    root = tmp_path / "data"
    folder = root / "fashion-mnist"
    folder.mkdir(parents=True)
    for name in ("train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        shutil.copyfile(data_dir / "fashion-mnist" / name, folder / name)
    bomb = folder / "train-images-idx3-ubyte.gz"
    deflate = zlib.compressobj(1, zlib.DEFLATED, 31)        # a gzip stream: 1 GiB of zeros
    block = bytes(1 << 20)
    with open(bomb, "wb") as f:
        for _ in range(1024):
            f.write(deflate.compress(block))
        f.write(deflate.flush())
    with gzip.open(bomb) as g:                               # it does expand beyond the official 47 MB
        assert len(g.read(64 << 20)) == 64 << 20
    before = snapshot(tmp_path)

    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, "data", "export", "fashion-mnist", "--data-dir", str(root),
                           "--out", str(tmp_path / "export")], capture_output=True, text=True, timeout=300)
    rc, peak_kib = map(int, proc.stdout.strip().splitlines()[-1].split())
    assert peak_kib < 512 * 1024, f"peak RSS {peak_kib / 1024:.0f} MiB"     # far below the 1 GiB it expands to
    check_refused((rc, proc.stderr), 1, bomb, "47,040,016 bytes")
    assert_unchanged(tmp_path, before)


# ------------------------------------------------------------------------------------------
# Failed runs leave no run folder behind
# ------------------------------------------------------------------------------------------

def test_a_failed_run_leaves_no_run_folder(tmp_path, cli, jpeg32):
    before = snapshot(tmp_path)
    missing = tmp_path / "missing.npz"
    proc = speedrun("train", *small_args(missing), check=False)          # default folder: runs/...
    check_refused(proc, 1, missing, "no such file")
    assert not (tmp_path / "runs").exists()
    assert_unchanged(tmp_path, before)

    # a failure after the run folder was begun (config.toml written): it is removed again
    images = small_folder(jpeg32, tmp_path / "images")
    bomb = png_bomb(images / "train" / "dog" / "huge.png")
    before = snapshot(tmp_path)
    check_refused(cli("train", *small_args(images, "folder", batch=32)), 1, bomb)
    check_refused(cli("train", *small_args(images, "folder", batch=32), "--out", tmp_path / "a" / "b"), 1, bomb)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "a").exists()
    assert_unchanged(tmp_path, before)


# ------------------------------------------------------------------------------------------
# A model too large for the device: refused naming the model field, before it is allocated
# ------------------------------------------------------------------------------------------

def test_a_model_too_large_for_memory_is_refused_naming_its_fields():
    from speedrun.engine.batch_finder import BYTES_PER_PARAMETER, check_model_fits, count_parameters
    from speedrun.errors import RecipeError
    from speedrun.models import build_model
    from speedrun.recipe import load_recipe

    small = load_recipe("cifar10-94", ["model.widths=[8,16,16]"]).model
    assert count_parameters(small, 3, 10) == sum(p.numel() for p in build_model(small, 3, 10).parameters())
    gib = 1 << 30
    check_model_fits(small, gib // BYTES_PER_PARAMETER, gib, "cpu")         # exactly fits: accepted
    with pytest.raises(RecipeError) as err:
        check_model_fits(small, gib // BYTES_PER_PARAMETER + 1, gib, "cpu")
    msg = str(err.value)
    assert msg.startswith("model.widths=[8, 16, 16] makes a model of 67,108,865 parameters") and "lower model.widths" in msg
    assert "but cpu has 1.0 GiB" in msg and "batch" not in msg

    resnet = load_recipe("imagenet-resnet50", ["model.variant=a"]).model
    assert count_parameters(resnet, 3, 1000) == 25_557_032                  # torchvision's ResNet-50, without memory
    with pytest.raises(RecipeError, match=r"model.width=64 with model.depth=50 makes a model of 25,557,032 parameters"
                                          r".* but cuda:0 has 0.1 GiB; lower model.width or model.depth"):
        check_model_fits(resnet, 25_557_032, gib // 10, "cuda:0")
    huge = load_recipe("cifar10-94", ["model.widths=[100000,100000,100000]"]).model
    assert count_parameters(huge, 3, 10) > 4 * 10 ** 11                     # 7 TB were it allocated


def test_a_model_too_large_for_memory_stops_the_real_command(tmp_path, data_dir):
    before = snapshot(tmp_path)
    out = tmp_path / "run"
    proc = speedrun("train", "cifar10-94", "--set", "model.widths=[100000,100000,100000]", "--data-dir", data_dir,
                    "--out", out, check=False)
    err = check_refused(proc, 2, "model.widths=[100000, 100000, 100000]", "parameters", "lower model.widths")
    assert "batch_size" not in err
    assert not out.exists()
    assert_unchanged(tmp_path, before)
