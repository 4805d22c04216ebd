"""Shared fixtures: the real datasets, and small real data sets made from them once per test
session (shared by pytest-xdist's workers through a file lock)."""
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]


def shared_data() -> Path:
    """The real datasets: $SPEEDRUN_DATA (CI sets it) or ../shared/datasets beside the repo."""
    path = Path(os.environ.get("SPEEDRUN_DATA") or REPO.parent / "shared" / "datasets")
    if not (path / "cifar-10-batches-py").is_dir():
        raise RuntimeError(f"the shared datasets are not at {path}; set SPEEDRUN_DATA to the folder "
                           "holding cifar-10-batches-py/ and fashion-mnist/")
    return path


def pytest_configure(config):
    # decoded folder caches (data.cache) go to a private folder, never the user's ~/.cache
    if not os.environ.get("SPEEDRUN_CACHE"):
        import tempfile
        os.environ["SPEEDRUN_CACHE"] = tempfile.mkdtemp(prefix="speedrun-test-cache-")
    # compiled code: inductor's own shared cache (/tmp/torchinductor_USER) unless set, so that
    # sessions reuse each other's compiles; the test of speedrun's own folder sets it apart
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        import getpass
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    # under xdist the workers share the 2 cores: one thread each, and the same for the
    # speedrun processes the tests start (and inductor compiles in the process, without a pool
    # of compile workers that each import torch again)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        import torch
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist each of the N workers is first handed a contiguous N-th of the tests, and
    one that runs out takes half of the longest queue's tail. The tests marked ``slow`` (about a
    minute or more on a 2-core CPU) go to the head of each N-th, so that every worker starts on
    its share of them and none is left running one alone at the end of the run."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    slow = [item for item in items if item.get_closest_marker("slow")]
    if workers < 2 or not slow:
        return
    rest = [item for item in items if not item.get_closest_marker("slow")]
    ordered = []
    for i in range(workers):
        share = slow[i::workers]
        take = max(0, len(items) * (i + 1) // workers - len(ordered) - len(share))
        ordered += share + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return shared_data()


@pytest.fixture(scope="session")
def cifar10(data_dir):
    from speedrun.data import load_dataset
    return load_dataset("cifar10", data_dir, fetch=False)


@pytest.fixture(scope="session")
def fashion(data_dir):
    from speedrun.data import load_dataset
    return load_dataset("fashion-mnist", data_dir, fetch=False)


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """No $SPEEDRUN_DATA, a private home (so ~/.cache/speedrun is empty), no real network."""
    monkeypatch.delenv("SPEEDRUN_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


# ------------------------------------------------------------------------------------------
# Small real data sets, built once per session
# ------------------------------------------------------------------------------------------

@pytest.fixture
def cli(capsys):
    """``speedrun.cli.main`` in this process: (exit code, stderr)."""
    from speedrun import cli as speedrun_cli

    def run(*args):
        capsys.readouterr()
        try:
            rc = speedrun_cli.main([str(a) for a in args])
        except SystemExit as exc:                   # argparse
            rc = exc.code
        return rc, capsys.readouterr().err
    return run


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    """A folder shared by every xdist worker of this session."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "artifacts"
    root.mkdir(exist_ok=True)
    return root


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


def subset_npz(ds, path: Path, n_train: int, n_test: int) -> None:
    """The first images of a built-in set as an .npz dataset (with its class names)."""
    np.savez(path, x_train=ds.train_x[:n_train].numpy(), y_train=ds.train_y[:n_train].numpy(),
             x_test=ds.test_x[:n_test].numpy(), y_test=ds.test_y[:n_test].numpy(), classes=np.array(ds.classes))


def _cli(*args):
    from test_cli import speedrun
    return speedrun(*args)


@pytest.fixture(scope="session")
def cifar_small(artifacts, cifar10) -> Path:
    """CIFAR-10's first 1,024 training and 256 test images."""
    def build(tmp):
        tmp.mkdir()
        subset_npz(cifar10, tmp / "cifar.npz", 1024, 256)
    return build_once(artifacts, "cifar-small", build) / "cifar.npz"


@pytest.fixture(scope="session")
def fashion_small(artifacts, fashion) -> Path:
    """Fashion-MNIST's first 1,024 training and 256 test images."""
    def build(tmp):
        tmp.mkdir()
        subset_npz(fashion, tmp / "fashion.npz", 1024, 256)
    return build_once(artifacts, "fashion-small", build) / "fashion.npz"


@pytest.fixture(scope="session")
def jpeg32(artifacts, data_dir) -> Path:
    """CIFAR-10 as JPEG files at 32 px in the ImageNet layout: 512 train, 512 val images."""
    return build_once(artifacts, "jpeg32", lambda tmp: _cli("data", "export", "cifar10", "--format", "jpeg",
                                                           "--out", tmp, "--data-dir", data_dir, "--limit", 512))


@pytest.fixture(scope="session")
def tiny64(artifacts, data_dir) -> Path:
    """CIFAR-10 upscaled to 64 px in Tiny-ImageNet's layout (val/images + val_annotations.txt):
    256 train, 256 val images."""
    return build_once(artifacts, "tiny64", lambda tmp: _cli(
        "data", "export", "cifar10", "--format", "jpeg", "--out", tmp, "--data-dir", data_dir, "--limit", 256,
        "--size", 64, "--layout", "tiny-imagenet"))


@pytest.fixture(scope="session")
def imagenet224(artifacts, data_dir) -> Path:
    """CIFAR-10 upscaled to 224 px photos in the ImageNet layout: the first 256 train and 512 val
    images. The runs on it train little (a few dozen steps at 32 px), so the larger test split
    holds their accuracy's bar (chance + 3 standard errors) at 14.0% rather than 15.6%: on a
    2-core Zen 3 the compiled bf16 resnet18-fast entry scored 15.6% on the first 256 val images
    under one seed, and 16.2-21.1% on all 512 under seeds 0-7."""
    def build(tmp):
        _cli("data", "export", "cifar10", "--format", "jpeg", "--out", tmp, "--data-dir", data_dir, "--limit", 512,
             "--size", 224)
        for photo in (tmp / "train").glob("*/*.jpg"):       # named by their index in CIFAR-10's train set
            if int(photo.stem) >= 256:
                photo.unlink()
    return build_once(artifacts, "imagenet224", build)


IMAGENETTE_CLASSES = ("n01440764", "n02102040", "n02979186", "n03000684", "n03028079", "n03394916", "n03417042",
                      "n03425413", "n03445777", "n03888257")


@pytest.fixture(scope="session")
def imagenette_tiny(artifacts, imagenet224) -> Path:
    """The 224 px photo folder with its ten classes named as Imagenette's (a small copy of
    imagenette2's layout, which `data.dataset=imagenette` uses in place)."""
    def build(tmp):
        shutil.copytree(imagenet224, tmp)
        for split in ("train", "val"):
            for old, new in zip(sorted(p.name for p in (tmp / split).iterdir()), IMAGENETTE_CLASSES):
                (tmp / split / old).rename(tmp / split / new)
    return build_once(artifacts, "imagenette_tiny", build)


@pytest.fixture(scope="session")
def npz32(artifacts, jpeg32) -> Path:
    """The 32 px JPEG folder decoded once (`speedrun data prepare`), for the resident path."""
    def build(tmp):
        tmp.mkdir()
        _cli("data", "prepare", jpeg32, "--size", 32, "--out", tmp / "c32.npz", "--workers", 1)
    return build_once(artifacts, "npz32", build) / "c32.npz"


@pytest.fixture(scope="session")
def tiny_npz32(artifacts, tiny64) -> Path:
    """The 64 px Tiny-ImageNet-layout folder decoded once at 32 px (`speedrun data prepare
    --size 32`), for the resident path."""
    def build(tmp):
        tmp.mkdir()
        _cli("data", "prepare", tiny64, "--size", 32, "--out", tmp / "t32.npz", "--workers", 1)
    return build_once(artifacts, "tiny_npz32", build) / "t32.npz"


TINY_BENCH = ["--set", "data.dataset=npz", "--set", "train.epochs=0.75", "--set", "model.widths=[8,16,16]",
              "--set", "data.batch_size=256", "--set", "eval.tta=flip"]
"""fashion-mnist on the 1,024-image slice (--data-dir fashion_small): 3 steps and a 256-image test."""


@pytest.fixture(scope="session")
def bench_records(artifacts, fashion_small):
    """Two small benches and an ablation, made once with the real commands and shared by the
    bench and report tests: (root, bench A stdout, bench B stdout, ablate stdout)."""
    def build(root):
        root.mkdir()
        outs = {
            "a": _cli("bench", "fashion-mnist", "--runs", 3, "--data-dir", fashion_small, "--out", root / "a",
                      *TINY_BENCH),
            "b": _cli("bench", "fashion-mnist", "--runs", 3, "--data-dir", fashion_small, "--out", root / "b",
                      *TINY_BENCH, "--set", "eval.tta=none", "--seed", 10),
            "abl": _cli("ablate", "fashion-mnist", "--runs", 2, "--data-dir", fashion_small, "--out", root / "abl",
                        *TINY_BENCH, "--tricks", "label_smoothing,tta", "--ladder", "tta", "--epochs-grid", "0.5"),
        }
        for name, proc in outs.items():
            (root / f"{name}.stdout").write_text(proc.stdout)
    root = build_once(artifacts, "bench-records", build)
    return (root, *((root / f"{n}.stdout").read_text() for n in ("a", "b", "abl")))


sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _torch_weight_gradients():
    """Each test starts with torch's 3x3 weight gradients (the process-wide default) and no
    measured shapes: a runtime activated by an earlier test in the same worker must not
    change how a later one computes."""
    from speedrun.models import weight_grad
    weight_grad.set_mode("torch")
    yield
