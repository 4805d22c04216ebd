import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_data() -> Path:
    """The real datasets: $SPEEDRUN_DATA (CI sets it) or ../shared/datasets beside the repo."""
    path = Path(os.environ.get("SPEEDRUN_DATA") or REPO.parent / "shared" / "datasets")
    if not (path / "cifar-10-batches-py").is_dir():
        raise RuntimeError(f"the shared datasets are not at {path}; set SPEEDRUN_DATA to the folder "
                           "holding cifar-10-batches-py/ and fashion-mnist/")
    return path


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


TINY_BENCH = ["--set", "train.epochs=0.1", "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=1024",
              "--set", "eval.tta=flip"]


@pytest.fixture(scope="session")
def bench_records(tmp_path_factory, data_dir):
    """Two small benches and an ablation, made once with the real commands and shared by the
    bench and report tests: (root, bench A output, bench B output, ablate output)."""
    from test_cli import speedrun
    root = tmp_path_factory.mktemp("bench")
    a = speedrun("bench", "fashion-mnist", "--runs", 3, "--data-dir", data_dir, "--out", root / "a", *TINY_BENCH)
    b = speedrun("bench", "fashion-mnist", "--runs", 3, "--data-dir", data_dir, "--out", root / "b", *TINY_BENCH,
                 "--set", "eval.tta=none", "--seed", 10)
    abl = speedrun("ablate", "fashion-mnist", "--runs", 2, "--data-dir", data_dir, "--out", root / "abl",
                   *TINY_BENCH, "--tricks", "label_smoothing,tta", "--ladder", "tta", "--epochs-grid", "0.5")
    return root, a, b, abl
