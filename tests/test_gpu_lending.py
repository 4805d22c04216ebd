"""The two calls of a lent GPU (benchmarks/lending/) and gpu_record.py's budget, dry-run on the CPU at
tiny sizes: call 1 warms a stand-in of airbench94_muon.py (which checks the data it is given, as that
script reads it) and every speedrun variant of call 2 on random data, side by side, into the cache
folder call 2 reads; call 2 runs the sweep one system after another on the real data; a system
whose limit no longer fits starts with what is left, or is left out; a plan that cannot end
inside its call is refused in one line."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LENDING = ROOT / "benchmarks" / "lending"
CALL_1, CALL_2 = LENDING / "call1-warm-up.args", LENDING / "call2-record-sweep.args"
TINY = ["--set", "model.widths=[8,16,16]", "--set", "model.whiten.samples=64", "--set", "eval.batch_size=128",
        "--set", "data.batch_size=768", "--set", "train.epochs=1"]
"""speedrun at tiny sizes (each variant's own overrides still apply: 8.2 epochs of two 768-image steps)."""

STANDIN = '''"""A stand-in for airbench94_muon.py on a CPU: it reads cifar10/train.pt and test.pt from its working
folder as that script does, checks what it reads (the keys, dtypes, layout and counts that script
relies on), leaves a file in the compile cache as a compile would, and reports each run through
print_training_details with its own timer."""
import os
import sys
import time

import torch

with open(sys.argv[0]) as f:
    code = f.read()

logging_columns_list = ["run   ", "epoch", "train_acc", "val_acc", "tta_val_acc", "time_seconds"]


def print_columns(columns_list, is_head=False, is_final_entry=False):
    print("|".join(str(c) for c in columns_list))


def print_training_details(variables, is_final_entry):
    print_columns([variables.get(c.strip(), "") for c in logging_columns_list], is_final_entry=is_final_entry)


def load(split):
    data = torch.load(os.path.join("cifar10", split + ".pt"), weights_only=True)
    images, labels, n = data["images"], data["labels"], int(os.environ["STANDIN_N_" + split.upper()])
    assert set(data) == {"images", "labels", "classes"} and len(data["classes"]) == 10, sorted(data)
    assert images.dtype == torch.uint8 and images.shape == (n, 32, 32, 3), (images.dtype, images.shape)
    assert labels.dtype == torch.int64 and labels.shape == (n,) and 0 <= labels.min() <= labels.max() <= 9
    return (images[:256].float() / 255).permute(0, 3, 1, 2).flatten(1), labels[:256]


def main(run, model):
    x, y = load("train")
    xt, yt = load("test")
    t = time.perf_counter()
    time.sleep(float(os.environ.get("STANDIN_RUN_SECONDS", "0")))
    with torch.no_grad():
        tta_val_acc = (model(xt).argmax(1) == yt).float().mean().item()
    time_seconds = time.perf_counter() - t
    epoch = "eval"
    print_training_details(locals(), is_final_entry=True)
    return tta_val_acc


if __name__ == "__main__":
    model = torch.nn.Linear(3 * 32 * 32, 10)
    if torch.cuda.is_available():
        model.compile(mode="max-autotune")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        open(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "standin-%d" % os.getpid()), "w").close()
    print_columns(logging_columns_list, is_head=True)
    main("warmup", model)
    accs = torch.tensor([main(run, model) for run in range(200)])
'''


def standin(path: Path, setup: str = "") -> Path:
    """The stand-in at ``path``, with ``setup`` added to its __main__ block's set-up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STANDIN.replace("    print_columns(logging_columns_list, is_head=True)\n",
                                    setup + "    print_columns(logging_columns_list, is_head=True)\n"))
    return path


def record_call(args: list, cwd: Path, out: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    """gpu_record.py as a lent GPU runs it: from ``cwd`` (where .device-data/ is), $OUT set, no --out."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_record.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "OUT": str(out), **env})


def lines(path: Path, option: str) -> list[str]:
    return [line.split(None, 1)[1] for line in path.read_text().splitlines() if line.startswith(option + " ")]


def test_call_1_warms_exactly_what_call_2_runs_in_the_folder_call_2_reads_and_both_fit_their_calls(monkeypatch):
    """Read from the two files (nothing runs): the same --cache-dir; call 1's variants are call 2's
    speedrun systems, override for override; each budget with the set-up, the last stop and the
    writing ends inside its call's timeout_s; the lending's 900 s hold both calls and a slow start."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_record
    one, two = (gpu_record.parse([f"@{f}"]) for f in (CALL_1, CALL_2))
    assert one.cache_dir == two.cache_dir == Path("/root/compile-cache")
    warmed = {gpu_record.split_limit(v, None, "")[0].partition(":")[2] for v in one.variant}
    swept = {gpu_record.split_limit(s, None, "")[0].partition(":")[2].partition("@")[2] for s in two.system
             if s.startswith("speedrun:")}
    assert warmed == swept and len(swept) == 8 and "" in swept            # ("": the record recipe as shipped)
    recipes = {s.split("#")[0].split("@")[0] for s in two.system if s.startswith("speedrun:")}
    assert one.recipe == "cifar10-94-gpu" and recipes == {"speedrun:cifar10-94-gpu"}
    peer = "peer:.device-data/peers/airbench94_muon.py"
    assert [s.split("#")[0] for s in one.system] == [peer] and two.system[0].split("#")[0] == peer
    rest = gpu_record.KILL_GRACE_SECONDS + gpu_record.WRITE_SECONDS
    for args in (one, two):
        assert args.budget + args.setup_seconds + rest <= args.call_timeout
    assert two.runs >= 10 and one.runs == 1 and one.jobs > 1 and two.jobs == 1
    assert 80 + one.call_timeout + 30 + two.call_timeout + 10 <= 900   # (a slow start, the gap, the give-back)


@pytest.mark.slow
def test_lending_calls_1_and_2_dry_run_on_a_cpu_sharing_one_compile_cache(tmp_path, data_dir, cifar10):
    """Both files as the lending runs them, from a folder holding .device-data/peers/, at tiny sizes:
    call 1 writes random data of the real shapes for the peer and warms it and the 8 variants side by
    side; call 2 runs the peer and the 8 speedrun systems on the real data, paired by seed. The files'
    limits are an H200's; here every time of the plan is multiplied by --time-scale K, ten times the
    seconds this machine takes to start a process that imports torch (at least 10), so that no limit
    or budget decides anything on a slow or busy CPU: what is asserted is what the files run and
    where they keep it (the budget's decisions are the test above's)."""
    from small_data import subset_npz
    standin(tmp_path / ".device-data" / "peers" / "airbench94_muon.py")
    cache, npz = tmp_path / "cache", tmp_path / "cifar-1536.npz"
    subset_npz(cifar10, npz, 1536, 256)                     # (batch 1536, one of the variants, needs as many)
    k = 10 * max(1.0, start_up_unit())
    mine = ["--device", "cpu", "--cache-dir", cache, "--commit", "abc1234", "--time-scale", k, *TINY]

    out1 = tmp_path / "out1"
    proc = record_call([f"@{CALL_1}", "--n-train", 1536, "--n-test", 256, *mine], tmp_path, out1,
                       {"STANDIN_N_TRAIN": "1536", "STANDIN_N_TEST": "256"}, timeout=int(300 * k))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out1.iterdir()) == ["gpu-record-synthetic.json"]
    one = json.loads((out1 / "gpu-record-synthetic.json").read_text())
    assert one["jobs"] == 5 and one["compile_cache_dir"] == str(cache) and not one["left_out"]
    assert one["time_scale"] == k and not any(e.get("cut") for e in one["peers"] + one["variants"])
    assert one["budget_seconds"] == pytest.approx(275 * k) and one["call_timeout_seconds"] == pytest.approx(300 * k)
    (peer,) = one["peers"]
    assert peer["ok"] and peer["kind"] == "peer" and len(peer["runs"]) == 1 and peer["warmup_seconds"] > 0
    assert peer["inductor_cache"]["dir"] == str(cache) and peer["compile_cache"]["files_after"] >= 1
    assert one["order"][0] == "airbench94_muon.py" and [v["variant"] for v in one["variants"]] == one["order"][1:]
    for v in one["variants"]:
        assert v["ok"] and len(v["runs"]) == 1 and v["inductor_cache"]["dir"] == str(cache)
        assert v["compile_cache"]["dir"] == str(cache) and "shortened" not in v
    by_name = {v["variant"]: v for v in one["variants"]}
    assert by_name["batch-1536"]["recipe_config"]["data"]["batch_size"] == 1536
    assert by_name["epochs-8.2"]["runs"][0]["steps"] == 17 and by_name["record"]["runs"][0]["steps"] == 2  # (1 epoch)

    out2 = tmp_path / "out2"
    proc = record_call([f"@{CALL_2}", "--runs", 1, "--data-dir", data_dir, "--set", "data.dataset=npz",
                        "--set", f"data.path='{npz}'", "--work", tmp_path / "work", *mine], tmp_path, out2,
                       {"STANDIN_N_TRAIN": "50000", "STANDIN_N_TEST": "10000"}, timeout=int(480 * k))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = json.loads((out2 / "gpu-record.json").read_text())
    assert two["compile_cache_dir"] == str(cache) and two["budget_seconds"] == pytest.approx(450 * k)
    assert not two["left_out"]
    given = [s.rsplit("#", 1)[0] for s in lines(CALL_2, "--system")]
    assert [e["spec"] for e in two["systems"]] == given and len(given) == 9
    peer, systems = two["systems"][0], {e["system"]: e for e in two["systems"]}
    assert peer["kind"] == "peer" and peer["compile_cache"]["files_before"] >= 1      # (what call 1 left)
    # the peer ran as its __main__ block does: its model built there, warmed up by its own call, its timer read
    assert peer["main_block"]["args"] == ["model"] and peer["main_block"]["warmup_in_script"]
    assert all(r["timer"] == "time_seconds" and r["wall_seconds"] > r["seconds"] for r in peer["runs"])
    assert two["commit"] == "abc1234" and two["order"][0] == "airbench94_muon.py"
    for e in two["systems"]:
        assert e["ok"] and len(e["runs"]) == 1 and e["limit_from"] == "its limit" and e["warmup_seconds"] > 0
        assert e["compile_cache"]["dir"] == str(cache) and e["summary"]["recompiles"] == 0
    assert len(two["pairs"]) == len(lines(CALL_2, "--pair")) == 9
    paired = [p for p in two["pairs"] if p["b"] == "cifar10-94-gpu"]
    assert len(paired) == 7 and all(p["paired"]["seeds"] == [0] for p in paired)     # (each variant, seed by seed)
    first = two["pairs"][0]
    assert (first["a"], first["b"]) == ("cifar10-94-gpu", "airbench94_muon.py")
    assert first["time_ratio"] == pytest.approx(systems["cifar10-94-gpu"]["summary"]["seconds"]["mean"]
                                                / peer["summary"]["seconds"]["mean"])
    # the data the peers read is CIFAR-10's own, in its order, as airbench94_muon.py's loader reads it
    import torch
    for split, x, y in (("train", cifar10.train_x, cifar10.train_y), ("test", cifar10.test_x, cifar10.test_y)):
        data = torch.load(tmp_path / "work" / "airbench" / "cifar10" / f"{split}.pt", weights_only=True)
        assert data["classes"] == cifar10.classes
        assert torch.equal(data["images"].permute(0, 3, 1, 2), x) and torch.equal(data["labels"], y)


def start_up_unit() -> float:
    """Seconds a fresh interpreter takes to import torch here and now (what each system's process
    does first): the unit the budget test's times are scaled by, so that its decisions are the same
    on a slow or busy machine as on a fast one."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=600)
    return time.perf_counter() - t0


def test_a_system_whose_limit_no_longer_fits_starts_with_what_is_left_or_not_at_all(tmp_path):
    """Three systems under a 19 s budget, the stand-in sleeping 0.5 s a run, 1000 runs asked: the
    first is stopped at its own 9 s limit (its whole process group, a helper too), its runs kept;
    the second's 60 s limit no longer fits, but what is left (about 9 s) is above its least (4 s),
    so it starts with that, says so, and is stopped at the budget's end with its runs kept; the
    third's least (30 s) is more than what is left: not started. Every time (limits, budget, the stand-in's sleep)
    is multiplied by --time-scale K, K the seconds this machine takes to start a process that
    imports torch (at least 1): a process starts in at most 1/8 of the first's limit however slow
    the machine, so the same decisions are asserted everywhere."""
    pidfile = tmp_path / "helper.pid"
    helper = ("    import subprocess\n    helper = subprocess.Popen(['sleep', '300'])\n"
              f"    open({str(pidfile)!r}, 'w').write(str(helper.pid))\n")
    first = standin(tmp_path / "peers" / "first.py", helper)
    second = standin(tmp_path / "peers" / "second.py")
    k = max(1.0, start_up_unit())
    out, t0 = tmp_path / "out", time.perf_counter()
    proc = record_call(["--synthetic", "--recipe", "cifar10-94-gpu", "--n-train", 256, "--n-test", 64,
                        "--runs", 1000, "--budget", 19, "--device", "cpu", "--set", "data.batch_size=64",
                        "--system", f"peer:{first}#9", "--system", f"peer:{second}#60/4", "--variant", "base#60/30",
                        "--time-scale", k],
                       tmp_path, out, {"STANDIN_N_TRAIN": "256", "STANDIN_N_TEST": "64",
                                       "STANDIN_RUN_SECONDS": str(0.5 * k)})
    took = time.perf_counter() - t0
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "gpu-record-synthetic.json").read_text())
    a, b = record["peers"]
    assert (a["system"], b["system"]) == ("first.py", "second.py") and record["variants"] == []
    assert record["time_scale"] == k and record["budget_seconds"] == pytest.approx(19 * k)
    assert a["cut"]["by"] == "its limit" and a["cut"]["at_seconds"] == pytest.approx(9 * k) and "shortened" not in a
    assert b["limit_from"] == "the budget" and b["cut"]["by"] == "the budget" and b["limit_seconds"] < 60 * k
    assert b["shortened"]["limit_seconds"] == pytest.approx(60 * k)
    assert b["shortened"]["least_seconds"] == pytest.approx(4 * k)
    assert 4 * k <= b["shortened"]["given_seconds"] == b["limit_seconds"] < (19 - 9) * k
    for e in (a, b):
        assert not e["ok"] and 1 <= e["cut"]["runs_finished"] == len(e["runs"]) < 1000
        assert e["process_wall_seconds"] < e["limit_seconds"] + 5
    (left,) = record["left_out"]
    assert left["name"] == "base" and f"under the {30 * k:.0f} s it may least start with" in left["reason"]
    assert f"shortened from its limit of {60 * k:.0f} s" in proc.stdout and took < (19 + 15) * k
    stat = Path(f"/proc/{int(pidfile.read_text())}/stat")          # the helper went with its group
    for _ in range(50):                                 # (gone, or a zombie its new parent has not reaped)
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"{stat}: the peer's helper process outlived its group's stop")


@pytest.mark.parametrize("args, says", [
    (["--budget", 460, "--call-timeout", 480], "the plan cannot end inside the call: --budget 460 s + 15 s before "
                                               "this script (--setup-seconds) + 5 s to stop the last system + 5 s to "
                                               "write the record = 485 s, more than --call-timeout 480 s; lower "
                                               "--budget to 455"),
    (["--call-timeout", 20], "--call-timeout 20 s leaves no budget"),
    (["--system", "speedrun:cifar10-94-gpu#60/90"], "at most SECONDS"),
    (["--jobs", 3], "--jobs belongs to --synthetic"),
    (["--time-scale", 0], "--time-scale 0: a factor above 0")])
def test_a_plan_that_cannot_fit_its_call_is_refused_in_one_line(tmp_path, args, says):
    """Before torch is imported or anything written: exit code 2, one line naming the figures."""
    out = tmp_path / "record.json"
    given = args if "--system" in args else ["--system", "speedrun:cifar10-94-gpu#60/30", *args]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_record.py"), *map(str, given),
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert re.sub(r"\s+", " ", says) in proc.stderr and not out.exists()
