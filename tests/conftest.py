"""Shared fixtures: the real datasets, and small real data sets made from them once per test
session (shared by pytest-xdist's workers through a file lock)."""
import os
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import small_data  # noqa: E402
from small_data import build_once, shared_data, speedrun as _cli  # noqa: E402


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


@pytest.fixture(scope="session")
def cifar_small(artifacts, data_dir, cifar10) -> Path:
    """CIFAR-10's first 1,024 training and 256 test images."""
    return small_data.cifar_small(artifacts, data_dir, cifar10)


@pytest.fixture(scope="session")
def fashion_small(artifacts, data_dir, fashion) -> Path:
    """Fashion-MNIST's first 1,024 training and 256 test images."""
    return small_data.fashion_small(artifacts, data_dir, fashion)


def _small(name: str):
    """A session fixture for one of small_data's builders (its docstring says what it makes)."""
    build = small_data.BUILDERS[name]

    def fixture(artifacts, data_dir) -> Path:
        return build(artifacts, data_dir)
    fixture.__name__, fixture.__doc__ = name, build.__doc__
    return pytest.fixture(scope="session", name=name)(fixture)


jpeg32 = _small("jpeg32")
fashion_later = _small("fashion_later")
fashion_jpeg = _small("fashion_jpeg")
tiny64 = _small("tiny64")
imagenet224 = _small("imagenet224")
imagenette_tiny = _small("imagenette_tiny")
npz32 = _small("npz32")
tiny_npz32 = _small("tiny_npz32")


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


@pytest.fixture(scope="session")
def cifar_archive(artifacts, data_dir) -> Path:
    """The real CIFAR-10 folder packed as its official archive is, cifar-10-python.tar.gz (gzip
    level 1), made once per session: the tests that download it, find it beside the data or
    beside a user's folder of its name copy or link it."""
    def build(tmp):
        tmp.mkdir()
        with tarfile.open(tmp / "cifar-10-python.tar.gz", "w:gz", compresslevel=1) as tar:
            tar.add(data_dir / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return build_once(artifacts, "cifar-archive", build) / "cifar-10-python.tar.gz"



@pytest.fixture(autouse=True)
def _torch_weight_gradients():
    """Each test starts with torch's 3x3 weight gradients (the process-wide default) and no
    measured shapes: a runtime activated by an earlier test in the same worker must not
    change how a later one computes."""
    from speedrun.models import weight_grad
    weight_grad.set_mode("torch")
    yield


@pytest.fixture(scope="session")
def teacher_run(artifacts, cifar_small) -> Path:
    """The recipe matrix's TEACHER entry's run folder (cifar10-94 on CIFAR-10's first 1,024 images),
    trained once per test session (shared by xdist's workers): the model the matrix's distillation
    and fine-tuning entries start from, and the weights benchmarks/finetune_peers.py's test
    fine-tunes."""
    from matrix import MATRIX, command
    from speedrun.cli import main

    def build(out):
        argv, env = command(MATRIX[0], cifar_small, out)          # (test_recipe_matrix.py's TEACHER)
        assert not env and main(argv) == 0
    return build_once(artifacts, "matrix-teacher-run", build)
