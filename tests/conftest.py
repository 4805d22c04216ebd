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
