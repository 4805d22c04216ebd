"""benchmarks/any_network.py (speedrun's epoch against a plain PyTorch loop on timm's networks and a
factory's) at a tiny size: 256 real CIFAR-10 images, one epoch of 4 steps, one round, the narrowest
widths, one of timm's networks and the factory's (the timm networks take the same path through the
script, only the name differs). Too short to learn, so the record's arithmetic is checked instead;
the committed record (benchmarks/results/any-network-*.json) has the accuracies. timm needs
torchvision: this runs in .venv-2.14 (.ci/run) and skips elsewhere."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("timm", reason="timm is not installed")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "any_network.py"
TINY = ["--train-images", "256", "--test-images", "256", "--epochs", "1", "--runs", "1", "--narrow",
        "--batch-size", "64", "--threads", "1", "--networks", "convnext_atto,custom"]


def script(*args, data_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--data-dir", str(data_dir), *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def test_the_record_has_every_figure_of_every_network_and_system(tmp_path, data_dir):
    out = tmp_path / "r.json"
    proc = script(*TINY, "--note", "a test", "--out", out, data_dir=data_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["note"] == "a test" and record["environment"]["commit"] and record["narrow"]
    assert record["networks"] == ["convnext_atto", "custom"] and len(record["rounds"]) == 1
    assert record["models"]["convnext_atto"]["args"] == {"dims": [16, 32, 64, 128]}
    (done,) = record["rounds"]
    assert done["order"] == ["speedrun", "plain"]
    for net in record["networks"]:
        for system in ("speedrun", "plain"):
            run = done[net][system]
            assert run["system"] == system and run["steps"] == 4 and run["batch_size"] == 64
            assert len(run["epoch_seconds"]) == 1 and run["seconds_per_epoch"] == pytest.approx(run["epoch_seconds"][0])
            assert run["images_per_s"] == pytest.approx(4 * 64 / run["epoch_seconds"][0])
            assert run["process_seconds"] > run["seconds_per_epoch"] > 0 and run["eval_seconds"] > 0
            assert 0 <= run["test_acc"] <= 1 and run["threads"] == 1 and not run["compile"]
            assert run["precision"] == ("bf16" if record["bf16_units"] else "fp32")
        row = record["summary"][net]
        assert row["speedrun"]["runs"] == row["plain"]["runs"] == 1
        assert row["speedrun_over_plain"] == pytest.approx(done[net]["speedrun"]["seconds_per_epoch"]
                                                           / done[net]["plain"]["seconds_per_epoch"])
        assert row["per_round"] == [pytest.approx(row["speedrun_over_plain"])]
    network = next(line for line in done["convnext_atto"]["speedrun"]["start_lines"] if "network:" in line)
    assert "timm" in network and "convnext_atto with dims=[16, 32, 64, 128]" in network
    assert any("network: custom" in line or "plain_net.py" in line
               for line in done["custom"]["speedrun"]["start_lines"])


@pytest.mark.parametrize("bad, words", [
    (["--runs", "0"], "--runs 0: give 1 or more"),
    (["--networks", "resnet50"], "--networks resnet50: give names from convnext_atto"),
    (["--train-images", "10", "--batch-size", "64"], "--train-images 10: give at least --batch-size (64)"),
    (["--epochs", "two"], "argument --epochs: invalid int value"),
    (["(an existing --out)"], "r.json: already exists; choose another name"),
])
def test_a_bad_argument_is_one_line_and_writes_nothing(tmp_path, data_dir, bad, words):
    out = tmp_path / "r.json"
    if bad == ["(an existing --out)"]:                        # an earlier record, which is left as it was
        out.write_text("an earlier record")
        bad = TINY
    proc = script(*bad, "--out", out, data_dir=data_dir)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode and len(lines) == 1 and lines[0].startswith("any_network: error: "), proc.stderr
    assert words in lines[0]
    assert [p.name for p in tmp_path.iterdir()] == (["r.json"] if bad == TINY else [])
    assert bad != TINY or out.read_text() == "an earlier record"
