"""The benchmark scripts that the README's figures come from, run for real on small data: each
writes a complete record naming the commit that ran (read before it runs) and the CPU."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_train_cli_times_whole_processes_alone_and_beside_a_busy_one_and_keeps_each_runs_folder(
        tmp_path, fashion_small, data_dir):
    """speedrun from a checkout named by --system (seed 3) beside the plain loop (on the first 2,048
    Fashion-MNIST images), each alone, and speedrun again beside one `yes` process (--busy-systems:
    the plain loop beside a busy core cost about half of this test's CPU and checked nothing that its
    run alone does not), in one call: every process timed from outside, every speedrun run's folder
    kept (the plain loop has none)."""
    out, keep = tmp_path / "train.json", tmp_path / "kept"
    train = ["--", "--data-dir", fashion_small, "--set", "data.dataset=npz", "--set", "train.epochs=3",
             "--set", "data.batch_size=128", "--set", "eval.tta=none", "--device", "cpu"]
    script("train_cli.py", "fashion-mnist", "--runs", "1", "--first-seed", "3", "--data-dir", data_dir,
           "--out", out, "--system", "plain", "--system", f"here={ROOT}", "--plain-images", "2048",
           "--busy", "1", "--busy-systems", "here", "--keep-runs", keep, *train, timeout=600)
    record = json.loads(out.read_text())
    check_environment(record)
    runs = record["runs"]
    assert [(r["system"], r["busy_processes"]) for r in runs] == [("plain", 0), ("here", 0), ("here", 1)]
    assert record["busy_systems"] == ["here"]
    assert runs[0]["summary"]["test_acc"] > 0.13                       # chance + 3 SE of 2,048
    systems = record["summary"]["systems"]
    assert systems["here"]["commit"] == head_commit() and systems["plain"]["commit"] == record["environment"]["commit"]
    assert len(systems["plain"]["alone"]["runs_s"]) == 1 and "busy" not in systems["plain"]
    assert "slowdown_busy_over_alone" not in systems["plain"]
    for r in runs:
        assert r["process_wall_seconds"] > r["summary"]["train_seconds"] > 0
    here = runs[1:]
    assert [r["summary"]["seed"] for r in here] == [3, 3]
    assert all(r["summary"]["test_acc"] > 0.5 for r in here)                        # learned (chance: 0.1)
    # speedrun's start line says how many threads it chose (one per core left idle by other work)
    assert all(any(line.startswith("speedrun: threads ") for line in r["stdout_head"]) for r in here), here
    row = systems["here"]
    assert len(row["alone"]["runs_s"]) == len(row["busy"]["runs_s"]) == 1
    assert row["slowdown_busy_over_alone"] == row["busy"]["median_s"] / row["alone"]["median_s"] > 0
    assert sorted(p.name for p in keep.iterdir()) == ["here-run0", "here-run0-busy1"]
    assert (keep / "here-run0-busy1" / "model.pt").is_file()
    # a kept folder or a record that exists, a --system that is no checkout, or --busy-systems naming no
    # --system of the call, is refused before any run, writing nothing
    for bad, says in ((["--keep-runs", keep, "--system", f"here={ROOT}", "--busy", "1"], "--keep-runs"),
                      (["--system", f"old={tmp_path}"], "no src/speedrun"), (["--out", out], "already exists"),
                      (["--busy", "1", "--busy-systems", "plain"], "'plain' is not a --system")):
        again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_cli.py"), "fashion-mnist",
                                "--out", tmp_path / "again.json", *map(str, bad)], capture_output=True, text=True)
        assert again.returncode == 2 and says in again.stderr and "Traceback" not in again.stderr
        assert not (tmp_path / "again.json").exists() and json.loads(out.read_text()) == record


# ------------------------------------------------------------------------------------------
# gpu_record.py: variants on random data, its refusals, how peer_runner reads a script (speedrun
# against a peer's own script, the budget and the two calls of a lent GPU: tests/test_gpu_lending.py)
# ------------------------------------------------------------------------------------------

TINY_SPEEDNET = ["--set", "model.widths=[8,16,16]", "--set", "model.whiten.samples=64", "--set", "eval.batch_size=128"]


def test_gpu_record_synthetic_times_and_profiles_each_variant_in_its_own_process(tmp_path):
    out = tmp_path / "synthetic.json"
    script("gpu_record.py", "--synthetic", "--recipe", "cifar10-94-fast", "--variant", "base",
           "--variant", "fp32:runtime.precision=fp32", "--runs", 1, "--profile", "--device", "cpu",
           "--n-train", 256, "--n-test", 128, "--set", "data.batch_size=64", "--set", "train.epochs=1",
           *TINY_SPEEDNET, "--out", out)
    record = json.loads(out.read_text())
    check_environment(record)
    assert record["mode"] == "synthetic" and record["data"]["n_train"] == 256
    base, fp32 = record["variants"]
    assert (base["variant"], fp32["variant"]) == ("base", "fp32") and fp32["runtime"]["precision"] == "fp32"
    for v in (base, fp32):
        assert v["ok"] and v["warmup_seconds"] > 0 and v["process_wall_seconds"] > v["build_and_warmup_seconds"]
        assert len(v["runs"]) == 1 and all(r["seconds"] > 0 and r["steps"] == 4 for r in v["runs"])
        prof = v["profile"]
        assert prof["total_seconds"] > 0 and prof["run_seconds"] > 0 and prof["steps"] == 4
        assert sum(k["seconds"] for k in prof["by_kind"].values()) == pytest.approx(prof["total_seconds"])
        assert sum(k["count"] for k in prof["by_kind"].values()) == prof["events"]
        assert prof["by_kind"]["convolution"]["seconds"] > 0 and prof["steps_marked"] == 4
        assert prof["kernels_per_step"] > 10 and prof["top"]
    assert record["ratios"]["base"] == 1 and record["ratios"]["fp32"] == pytest.approx(
        fp32["summary"]["seconds"]["mean"] / base["summary"]["seconds"]["mean"])


def test_gpu_record_refuses_a_bad_system_or_missing_data_in_one_line_writing_nothing(tmp_path, data_dir):
    """Each case in a process of its own, the script run as __main__: exit code 2, one line on
    stderr, nothing written, and torch never imported (a refusal costs no torch start-up)."""
    out = tmp_path / "record.json"
    plain = tmp_path / "plain.py"
    plain.write_text("print('not an airbench script')\n")
    cases = [(["--system", f"peer:{tmp_path / 'airbench94_muon.py'}"], "no peer script at"),
             (["--system", f"peer:{plain}"], "no `if __name__"),
             (["--system", "airbench94_muon.py"], "expected speedrun:RECIPE"),
             (["--system", "speedrun:cifar10-94@model.widths"], "is not KEY=VALUE"),
             (["--system", "speedrun:cifar10-94-fsat"], "did you mean 'cifar10-94-fast'"),
             (["--system", "speedrun:cifar10-94#soon"], "SPEC#SECONDS with SECONDS above 0"),
             (["--system", "speedrun:cifar10-94", "--limit", "0"], "--limit and --budget are seconds above 0"),
             (["--system", "speedrun:cifar10-94", "--data-dir", tmp_path], "no CIFAR-10 python batches"),
             (["--system", "speedrun:cifar10-94", "--data-dir", data_dir, "--pair", "cifar10-94:airbench94.py"],
              "--pair"),
             (["--synthetic", "--recipe", "cifar10-94-fast", "--variant", "x:model.nope=1"], "unknown recipe field")]
    as_main = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
               "except SystemExit as stop:\n    print(stop.code, 'torch' in sys.modules)\n")
    for args, words in cases:
        proc = subprocess.run([sys.executable, "-c", as_main, str(ROOT / "benchmarks" / "gpu_record.py"),
                               *map(str, args), "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                              timeout=120)
        assert proc.stdout.split() == ["2", "False"], (args, proc.stdout, proc.stderr)
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert not out.exists()


def test_peer_runner_reads_how_a_scripts_main_block_warms_up_and_runs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from peer_runner import PeerError, plan_script
    defs = "def print_training_details(variables, is_final_entry):\n    pass\n\ndef main(run, model):\n    pass\n\n"
    muon = (defs + 'if __name__ == "__main__":\n'
            '    model = CifarNet().cuda().to(memory_format=torch.channels_last)\n'
            '    model.compile(mode="max-autotune")\n    print_columns(logging_columns_list, is_head=True)\n'
            '    main("warmup", model)\n    accs = torch.tensor([main(run, model) for run in range(200)])\n')
    plan = plan_script(muon, "muon.py")
    assert plan["args"] == ["model"] and plan["warmup_in_script"] and len(plan["setup_source"]) == 3
    assert plan["setup_source"][1] == "model.compile(mode='max-autotune')"
    assert [f.name for f in plan["head"].body] == ["print_training_details", "main"]
    assert plan["setup"].body[0].lineno == 8                   # (the file's own line numbers, for tracebacks)
    legacy = (defs.replace("main(run, model)", "main(run)") + "if __name__ == '__main__':\n"
              "    with open(sys.argv[0]) as f:\n        code = f.read()\n"
              "    print_columns(logging_columns_list, is_head=True)\n    #main('warmup')\n"
              "    accs = torch.tensor([main(run) for run in range(25)])\n")
    plan = plan_script(legacy, "legacy.py")
    assert plan["args"] == [] and not plan["warmup_in_script"] and len(plan["setup_source"]) == 2
    for source, says in ((defs, "no `if __name__"), (legacy.replace("def print_training", "def log_training"),
                                                     "defines no print_training_details()"),
                         (legacy.replace("main(run)", "main(*runs)"), "passes *args"),
                         (defs + "if __name__ == '__main__':\n    main('warmup', 1)\n", "no per-run call")):
        with pytest.raises(PeerError, match=re.escape(says)):
            plan_script(source, "peer.py")


# ------------------------------------------------------------------------------------------
# step_structure.py: what one training step costs, counted and timed on the CPU; the stop check
# ------------------------------------------------------------------------------------------

NARROW_STEP = ["--set", "model.widths=[16,32,32]", "--set", "data.batch_size=64"]


@pytest.mark.slow
def test_step_structure_counts_and_times_a_narrow_step_and_times_the_stop_check(tmp_path):
    """In fp32 only (the accumulated row follows --precisions): eager, compiled and accumulated
    rows, the timing (narrowed by --set to the eager and compiled rows' recipe, so timed in their
    sessions); the stop check."""
    out = tmp_path / "structure.json"
    script("step_structure.py", "--only", "cifar10-94", "--precisions", "fp32", "--timing-precisions", "fp32",
           "--backend", "aot_eager", "--timed-steps", 2, *NARROW_STEP, "--out", out, timeout=900)
    record = json.loads(out.read_text())
    check_environment(record)
    rows = {(r["precision"], r["compiled"], "train.accumulate=2" in r["overrides"]): r for r in record["rows"]}
    assert set(rows) == {("fp32", False, False), ("fp32", True, False), ("fp32", True, True)}
    eager, compiled, micro = rows[("fp32", False, False)], rows[("fp32", True, False)], rows[("fp32", True, True)]
    for row in (eager, compiled, micro):                # counted over 4 real steps: no sync, no graph break
        assert row["steps_counted"] == 4 and row["host_syncs_per_step"] == 0 and row["graph_breaks"] == 0, row
    assert eager["compiled_regions_per_step"] == 0 and eager["eager_ops_per_step"] > 100
    assert 1 <= compiled["compiled_regions_per_step"] <= 3 and compiled["eager_ops_per_step"] <= 10
    assert micro["compiled_regions_per_step"] > compiled["compiled_regions_per_step"]   # a forward, a backward each
    assert [(t["precision"], t["compiled"]) for t in record["timing"]] == [("fp32", False), ("fp32", True)]
    assert all(len(t["ms_per_step"]) == 2 and min(t["ms_per_step"]) > 0 for t in record["timing"])
    # (--set narrows the timing rows to the structure rows' recipe: timed in those rows' sessions, not built again)
    assert all("structure row" in t["timed_in"] for t in record["timing"])
    assert eager["ms_per_step"] == record["timing"][0]["ms_per_step"] and micro["ms_per_step"] == []
    # the stop check the loop makes after every step: a flag read alone, an all-reduce of one integer with 2 ranks
    stop = tmp_path / "stop-check.json"
    script("step_structure.py", "--stop-check", "--calls", 50, "--out", stop)
    record = json.loads(stop.read_text())
    check_environment(record)
    medians = record["median_us"]
    assert set(medians) == {"one_process_us", "two_processes_gloo_us"} and record["calls_per_round"] == 50
    assert all(len(record[k]) == 5 and min(record[k]) > 0 for k in medians)
    assert medians["two_processes_gloo_us"] > medians["one_process_us"]
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_structure.py"), "--stop-check",
                            "--out", str(stop)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already exists" in again.stderr and json.loads(stop.read_text()) == record
    page = results_page_of(stop, tmp_path)                  # its table on docs/results.md, its script in the tree
    assert "## Other records" not in page and "## Records whose script left" not in page
    assert "| `stop-check.json` |" in page.split("## Training step structure and cost", 1)[1]


@pytest.mark.slow
def test_step_structure_adds_a_data_parallel_row_to_a_record_keeping_the_rest(tmp_path):
    """--ddp-only: two torchrun processes (gloo) count a compiled data-parallel step in fp32 (the
    first of --precisions); DDP cuts the compiled forward into frames of its own, so a step runs more
    compiled regions than one process's 1 to 3, still without a host sync. The record's other rows stay."""
    out = tmp_path / "structure.json"
    out.write_text(json.dumps({"rows": [{"recipe": "kept"}], "timing": [{"recipe": "kept"}], "ddp": []}))
    script("step_structure.py", "--ddp-only", "--only", "cifar10-94", "--precisions", "fp32", "--backend",
           "aot_eager", *NARROW_STEP, "--out", out, timeout=600)
    record = json.loads(out.read_text())
    check_environment(record)
    assert record["rows"] == record["timing"] == [{"recipe": "kept"}] and len(record["ddp"]) == 1
    ddp = record["ddp"][0]
    assert (ddp["recipe"], ddp["precision"], ddp["processes"], ddp["host_syncs_per_step"]) == ("cifar10-94", "fp32", 2, 0)
    assert "data.batch_size=64" in ddp["overrides"] and ddp["steps_counted"] == 4
    regions = ddp["compiled_regions_per_step_by_rank"]
    assert regions[0] == regions[1] == ddp["compiled_regions_per_step"] > 3


# ------------------------------------------------------------------------------------------
# throughput.py: the model step against its pipelines, and against whole runs, tiny on the CPU
# ------------------------------------------------------------------------------------------

TINY_RESNET50 = ["--device", "cpu", "--size", 32, "--batch", 8, "--steps", 2, "--repeats", 2, "--warm", 1,
                 "--profile-steps", 2, "--images-per-class", 4, "--classes", 2, "--workers", 1,
                 "--set", "model.width=8", "--set", "runtime.compile=off"]


def results_page_of(record: Path, tmp_path: Path) -> str:
    """docs/results.md as scripts/results_page.py renders a folder holding only ``record``."""
    import importlib.util
    import shutil
    folder = tmp_path / "page"
    folder.mkdir()
    shutil.copy(record, folder / record.name)
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    return page.render(folder)


def torchvision_importable() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:                                   # (absent, or built for another torch)
        return False
    return True


def test_throughput_pipelines_times_the_model_step_and_each_pipeline(tmp_path, capsys):
    out = tmp_path / "rn50.json"
    script("throughput.py", "pipelines", *TINY_RESNET50, "--out", out)
    record = json.loads(out.read_text())
    check_environment(record)
    assert record["device"] == "cpu" and record["recipe"] == "imagenet-resnet50"
    assert record["script"] == "benchmarks/throughput.py pipelines"
    assert (record["batch"], record["image_size"], record["recipe_config"]["model"]["width"]) == (8, 32, 8)
    assert record["photos"]["train_images"] == 8 and record["photos"]["mean_bytes"] > 1000
    step = record["model_step"]
    assert len(step["block_seconds"]) == 2 and all(r > 0 for r in step["images_per_second"])
    assert step["images_per_second_median"] > 0 and 0 < step["busy"]["busy_fraction"] <= 1
    streamed, on_device, gpu = record["pipelines"]
    assert streamed["pipeline"] == "streamed" and "1 process," in streamed["decoding"]
    assert len(streamed["block_seconds"]) == 2 and all(r > 0 for r in streamed["images_per_second"])
    assert streamed["epochs_started"] > 1                  # 8 images, batch 8: the blocks cross epochs
    assert streamed["pipeline_over_model"] == pytest.approx(streamed["images_per_second_median"]
                                                            / step["images_per_second_median"])
    assert streamed["bound_by"] in ("model", "pipeline") and 0 < streamed["busy"]["busy_fraction"] <= 1
    if torchvision_importable():
        assert gpu["available"] and gpu["decode"]["images_per_second"] > 0 and gpu["bound_by"] in ("model", "pipeline")
        assert on_device["available"] and on_device["images_per_second_median"] > 0
        assert on_device["bound_by"] in ("model", "pipeline") and on_device["epochs_started"] > 1
    else:
        assert gpu["available"] is False and "torchvision" in gpu["why"]
        assert on_device["available"] is False and "torchvision" in on_device["why"]
    assert record["scale_input"]["batch_per_gpu"] == 8 and record["scale_input"]["params"] == record["params"] > 0
    # speedrun scale takes one GPU's speed from the record
    from speedrun.cli import main
    assert main(["scale", "--step-record", str(out), "--gpus", "1,8"]) == 0
    shown = capsys.readouterr().out
    assert f"{record['params']:,} parameters" in shown and "at 8 per step" in shown
    page = results_page_of(out, tmp_path)                   # (docs/results.md reads it into its table)
    assert "## Other records" not in page and "`rn50.json`" in page.split("## ResNet-50", 1)[1]


TINY_PHOTOS = ["--device", "cpu", "--images-per-class", 6, "--val-per-class", 2, "--steps", 1, "--repeats", 2,
               "--warm", 0, "--profile-steps", 1, "--set", "data.image_size=32", "--set", "data.eval_size=40",
               "--set", "data.batch_size=8", "--set", "model.width=8", "--set", "train.epochs=3",
               "--set", "runtime.compile=off", "--set", "data.workers=0"]


@pytest.mark.slow
def test_throughput_runs_sets_each_training_process_against_its_model_step(tmp_path):
    out = tmp_path / "photos.json"
    script("throughput.py", "runs", *TINY_PHOTOS, "--out", out)
    record = json.loads(out.read_text())
    check_environment(record)
    assert record["script"] == "benchmarks/throughput.py runs"
    page = results_page_of(out, tmp_path)
    assert "## Other records" not in page and "`photos.json`" in page.split("## Photo input pipelines", 1)[1]
    assert record["photos"]["train_images"] == 60 and record["photos"]["sizes_wxh"] == ["224x224"]
    assert [(r["recipe"], r["run"]) for r in record["runs"]] == [("imagenette", 0), ("folder", 0)]
    for row in record["runs"]:
        assert row["ok"] and row["process_wall_seconds"] > row["summary"]["train_seconds"] > row["training_seconds"] > 0
        assert row["images"] == row["summary"]["steps"] * 8 and row["pipeline_images_per_second"] > 0
        assert row["summary"]["data_cache"]["cache_made_now"]      # decoded inside the timed process
        assert row["model_step_images_per_second"] > 0 and row["bound_by"] in ("model", "pipeline")
        assert row["pipeline_over_model"] == pytest.approx(row["pipeline_images_per_second"]
                                                           / row["model_step_images_per_second"])
        assert row["bound_by"] == ("model" if row["pipeline_over_model"] >= 0.9 else "pipeline")
        assert "test_acc" not in row["summary"]
        step = record["model_step"][row["recipe"]]
        # progressive resizing over 3 epochs of 7 steps: 24 px (the first two epochs), then 32 px
        assert [(s["train_size"], s["run_steps"]) for s in step["per_size"]] == [(24, 14), (32, 7)]
        assert row["summary"]["steps"] == 21
        assert all(len(s["block_seconds"]) == 2 for s in step["per_size"])
        assert "busy" in step["per_size"][-1] and step["model_seconds_for_the_run"] > 0
        assert step["run_cache_reused"] and step["runtime"]["precision"] == row["summary"]["precision"]


@pytest.mark.parametrize("mode, args, says", [
    ("pipelines", ["--batch", "0"], "--batch 0: must be 1 or more"),
    ("pipelines", ["--set", "model.nope=1"], "unknown recipe field 'model.nope'"),
    ("pipelines", ["--classes", "1"], "--classes 1: a classifier needs at least 2"),
    ("pipelines", ["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("runs", ["--recipes", "imagenette,imagenete"], "did you mean 'imagenette'"),
    ("runs", ["--runs", "0"], "--runs 0: must be 1 or more"),
])
def test_throughput_refuses_a_bad_argument_in_one_line_writing_nothing(tmp_path, mode, args, says):
    out = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), mode, "--device", "cpu", *args,
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_throughput_never_overwrites_a_record(tmp_path):
    out = tmp_path / "record.json"
    out.write_text("{}")
    for mode in ("pipelines", "runs"):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), mode, "--device", "cpu",
                               "--out", str(out)],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 2 and "already exists" in proc.stderr and out.read_text() == "{}", proc.stderr


# ------------------------------------------------------------------------------------------
# peers.py: the plain loop, Lightning and speedrun, each in its own process, tiny on the CPU
# ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_peers_trains_each_peer_in_its_own_process_and_records_each(tmp_path, cifar10):
    """One round of the three peers on a 2,048-image slice given as an .npz (narrow widths, batch
    256, 2 epochs: 16 steps): every peer's figures, the medians the results page reads; every peer
    learned (chance is 10%: above it by three standard errors on the 1,000 test images)."""
    from small_data import subset_npz
    out, data = tmp_path / "peers.json", tmp_path / "cifar10-slice.npz"
    subset_npz(cifar10, data, 2048, 1000)
    proc = script("peers.py", "--epochs", 2, "--rounds", 1, "--data-dir", data, "--set", "model.widths=[16,32,32]",
                  "--set", "data.batch_size=256", "--set", "runtime.compile=off", "--peak-sizes", "256,512", "--out", out, timeout=900)
    record = json.loads(out.read_text())
    check_environment(record)
    assert record["data"] == str(data) and record["order"] == ["plain", "lightning", "speedrun"]
    assert "definitions" in record
    chance = 0.1 + 3 * (0.1 * 0.9 / 1000) ** 0.5
    assert set(record["peers"]) == {"plain", "lightning", "speedrun"} and set(record["ratios_to_speedrun"]) == {
        "plain", "lightning"} and "rounds" not in record                  # (several rounds: each kept, medians)
    for name, p in record["peers"].items():
        assert p["steps"] == 16 and p["images_trained"] == 16 * 256 and len(p["epoch_seconds"]) == 2, name
        assert p["process_seconds"] > p["train_seconds"] > p["final_eval_seconds"] > 0, name
        assert p["test_acc"] > chance, (name, p["test_acc"])          # learned
    plain = record["peers"]["plain"]
    assert plain["precision"] == record["precision"] and plain["algorithm"]["total_steps"] == 16
    assert 0 < plain["seconds_before_training"] < plain["process_seconds"]
    assert record["peers"]["speedrun"]["command"].split()[1:5] == ["-m", "speedrun", "train", "cifar10-94"]
    assert record["peers"]["speedrun"]["summary"]["total_flops"] > 0
    flops, rechecked = record["flops"], record["precision"] == "fp32" or record["bf16_units"]
    assert set(flops["achieved_flops_per_s_by_peer"]) == {"plain", "lightning", "speedrun"}
    assert flops["speedrun_training_utilisation"] > 0
    assert set(flops["peak_recheck_flops_per_s_by_size"]) == ({"256", "512"} if rechecked else set())  # (emulated bf16: none)
    assert all(v > 0 for v in flops["peak_recheck_flops_per_s_by_size"].values())
    assert "peers: speedrun: test_acc" in proc.stdout
    page = results_page_of(out, tmp_path)                   # (docs/results.md reads it into its table)
    assert "## Other records" not in page and "`peers.json`" in page.split("## speedrun beside the plain loop", 1)[1]


# same_weights.py: training from two trees, weights compared bit for bit
@pytest.mark.slow
def test_same_weights_finds_two_trees_equal_and_names_what_differs(tmp_path, fashion_small):
    import shutil
    same, changed = tmp_path / "same", tmp_path / "changed"
    shutil.copytree(ROOT / "src", same / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(same, changed)
    recipe = changed / "src" / "speedrun" / "recipes" / "fashion-mnist.toml"      # a real change of the training
    text = recipe.read_text()
    assert "label_smoothing = 0.2" in text
    recipe.write_text(text.replace("label_smoothing = 0.2", "label_smoothing = 0.05"))
    tiny = ["--", "--set", "data.dataset=npz", "--set", "train.epochs=3", "--set", "data.batch_size=128",
            "--set", "runtime.compile=off",
            "--set", "eval.tta=none"]
    out, kept = tmp_path / "same.json", tmp_path / "kept"
    script("same_weights.py", same, "abc1234", "fashion-mnist", "--data-dir", fashion_small,
           "--setting", "eager:runtime.compile=off", "--out", out, "--keep", kept, *tiny)
    record = json.loads(out.read_text())
    s = record["settings"][0]
    assert s["identical"] and s["same_test_acc"] and not s["differing_tensors"]
    assert s["runs"]["base"]["test_acc"] > 0.3 and record["base_commit"] == "abc1234"
    # the changed tree against this checkout's run of the call above (kept: the same training, not made again)
    changed_call = [sys.executable, str(ROOT / "benchmarks" / "same_weights.py"), str(changed), "def5678",
                    "fashion-mnist", "--data-dir", str(fashion_small), "--setting", "eager:runtime.compile=off",
                    "--this-from", str(kept)]
    out2 = tmp_path / "changed.json"
    proc = subprocess.run([*changed_call, "--out", str(out2), *tiny], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    s2 = json.loads(out2.read_text())["settings"][0]
    assert not s2["identical"] and s2["differing_tensors"]
    assert s2["runs"]["this"]["reused_from"] == str(kept / "eager-this")
    assert s2["runs"]["this"]["test_acc"] == s["runs"]["this"]["test_acc"]
    # a kept run made with other arguments is refused before anything trains
    out3 = tmp_path / "other.json"
    proc = subprocess.run([*changed_call, "--out", str(out3), *tiny[:-2]], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 1 and "was made otherwise" in proc.stderr and "== eager: base" not in proc.stdout
    assert not out3.exists()


@pytest.mark.slow
def test_accuracy_sweep_runs_variants_over_seeds_side_by_side_and_tests_each_mean(tmp_path, fashion_small):
    tiny = ["--", "--set", "data.dataset=npz", "--set", "train.epochs=1", "--set", "data.batch_size=128",
            "--set", "runtime.compile=off", "--set", "eval.tta=none", "--device", "cpu"]
    out, runs = tmp_path / "sweep.json", tmp_path / "runs"
    script("accuracy_sweep.py", "--variant", "base=fashion-mnist", "--variant",
           "nols=fashion-mnist@train.label_smoothing=0.0", "--seeds", "2", "--seeds-of", "nols=1", "--jobs", "2",
           "--target", "0.3", "--data-dir", fashion_small, "--runs-dir", runs, "--out", out, *tiny)
    record = json.loads(out.read_text())
    check_environment(record)
    assert [(r["variant"], r["seed"], r["status"]) for r in record["runs"]] == [
        ("base", 0, "done"), ("base", 1, "done"), ("nols", 0, "done")]
    base, nols = record["summary"]["base"], record["summary"]["nols"]
    assert base["n"] == 2 and nols["n"] == 1 and base["mean"] > 0.3               # learned (chance: 0.1)
    assert base["p_value_mean_at_least_target"] < 1 and "against" not in nols   # (one run: no test)
    assert {r["summary"]["seed"] for r in record["runs"]} == {0, 1}
    assert (runs / "nols-seed0" / "summary.json").is_file() and (runs / "base-seed1.log").is_file()
    # a budget spent before the runs end: the running jobs are cut, the rest never start, exit 1
    cut = tmp_path / "cut.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accuracy_sweep.py"), "--variant",
                           "base=fashion-mnist", "--seeds", "3", "--jobs", "1", "--budget", "1", "--data-dir",
                           str(fashion_small), "--out", str(cut), *tiny], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = json.loads(cut.read_text())["summary"]["base"]
    assert summary["runs_not_done"] == 1 and summary["runs_not_started"] == 2 and summary["n"] == 0
    # a bad variant or a bad recipe value is refused in one line before anything runs or is written
    for bad, says in ((["--variant", "base"], "NAME=RECIPE"), (["--variant", "a=fashion-mnist@optim.lr=-1"], "optim.lr")):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accuracy_sweep.py"), *bad, "--out",
                               str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "bad.json").exists()


def test_busy_fraction_counts_each_kernel_once_and_only_inside_the_window():
    """The GPU-busy fraction of the throughput records, from kernel intervals (the part the CPU
    can check: on a CPU the intervals are this process's ops)."""
    import math
    from speedrun.profiling.busy import busy_fraction, covered
    assert covered([(0, 2), (1, 3), (5, 6)]) == 4            # (0, 3) and (5, 6)
    assert covered([(0, 10), (2, 3), (4, 5)]) == 10          # nested kernels on other streams
    assert covered([]) == 0
    assert busy_fraction([(0, 2), (1, 3), (5, 6)], (0, 10)) == pytest.approx(0.4)
    assert busy_fraction([(-5, 1), (9, 20)], (0, 10)) == pytest.approx(0.2)   # clipped to the window
    assert math.isnan(busy_fraction([(0, 1)], (3, 3)))


def test_a_record_names_the_commit_given_else_the_environments_else_gits(monkeypatch):
    """What every benchmark record names: the commit from --commit, else $SPEEDRUN_COMMIT (a GPU
    machine without .git), else the checkout's HEAD with its dirty flag; the CPU's family."""
    from speedrun.report.environment import machine, read_commit
    monkeypatch.setenv("SPEEDRUN_COMMIT", "abc1234")
    assert read_commit("def5678") == ("def5678", "--commit")
    assert read_commit() == ("abc1234", "$SPEEDRUN_COMMIT")
    env = machine()
    assert (env["git_commit"], env["git_dirty"], env["commit_source"]) == ("abc1234", None, "$SPEEDRUN_COMMIT")
    assert env["cpu_model"] and env["cpu_family_model"] and {"triton_version", "cudnn_version"} <= set(env)
    monkeypatch.delenv("SPEEDRUN_COMMIT")
    if head_commit():
        assert read_commit() == (head_commit(), "git rev-parse HEAD")
        env = machine()
        assert env["git_commit"] == head_commit() and isinstance(env["git_dirty"], bool)


def test_margins_runs_matrix_entries_over_seeds_both_ways_and_keeps_the_lowest(tmp_path):
    """benchmarks/margins.py on one entry of the recipe matrix, one seed, bf16 as this CPU computes
    it and emulated: the entry's own data built, both runs recorded with their bar and margin (in
    test images), and per way the lowest; an entry that is not in the matrix is refused."""
    entry = "fashion-mnist-fashion_small-fp32-eager"
    out = tmp_path / "margins.json"
    script("margins.py", "--entries", entry, "--seeds", "1", "--ways", "native,emulated", "--jobs", "2",
           "--work", tmp_path / "work", "--out", out)
    record = json.loads(out.read_text())
    check_environment(record)
    runs = record["runs"]
    assert [(r["entry"], r["seed"], r["way"]) for r in runs] == [(entry, 0, "native"), (entry, 0, "emulated")]
    for r in runs:
        assert r["bar"] == pytest.approx(0.1 + 3 * (0.09 / 256) ** 0.5, abs=1e-4) and r["test_images"] == 256
        assert r["margin_images"] == pytest.approx((min(r["test_acc"], r["test_acc_no_tta"]) - r["bar"]) * 256, abs=0.2)
        assert r["margin_images"] > 0                                     # it learned
    assert record["lowest"][f"{entry} / emulated"]["lowest_seed"] == 0
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "margins.py"), "--entries", "no-such-entry",
                           "--out", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "no-such-entry" in proc.stderr and not (tmp_path / "bad.json").exists()


# ------------------------------------------------------------------------------------------
# eval_chunk.py: an evaluation batch whole and in eval.chunk calls
# ------------------------------------------------------------------------------------------

def test_eval_chunk_times_a_batch_whole_and_in_calls_with_the_same_logits(tmp_path):
    """Two recipes' batches of 40 random images in calls of 16 (3 calls of each view): every round
    of both ways timed, the logits of the two ways the same (to float rounding), the record
    naming the machine; a record is never overwritten and a bad argument is one line."""
    out = tmp_path / "record.json"
    proc = script("eval_chunk.py", "--recipes", "fashion-mnist,cifar10-94", "--images", "40", "--chunk", "16",
                  "--rounds", "2", "--threads", "1", "--out", out)
    record = json.loads(out.read_text())
    check_environment(record)
    assert record["threads"] == 1 and record["precision"] == "fp32"
    fashion, cifar = record["recipes"]
    assert (fashion["recipe"], fashion["channels"], fashion["image_size"]) == ("fashion-mnist", 1, [28, 28])
    assert (cifar["recipe"], cifar["channels"], cifar["image_size"]) == ("cifar10-94", 3, [32, 32])
    for r in record["recipes"]:
        assert r["images"] == 40 and r["chunk"] == 16 and r["calls_per_view"] == 3
        assert all(len(s) == 2 and min(s) > 0 for s in r["seconds"].values())
        assert r["chunked_over_whole"] == r["median_seconds"]["chunked"] / r["median_seconds"]["whole"]
        assert r["max_abs_logit_difference"] < 1e-3
        assert f"{r['recipe']}: 40 images" in proc.stdout
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eval_chunk.py"), "--out", str(out)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert refused.returncode != 0 and "exists" in refused.stderr and json.loads(out.read_text()) == record
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eval_chunk.py"), "--recipes", "cifar10-95",
                          "--out", str(tmp_path / "other.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode != 0 and "cifar10-95" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "other.json").exists()


def test_finetune_peers_times_each_report_and_leaves_out_the_peers_it_cannot_run(tmp_path, jpeg32, teacher_run):
    """benchmarks/finetune_peers.py at a tiny size with speedrun alone: the matrix's teacher run (a speed
    net trained on 1,024 CIFAR-10 images) fine-tuned for 2 epochs on the 512-image JPEG folder, each
    epoch's val/ accuracy timed as its line arrives; fastai asked of an interpreter without it and
    timm's train.py not given, so both are left out, saying why. The target defaults to the highest
    accuracy every run reached. A run past --timeout is killed."""
    out = tmp_path / "peers.json"
    script("finetune_peers.py", "--folder", f"cifar={jpeg32}", "--weights", f"speednet={teacher_run}",
           "--seeds", 1, "--epochs", 2, "--image-size", 32, "--batch-size", 64, "--speedrun-set", "eval.tta=none",
           "--speedrun-set", "data.workers=1", "--fastai-python", sys.executable, "--work", tmp_path / "work",
           "--out", out, timeout=600)
    record = json.loads(out.read_text())
    check_environment(record)
    assert record["systems"] == ["speedrun"] and record["fastai_version"] is None
    assert record["left_out"] == {"fastai": f"{sys.executable} cannot import fastai (pip install fastai into it)",
                                  "fastai-lr-find": f"{sys.executable} cannot import fastai (pip install fastai into it)",
                                  "timm": "no --timm-python given"}
    (run,) = record["runs"]
    assert run["rc"] == 0 and run["command"][1:5] == ["-m", "speedrun", "train", "folder"]
    times = [r["seconds"] for r in run["reports"]]
    assert len(times) == 2 and 0 < times[0] < times[1] < run["wall_seconds"]
    summary = json.loads((tmp_path / "work" / "cifar-speednet-speedrun-seed0" / "summary.json").read_text())
    assert run["reports"][-1]["accuracy"] == pytest.approx(summary["test_acc_no_tta"], abs=1e-4)
    split = run["speedrun_summary"]                             # the run's own split of its time, kept
    assert split["start_up_seconds"] == summary["start_up_seconds"] and 0 < split["start_up_seconds"] < times[0]
    assert split["epochs"] == 2 and split["train_seconds"] > 0
    best = max(r["accuracy"] for r in run["reports"])
    assert best > 0.2                                           # learned (chance: 0.1; 512 val images)
    row = record["results"]["cifar/speednet"]
    assert row["target"] == best and row["ratio_to_faster_peer"] is None
    first = next(r["seconds"] for r in run["reports"] if r["accuracy"] >= best)
    assert row["systems"]["speedrun"]["seconds_to_target"] == [first]
    # a run past --timeout is killed, printing or not (here still importing), and kept in the record as such
    cut = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "finetune_peers.py"), "--folder", f"cifar={jpeg32}",
                          "--weights", f"speednet={teacher_run}", "--seeds", "1", "--epochs", "2", "--timeout", "1",
                          "--systems", "speedrun", "--work", str(tmp_path / "cut"), "--out", str(tmp_path / "cut.json")],
                         capture_output=True, text=True, timeout=600)
    assert cut.returncode == 1, cut.stderr
    (run,) = json.loads((tmp_path / "cut.json").read_text())["runs"]
    assert run["timed_out"] and run["rc"] == -9 and run["reports"] == [] and run["wall_seconds"] >= 1
    # a folder without val/ is refused before any run, writing nothing
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "finetune_peers.py"), "--folder", f"x={tmp_path}",
                          "--weights", f"speednet={teacher_run}", "--work", tmp_path / "w2", "--out", tmp_path / "x.json"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "needs train/ and val/" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "w2").exists()


def test_suite_cost_runs_a_selection_forked_and_fresh_and_times_each_test(tmp_path):
    """A one-test selection (the fork server's own check of which environments fork) both ways:
    each mode's exit code, whole-call and per-test figures, and the ratio; a bad --modes or an
    existing record is refused in one line, writing nothing."""
    out = tmp_path / "cost.json"
    selection = "tests/test_forked.py::test_a_run_whose_environment_could_change_the_imports_gets_a_fresh_interpreter"
    script("suite_cost.py", "--out", out, "--workers", "1", "--", selection, f"--basetemp={tmp_path / 'inner'}", timeout=600)
    record = json.loads(out.read_text())
    check_environment(record)
    assert [m["mode"] for m in record["modes"]] == ["forked", "fresh"] and record["workers"] == 1
    for mode in record["modes"]:
        assert mode["pytest_exit_code"] == 0 and mode["tests"] == 1 and "-p suite_cost_plugin" in mode["command"]
        (row,) = mode["runs"]
        assert row["test"] == selection and 0 < row["cpu_seconds"] and 0 < row["wall_seconds"] < mode["wall_seconds"]
        assert mode["cpu_seconds"] > row["cpu_seconds"] and list(mode["cpu_seconds_by_file"]) == ["tests/test_forked.py"]
    assert record["fresh_over_forked_cpu"] == record["modes"][1]["cpu_seconds"] / record["modes"][0]["cpu_seconds"]
    for bad, says in ((["--modes", "forked,slow"], "each must be forked or fresh"), (["--workers", "0"], "1 or more"),
                      ([], "already exists")):
        target = out if not bad else tmp_path / "never.json"
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite_cost.py"), "--out", str(target), *bad,
                               "--", selection], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "never.json").exists() and json.loads(out.read_text()) == record


def test_finetune_peers_works_a_records_results_out_again_with_one_sided_tests(tmp_path):
    """--from-record on the committed Zen 3 record (3 seeds of speedrun, timm's train.py and fastai):
    the same target and ratio as the record, and Welch's one-sided tests of speedrun's times against
    the faster peer's and half of them, as scipy works them out from the runs; a file that is no
    such record is refused in one line, writing nothing."""
    from scipy import stats
    old_path = ROOT / "benchmarks" / "results" / "finetune-peers-cifar5-resnet18-amd-epyc-25-1-daaa791.json"
    old = json.loads(old_path.read_text())
    out = tmp_path / "again.json"
    script("finetune_peers.py", "--from-record", old_path, "--out", out)
    new = json.loads(out.read_text())
    (key,) = new["results"]
    row, was = new["results"][key], old["results"][key]
    assert row["target"] == was["target"] and row["ratio_to_faster_peer"] == pytest.approx(was["ratio_to_faster_peer"])
    assert new["runs"] == old["runs"] and new["summarised_from"] == str(old_path)
    tests = row["one_sided_tests"]
    mine, timm = row["systems"]["speedrun"]["seconds_to_target"], row["systems"]["timm"]["seconds_to_target"]
    assert tests["faster_peer"] == "timm" and tests["runs"] == [3, 3]
    for label, factor in (("below_peer", 1.0), ("below_0.5_of_peer", 0.5)):
        want = stats.ttest_ind(mine, [factor * t for t in timm], equal_var=False, alternative="less").pvalue
        assert tests[label]["p"] == pytest.approx(want)
    assert tests["below_peer"]["p"] < 0.05 < tests["below_0.5_of_peer"]["p"]       # faster, not yet twice as fast
    # the accuracy each run reached in speedrun's time: by the mean of speedrun's runs' last reports (181.3 s
    # of 173.1-192.0), speedrun's fourth epoch in seed 0 and its last in the others, timm's third epochs
    # and fastai's third
    budget = row["speedrun_mean_seconds_to_last_report"]
    assert budget == pytest.approx(sum(r["reports"][-1]["seconds"] for r in old["runs"] if r["system"] == "speedrun") / 3)
    got = {s: v["accuracy_by_speedruns_time"] for s, v in row["systems"].items()}
    assert got["speedrun"] == [0.8128, 0.8372, 0.8224]
    assert got["timm"] == pytest.approx([0.7626, 0.8034, 0.7924]) and got["fastai"] == pytest.approx([0.721, 0.725, 0.7246])
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "finetune_peers.py"), "--from-record",
                          str(ROOT / "README.md"), "--out", str(tmp_path / "x.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a finetune_peers record" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.json").exists()
