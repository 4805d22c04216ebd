"""runtime.threads: one operator thread per core that other work leaves idle (engine/threads.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from speedrun.engine import threads
from speedrun.engine.runtime import resolve_runtime
from speedrun.recipe import load_recipe


@pytest.mark.parametrize("setting, cores, busy, omp, chosen, said", [
    ("auto", 2, 0.0, None, 2, "none busy"),
    ("auto", 2, 0.4, None, 2, "none busy"),              # less than half a core busy: every core
    ("auto", 2, 1.0, None, 1, "1 of 2 usable cores busy"),
    ("auto", 2, 3.0, None, 1, "1 of 2 usable cores busy"),   # never fewer than one thread
    ("auto", 16, 5.6, None, 10, "6 of 16 usable cores busy"),
    ("auto", 4, None, None, 4, "could not be read"),
    ("auto", 2, 1.0, "2", 2, "$OMP_NUM_THREADS"),        # the user's environment wins
    (3, 2, 1.0, "1", 3, "runtime.threads"),              # and a number in the recipe over it
    ("auto", 2, 1.0, "0", 1, "1 of 2 usable cores busy"),   # a count of 0 sets nothing
])
def test_threads_follow_the_idle_cores(setting, cores, busy, omp, chosen, said):
    n, why = threads.choose_threads(setting, cores, busy, omp)
    assert n == chosen and said in why and f"threads {chosen}" in why


def test_busy_processes_are_counted():
    """Two processes spinning on the CPU are runnable all the time, so the machine's count of
    running threads holds them (and anything else running): at least two busy cores."""
    spin = "import sys; print('ready', flush=True)\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        busy = threads.busy_cores(samples=20, seconds=0.4)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert busy is not None and busy >= 1.9, busy


def test_the_plan_chooses_threads_on_a_cpu_only(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import torch
    rt = resolve_runtime(load_recipe("fashion-mnist").runtime, torch.device("cpu"), "speednet", 100)
    assert rt.threads == 1 and any(c.startswith("threads 1: $OMP_NUM_THREADS") for c in rt.choices)
    assert resolve_runtime(load_recipe("fashion-mnist").runtime, torch.device("cpu")).threads == 0   # no plan: as is


def test_a_run_uses_and_records_the_threads_it_chose(tmp_path, fashion_small):
    """A real process without $OMP_NUM_THREADS: runtime.threads=1 is said at start, applied
    (the summary's device and thread count) and the run learns."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "speedrun", "train", "fashion-mnist", "--data-dir", fashion_small,
                           "--set", "data.dataset=npz", "--set", "model.widths=[16,32,32]", "--set",
                           "data.batch_size=64", "--set", "train.epochs=2", "--set", "runtime.threads=1",
                           "--set", "runtime.precision=fp32", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "threads 1: runtime.threads" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["threads"] == 1 and summary["device_name"].endswith("(1 threads)")
    assert summary["test_acc"] > 0.1 + 3 * (0.09 / summary["test_images"]) ** 0.5


def test_a_bad_thread_count_names_the_field():
    from speedrun.errors import RecipeError
    with pytest.raises(RecipeError, match="runtime.threads"):
        load_recipe("fashion-mnist", ["runtime.threads=0"])
