"""The benchmark scripts that the README's figures come from, run for real on small data: each
writes a complete record naming the commit that ran (read before it runs) and the CPU."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def script(name: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def head_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip() if out.returncode == 0 else None


def check_environment(record: dict) -> None:
    env = record["environment"]
    assert env["cpu_model"] and env["torch_version"] and env["cpu_cores"] >= 1
    if head_commit():                                  # (a checkout: CI clones one)
        assert env["git_commit"] == head_commit()


def test_train_cli_times_whole_processes_and_keeps_each_runs_folder(tmp_path, data_dir):
    out, keep = tmp_path / "train.json", tmp_path / "kept"
    script("train_cli.py", "fashion-mnist", "--runs", "2", "--data-dir", data_dir, "--out", out,
           "--keep-runs", keep, "--", "--set", "train.epochs=0.25", "--device", "cpu")
    record = json.loads(out.read_text())
    check_environment(record)
    runs = record["runs"]
    assert len(runs) == 2 and all(r["process_wall_seconds"] > r["summary"]["train_seconds"] > 0 for r in runs)
    assert [r["summary"]["seed"] for r in runs] == [0, 1]
    assert record["summary"]["test_acc_min"] > 0.5                        # learned (chance: 0.1)
    assert sorted(p.name for p in keep.iterdir()) == ["run0", "run1"] and (keep / "run1" / "model.pt").is_file()
    # a kept folder that exists is refused before any run, and nothing is written
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_cli.py"), "fashion-mnist",
                            "--out", tmp_path / "again.json", "--keep-runs", keep], capture_output=True, text=True)
    assert again.returncode == 2 and "--keep-runs" in again.stderr and not (tmp_path / "again.json").exists()


def test_stream_pipeline_compares_the_streamed_loader_with_a_per_sample_one(tmp_path, jpeg32):
    out = tmp_path / "stream.json"
    script("stream_pipeline.py", jpeg32, "--batches", "2", "--batch", "64", "--workers", "1", "--out", out)
    record = json.loads(out.read_text())
    check_environment(record)
    assert {(r["pipeline"], r["crop"]) for r in record["results"]} == {
        (p, c) for p in ("speedrun (simplejpeg)", "speedrun (pillow)", "plain per-sample pillow")
        for c in ("translate", "rrc")}
    assert all(r["images_per_second"] > 0 for r in record["results"]) and set(record["speedup"]) == {"translate", "rrc"}


def test_hold_memory_alternates_the_setting_in_whole_processes(tmp_path, data_dir):
    out = tmp_path / "hold.json"
    script("hold_memory.py", "--rounds", "2", "--out", out, "--", "flops", "fashion-mnist", "--steps", "2",
           "--data-dir", data_dir, "--set", "model.widths=[8,16,16]")
    record = json.loads(out.read_text())
    check_environment(record)
    assert [(r["round"], r["hold_memory"]) for r in record["runs"]] == [(0, "off"), (0, "auto"), (1, "auto"),
                                                                      (1, "off")]
    assert all(r["model_flops_per_s"] > 0 and r["process_seconds"] > 0 for r in record["runs"])
    assert set(record["medians"]) == {"off", "auto"}


def test_cuda_graph_inputs_writes_each_graphs_counts(tmp_path, data_dir):
    out = tmp_path / "cgi.json"
    script("cuda_graph_inputs.py", "--data-dir", data_dir, "--only", "cifar10-94-fast", "--out", out)
    record = json.loads(out.read_text())
    check_environment(record)
    (row,) = record["rows"]
    assert row["recipe"] == "cifar10-94-fast" and row["mutated_not_static_total"] == 0
    update = max(row["graphs"], key=lambda g: g["mutated"])
    assert update["mutated"] > 40 and update["static"] >= update["mutated"] and row["parameters"] > 10
