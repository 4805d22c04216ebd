"""The small real data sets the tests train on, made from ../shared/datasets: plain functions,
so that the fixtures of conftest.py and the margin sweep (benchmarks/margins.py) build the same
files. Each is made once in a root folder, under a file lock (pytest-xdist's workers share it)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]


def shared_data() -> Path:
    """The real datasets: $SPEEDRUN_DATA (CI sets it) or ../shared/datasets beside the repo."""
    path = Path(os.environ.get("SPEEDRUN_DATA") or REPO.parent / "shared" / "datasets")
    if not (path / "cifar-10-batches-py").is_dir():
        raise RuntimeError(f"the shared datasets are not at {path}; set SPEEDRUN_DATA to the folder "
                           "holding cifar-10-batches-py/ and fashion-mnist/")
    return path


def learning_seed() -> int:
    """The seed of the tests outside the recipe matrix that assert a run learned in bf16: 0, or
    $SPEEDRUN_TEST_SEED where benchmarks/margins.py --tests runs them under other seeds."""
    return int(os.environ.get("SPEEDRUN_TEST_SEED", "0"))


def build_once(root: Path, name: str, build) -> Path:
    """``root/name``, made by ``build(path)`` by whichever worker gets there first."""
    path = root / name
    with FileLock(str(root / f".{name}.lock")):
        if not path.exists():
            tmp = root / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            os.replace(tmp, path)
    return path


def speedrun(*args, env=None, check=True) -> subprocess.CompletedProcess:
    """``python -m speedrun ARGS`` in a real process: forked from an interpreter that has imported
    torch where nothing read at those imports differs, else a fresh one (tests/forked.py)."""
    import forked
    proc = forked.run([str(a) for a in args], {**os.environ, **(env or {})}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"speedrun {args} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def subset_npz(ds, path: Path, n_train: int, n_test: int) -> None:
    """The first images of a built-in set as an .npz dataset (with its class names)."""
    np.savez(path, x_train=ds.train_x[:n_train].numpy(), y_train=ds.train_y[:n_train].numpy(),
             x_test=ds.test_x[:n_test].numpy(), y_test=ds.test_y[:n_test].numpy(), classes=np.array(ds.classes))


IMAGENETTE_CLASSES = ("n01440764", "n02102040", "n02979186", "n03000684", "n03028079", "n03394916", "n03417042",
                      "n03425413", "n03445777", "n03888257")


def cifar_small(root: Path, data_dir: Path, dataset=None) -> Path:
    """CIFAR-10's first 1,024 training and 256 test images (``dataset``: CIFAR-10 already loaded)."""
    def build(tmp):
        from speedrun.data import load_dataset
        tmp.mkdir()
        subset_npz(dataset or load_dataset("cifar10", data_dir, fetch=False), tmp / "cifar.npz", 1024, 256)
    return build_once(root, "cifar-small", build) / "cifar.npz"


def fashion_small(root: Path, data_dir: Path, dataset=None) -> Path:
    """Fashion-MNIST's first 1,024 training and 256 test images."""
    def build(tmp):
        from speedrun.data import load_dataset
        tmp.mkdir()
        subset_npz(dataset or load_dataset("fashion-mnist", data_dir, fetch=False), tmp / "fashion.npz", 1024, 256)
    return build_once(root, "fashion-small", build) / "fashion.npz"


def fashion_later(root: Path, data_dir: Path, dataset=None) -> Path:
    """Fashion-MNIST's training images 1,024 to 2,047 and test images 256 to 511: none of
    fashion_small's (weights trained on that set are fine-tuned on this one)."""
    def build(tmp):
        from speedrun.data import load_dataset
        ds = dataset or load_dataset("fashion-mnist", data_dir, fetch=False)
        tmp.mkdir()
        np.savez(tmp / "fashion-later.npz", x_train=ds.train_x[1024:2048].numpy(), y_train=ds.train_y[1024:2048].numpy(),
                 x_test=ds.test_x[256:512].numpy(), y_test=ds.test_y[256:512].numpy(), classes=np.array(ds.classes))
    return build_once(root, "fashion-later", build) / "fashion-later.npz"


def jpeg32(root: Path, data_dir: Path) -> Path:
    """CIFAR-10 as JPEG files at 32 px in the ImageNet layout: 512 train, 512 val images."""
    return build_once(root, "jpeg32", lambda tmp: speedrun("data", "export", "cifar10", "--format", "jpeg",
                                                           "--out", tmp, "--data-dir", data_dir, "--limit", 512))


def fashion_jpeg(root: Path, data_dir: Path) -> Path:
    """Fashion-MNIST as JPEG files (28 px, grey) in the ImageNet layout: 512 train, 512 val images."""
    return build_once(root, "fashion_jpeg", lambda tmp: speedrun("data", "export", "fashion-mnist", "--format", "jpeg",
                                                                 "--out", tmp, "--data-dir", data_dir, "--limit", 512))


def tiny64(root: Path, data_dir: Path) -> Path:
    """CIFAR-10 upscaled to 64 px in Tiny-ImageNet's layout (val/images + val_annotations.txt):
    256 train, 256 val images."""
    return build_once(root, "tiny64", lambda tmp: speedrun(
        "data", "export", "cifar10", "--format", "jpeg", "--out", tmp, "--data-dir", data_dir, "--limit", 256,
        "--size", 64, "--layout", "tiny-imagenet"))


def imagenet224(root: Path, data_dir: Path) -> Path:
    """CIFAR-10 upscaled to 224 px photos in the ImageNet layout: the first 256 train and 512 val
    images. The runs on it train little (a few dozen steps at 32 px), so the larger test split
    holds their accuracy's bar (chance + 3 standard errors) at 14.0% rather than 15.6%."""
    def build(tmp):
        speedrun("data", "export", "cifar10", "--format", "jpeg", "--out", tmp, "--data-dir", data_dir,
                 "--limit", 512, "--size", 224)
        for photo in (tmp / "train").glob("*/*.jpg"):       # named by their index in CIFAR-10's train set
            if int(photo.stem) >= 256:
                photo.unlink()
    return build_once(root, "imagenet224", build)


def imagenette_tiny(root: Path, data_dir: Path) -> Path:
    """The 224 px photo folder with its ten classes named as Imagenette's (a small copy of
    imagenette2's layout, which `data.dataset=imagenette` uses in place)."""
    source = imagenet224(root, data_dir)

    def build(tmp):
        shutil.copytree(source, tmp)
        for split in ("train", "val"):
            for old, new in zip(sorted(p.name for p in (tmp / split).iterdir()), IMAGENETTE_CLASSES):
                (tmp / split / old).rename(tmp / split / new)
    return build_once(root, "imagenette_tiny", build)


def npz32(root: Path, data_dir: Path) -> Path:
    """The 32 px JPEG folder decoded once (`speedrun data prepare`), for the resident path."""
    source = jpeg32(root, data_dir)

    def build(tmp):
        tmp.mkdir()
        speedrun("data", "prepare", source, "--size", 32, "--out", tmp / "c32.npz", "--workers", 1)
    return build_once(root, "npz32", build) / "c32.npz"


def tiny_npz32(root: Path, data_dir: Path) -> Path:
    """The 64 px Tiny-ImageNet-layout folder decoded once at 32 px (`speedrun data prepare
    --size 32`), for the resident path."""
    source = tiny64(root, data_dir)

    def build(tmp):
        tmp.mkdir()
        speedrun("data", "prepare", source, "--size", 32, "--out", tmp / "t32.npz", "--workers", 1)
    return build_once(root, "tiny_npz32", build) / "t32.npz"


BUILDERS = {f.__name__: f for f in (cifar_small, fashion_small, fashion_later, jpeg32, fashion_jpeg, tiny64, imagenet224, imagenette_tiny,
                                    npz32, tiny_npz32)}
"""Fixture name -> builder(root, data_dir)."""
