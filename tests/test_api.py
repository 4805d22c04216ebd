"""speedrun from Python (src/speedrun/api.py, docs/python.md): the documentation's example runs as
written and learns; its run is the command line's run of the same recipe, overrides and seed, bit
for bit; refusals raise speedrun's own exceptions, never SystemExit, and write nothing."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def example() -> str:
    text = (ROOT / "docs" / "python.md").read_text()
    (block,) = re.findall(r"## Example.*?```python\n(.*?)```", text, re.S)
    return block


def test_the_documented_example_runs_learns_and_is_the_command_lines_run_bit_for_bit(tmp_path, data_dir):
    """The example as benchmarks/python_example.py runs it (its code block in a fresh process, in a
    folder of its own), its round kept; then the same run from the command line."""
    env = {**os.environ, "SPEEDRUN_DATA": str(data_dir), "SPEEDRUN_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "python_example.py"), "--rounds", "1",
                           "--keep", str(tmp_path / "kept"), "--out", str(tmp_path / "record.json"),
                           "--data-dir", str(data_dir)], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "record.json").read_text())
    (done,) = record["rounds"]
    assert record["code"] == example() and record["environment"]["cpu_model"] and record["torch"] == torch.__version__
    round_dir = tmp_path / "kept" / "round-0"
    folder = round_dir / "runs" / "python-demo"
    summary = json.loads((folder / "summary.json").read_text())
    assert done["test_acc"] == summary["test_acc"] and done["train_seconds"] == summary["train_seconds"]
    assert done["process_seconds"] > summary["wall_seconds"] > 0 and done["process_cpu_seconds"] > 0
    assert record["summary"]["process_seconds_median"] == done["process_seconds"]
    chance = 0.1 + 3 * math.sqrt(0.1 * 0.9 / 1000)
    assert summary["test_images"] == 1000 and summary["test_acc"] > chance        # learned (chance: 10%)
    first, second = done["stdout"]
    assert first.startswith(f"{summary['test_acc']:.2%} test accuracy") and "runs/python-demo" in first
    assert second.startswith("first-test-image.png [(") and second.count(", 0.") == 3      # three classes ranked
    arrays = [line for line in (folder / "config.toml").read_text().splitlines() if line.startswith("path = ")]
    assert arrays and str(round_dir / "cache" / "arrays") in arrays[0]
    path = json.loads(arrays[0].split("=", 1)[1])
    cli = subprocess.run([sys.executable, "-m", "speedrun", "train", "fashion-mnist", "--set", "data.dataset=npz",
                          "--set", f"data.path={json.dumps(path)}", "--set", "train.epochs=2", "--set",
                          "model.widths=[16,32,32]", "--seed", "0", "--out", str(tmp_path / "cli")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert cli.returncode == 0, cli.stderr[-3000:]
    a = torch.load(folder / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "cli" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert again["test_acc"] == summary["test_acc"] and again["recipe_hash"] == summary["recipe_hash"]


def test_refusals_raise_speedruns_exceptions_and_write_nothing(tmp_path, monkeypatch):
    import numpy as np

    import speedrun
    from speedrun.errors import DataError, RecipeError, SpeedrunError, UsageError
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPEEDRUN_CACHE", str(tmp_path / "cache"))
    cases = [
        (dict(recipe="fashion-mnist", set={"data.holdout": 2}), RecipeError, "--set data.holdout=2"),
        (dict(recipe="fashion-mnist", set={"optim.nonsense": 1}), RecipeError, "optim.nonsense"),
        (dict(recipe="fashion-mnist", set={"train.epochs": object()}), UsageError, "not a recipe value"),
        (dict(recipe="fashion-mnist", data={"x_train": [0]}), UsageError, "it lacks y_train, x_test, y_test"),
        (dict(recipe="fashion-mnist", device="tpu"), UsageError, "device must be 'cpu' or 'cuda'"),
        (dict(recipe="fashion-mnist", data={"x_train": np.zeros((4, 8, 8), np.float32), "y_train": np.zeros(4, int),
                                            "x_test": np.zeros((2, 8, 8), np.uint8), "y_test": np.zeros(2, int)},
              device="cpu"), DataError, "x_train"),
        (dict(), UsageError, "needs a recipe"),
    ]
    for kwargs, kind, says in cases:
        with pytest.raises(kind) as err:
            speedrun.train(**kwargs, quiet=True)
        assert says in str(err.value) and isinstance(err.value, SpeedrunError), (kwargs, str(err.value))
        assert "\n" not in str(err.value)
    import speedrun.bench                      # (the package takes the name: calling it is still the API's bench)
    for call in (speedrun.bench, speedrun.api.bench):
        with pytest.raises(UsageError, match="runs must be a whole number above 0"):
            call("fashion-mnist", runs=0)
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["cache"])      # (the arrays' file, by content)
    assert not (tmp_path / "runs").exists()
