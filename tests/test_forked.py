"""The tests' command-line runs (tests/forked.py): a process forked from an interpreter that has
imported torch does what ``python -m speedrun`` in a fresh interpreter does, and a run whose
environment could change what those imports did gets a fresh interpreter."""
from __future__ import annotations

import json
import os

import torch

import forked
from matrix import bar


def _both(args, env=None):
    env = {**os.environ, **(env or {})}
    env.pop("SPEEDRUN_TEST_FRESH", None)
    fork = forked.run([str(a) for a in args], env, timeout=600)
    fresh = forked.run([str(a) for a in args], {**env, "SPEEDRUN_TEST_FRESH": "1"}, timeout=600)
    return fork, fresh


def _tensors(obj, prefix="") -> dict:
    if torch.is_tensor(obj):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _tensors(value, f"{prefix}/{key}").items()}
    return {}


def test_a_forked_run_trains_writes_and_refuses_as_a_fresh_interpreter_does(tmp_path, fashion_small, monkeypatch):
    monkeypatch.delenv("SPEEDRUN_TEST_FRESH", raising=False)
    # a refusal: the same exit status and the same words, nothing else on either stream
    fork, fresh = _both(["train", "nonesuch", "--out", tmp_path / "never"])
    assert fork.forked and not fresh.forked
    assert fork.returncode == fresh.returncode == 2
    assert fork.stderr == fresh.stderr and "no recipe named 'nonesuch'" in fork.stderr
    assert fork.stdout == fresh.stdout == "" and not (tmp_path / "never").exists()
    # a run, from a working folder of its own: the same weights to the bit, the same record
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = ["train", "fashion-mnist", "--set", "data.dataset=npz", "--data-dir", fashion_small, "--device", "cpu",
            "--set", "model.widths=[16,32,32]", "--set", "data.batch_size=128", "--set", "train.epochs=4",
            "--set", "eval.tta=none", "--set", "runtime.precision=fp32"]
    fork = forked.run([*map(str, args), "--out", "a"], dict(os.environ), timeout=600)
    assert fork.forked and fork.returncode == 0, fork.stderr
    fresh = forked.run([*map(str, args), "--out", "b"], {**os.environ, "SPEEDRUN_TEST_FRESH": "1"}, timeout=600)
    assert not fresh.forked and fresh.returncode == 0, fresh.stderr
    a, b = (_tensors(torch.load(work / name / "model.pt", weights_only=True)) for name in "ab")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((work / name / "summary.json").read_text()) for name in "ab")
    assert ra["test_acc"] == rb["test_acc"] > bar(10, 256)          # (the run learned: 39% on this CPU)
    assert ra["command"].replace(" a", " b") == rb["command"] and ra["torch_threads"] == rb["torch_threads"]
    assert fork.stdout.count("\n") == fresh.stdout.count("\n")


def test_a_run_whose_environment_could_change_the_imports_gets_a_fresh_interpreter(monkeypatch):
    monkeypatch.delenv("SPEEDRUN_TEST_FRESH", raising=False)
    base = dict(os.environ)
    for name, value, fork in (("SPEEDRUN_CACHE", "/elsewhere", True), ("TORCHINDUCTOR_CACHE_DIR", "/elsewhere", True),
                              ("OMP_NUM_THREADS", "7", False), ("ATEN_CPU_CAPABILITY", "default", False),
                              ("TORCH_LOGS", "recompiles", False), ("PYTHONPATH", "/elsewhere", False)):
        proc = forked.run(["--version"], {**base, name: value}, timeout=600)
        assert proc.returncode == 0 and proc.stdout.startswith("speedrun "), proc.stderr
        assert proc.forked == fork, name
    proc = forked.run(["--version"], {**base, "SPEEDRUN_TEST_FRESH": "1"}, timeout=600)
    assert not proc.forked and proc.returncode == 0
