"""bench / compare / ablate / flops on real data, with tiny recipes so that they run in seconds."""
import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest
from scipy import stats

from speedrun.engine import flops
from speedrun.bench.ablate import TRICKS, epochs_to_target, plan, tricks_of
from speedrun.bench.compare import compare
from speedrun.bench.stats import describe, describe_times, p_mean_at_least, p_value_text, welch
from speedrun.recipe import RecipeError, load_recipe, total_steps
from speedrun.report.bench_record import P_VALUE_LABEL

from conftest import TINY_BENCH
from test_cli import speedrun



# ---------------------------------------------------------------------------- statistics
def test_describe_matches_scipy_on_fixed_samples():
    x = [0.9401, 0.9388, 0.9415, 0.9397, 0.9409, 0.9392]
    d = describe(x)
    assert d["mean"] == pytest.approx(np.mean(x)) and d["std"] == pytest.approx(np.std(x, ddof=1))
    lo, hi = stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=stats.sem(x))
    assert d["ci95"] == pytest.approx([lo, hi])
    # hand value: t(0.975, 5) = 2.5706
    assert (hi - lo) / 2 == pytest.approx(2.5706 * np.std(x, ddof=1) / math.sqrt(6), rel=1e-4)


def test_one_sided_p_value_against_scipy_and_by_hand():
    x = [0.9401, 0.9388, 0.9415, 0.9397, 0.9409, 0.9392]
    p = p_mean_at_least(x, 0.939)
    assert p == pytest.approx(stats.ttest_1samp(x, 0.939, alternative="greater").pvalue)
    t = (np.mean(x) - 0.939) / (np.std(x, ddof=1) / math.sqrt(6))
    assert p == pytest.approx(stats.t.sf(t, 5))
    assert p_mean_at_least(x, 0.935) < 0.001 and p_mean_at_least(x, 0.945) > 0.999


def test_a_time_interval_never_reaches_below_zero_and_the_p_value_is_named_for_what_it_is():
    times = [1.0, 3.0]                       # 2 runs: t(0.975, 1) = 12.7, the t interval reaches -10.7 s
    plain = describe(times)
    assert plain["ci95"][0] == pytest.approx(2 - 12.706 * math.sqrt(2) / math.sqrt(2), abs=1e-2)
    d = describe_times(times)
    assert d["ci95"] == [0.0, pytest.approx(plain["ci95"][1])] and d["mean"] == 2.0
    assert d["ci95_method"] == "Student's t interval for the mean, its lower end cut at 0 (the least possible value)"
    assert describe_times([10.0, 10.2, 10.1])["ci95"] == pytest.approx(describe([10.0, 10.2, 10.1])["ci95"])
    # far below the target the p-value is near 1: no evidence of reaching it (not a 99.8% chance of it)
    p = p_mean_at_least([0.80, 0.81, 0.79], 0.92)
    assert p > 0.99 and p_value_text(p).endswith("(not below 0.05: no evidence that the mean is above the target)")
    assert p_value_text(0.001) == "0.001 (below 0.05: evidence that the mean is above the target)"
    assert "p-value" in P_VALUE_LABEL and "H0: mean ≤ target" in P_VALUE_LABEL


def test_welch_against_scipy():
    a, b = [3.1, 3.3, 3.2, 3.25, 3.15], [2.9, 3.0, 2.95, 3.1, 2.85, 3.05]
    w = welch(a, b)
    ref = stats.ttest_ind(b, a, equal_var=False)
    assert w["t"] == pytest.approx(ref.statistic) and w["p"] == pytest.approx(ref.pvalue)
    assert w["diff"] == pytest.approx(np.mean(b) - np.mean(a))


def test_confidence_interval_covers_the_true_mean_at_the_stated_rate():
    rng = np.random.default_rng(0)
    trials, n, covered = 4000, 8, 0
    for _ in range(trials):
        lo, hi = describe(rng.normal(0.94, 0.0013, n))["ci95"]
        covered += lo <= 0.94 <= hi
    # 95% nominal; binomial sd over 4000 trials is 0.35 points
    assert abs(covered / trials - 0.95) < 0.012


def test_p_value_is_uniform_when_the_mean_sits_at_the_target():
    rng = np.random.default_rng(1)
    ps = [p_mean_at_least(rng.normal(0.94, 0.0013, 10), 0.94) for _ in range(3000)]
    assert abs(np.mean(np.array(ps) < 0.05) - 0.05) < 0.012


# ------------------------------------------------------------------------------------ flops
def _hand_count_cifar10_94():
    """Multiply-accumulates of the cifar10-94 net by hand, per image."""
    h = 31                                                       # 2x2 valid whitening conv
    whiten = h * h * 24 * (3 * 2 * 2)
    convs = (h * h * 24 * 64 * 9 + 15 * 15 * 64 * 64 * 9        # block 1 (31x31, then pooled 15x15)
             + 15 * 15 * 64 * 256 * 9 + 7 * 7 * 256 * 256 * 9    # block 2
             + 7 * 7 * 256 * 256 * 9 + 3 * 3 * 256 * 256 * 9)    # block 3
    linear = 256 * 10
    forward = 2 * (whiten + convs + linear)
    # backward: input and weight gradients for every trainable conv and the linear layer;
    # nothing for the frozen whitening filters (no weight gradient, images need no gradient)
    backward = 2 * 2 * (convs + linear)
    return forward, forward + backward


def test_flop_count_of_cifar10_94_matches_a_hand_count():
    counted = flops.per_image_flops(load_recipe("cifar10-94"), 3, 10, (32, 32))
    forward, train = _hand_count_cifar10_94()
    assert counted["forward"] == pytest.approx(forward, rel=0.02)
    assert counted["train"] == pytest.approx(train, rel=0.02)
    assert 700e6 < counted["train"] < 715e6


@pytest.mark.parametrize("recipe, side", [("cifar10-94", 32), ("cifar10-94-gpu", 24), ("dawnbench-resnet18", 32),
                                           ("imagenet-resnet50", 64)])
def test_flop_counts_are_torchs_flop_counter_totals_and_need_not_import_its_compiler(recipe, side):
    """speedrun's count (a CPU copy of the model, torch's formulas) gives the totals of torch's own
    FlopCounterMode on the meta device, forward and training step, the whitening bias frozen or
    not, leaving the random numbers as they were (an eager run counts without importing torch's
    compiler: test_speed_techniques.py)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from speedrun.models import build_model
    r = load_recipe(recipe)
    for frozen in (False, True):
        with torch.device("meta"):
            model = build_model(r.model, 3, 10)
        if frozen and getattr(model, "whiten", None) is not None:
            model.whiten.requires_grad_(False)
        x, y = torch.empty(2, 3, side, side, device="meta"), torch.zeros(2, dtype=torch.long, device="meta")
        with FlopCounterMode(display=False) as fwd:
            model(x)
        with FlopCounterMode(display=False) as train:
            F.cross_entropy(model(x), y).backward()
        assert flops.count_per_image_flops(r, 3, 10, (side, side), frozen) == {
            "forward": fwd.get_total_flops() / 2, "train": train.get_total_flops() / 2}
    torch.manual_seed(0)
    drawn = torch.rand(1)
    torch.manual_seed(0)
    flops.count_per_image_flops(r, 3, 10, (side, side))
    assert torch.equal(torch.rand(1), drawn), "counting drew from the run's random numbers"


def test_run_flops_and_efficiency():
    r = load_recipe("cifar10-94")
    per = flops.per_image_flops(r, 3, 10, (32, 32))
    total = flops.run_flops(r, 3, 10, (32, 32), [(32, 32)] * 476, 10_000)
    assert total["train_flops"] == pytest.approx(476 * r.data.batch_size * per["train"])
    assert total["eval_flops"] == pytest.approx(6 * 10_000 * per["forward"])     # six TTA views
    eff = flops.efficiency(total["total_flops"], 3.0, "cuda", "NVIDIA H100 80GB HBM3", "bf16")
    assert eff["peak_source"] == "datasheet" and eff["peak_flops_per_s"] == 989.4e12
    assert eff["ideal_seconds"] == pytest.approx(total["total_flops"] / 989.4e12)
    assert eff["utilisation"] == pytest.approx(eff["ideal_seconds"] / 3.0)
    cpu = flops.efficiency(1e12, 10.0, "cpu", "AMD EPYC", "fp32")
    assert cpu["peak_source"] == "measured matmul" and cpu["peak_flops_per_s"] > 1e9


# ------------------------------------------------------------------------------- ablation
ADAMW_LAYER_DECAY = ["optim.name=adamw", "optim.lr=1e-3", "optim.layer_decay=0.75"]


def test_every_trick_turns_off_in_a_valid_recipe():
    for name, sets in (("cifar10-94", []), ("page-resnet9", []), ("fashion-mnist", []), ("dawnbench-resnet18", []),
                       ("dawnbench-resnet18", ADAMW_LAYER_DECAY)):
        r = load_recipe(name, sets)
        variants = plan(r, tricks_of(r), None)
        assert len(variants) == 1 + len(tricks_of(r))
        for v in variants[1:]:
            assert v["recipe"] != r
            trick = next(t for t in TRICKS if t.name == v["trick"])
            assert not trick.is_on(v["recipe"]), (name, trick.name)
    assert {t.name for t in tricks_of(load_recipe("page-resnet9"))} >= {"ghost_bn", "cutout", "whitening"}
    # AdamW's default exclusion of biases and norms from decay is a trick of its own to ablate
    assert {t.name for t in tricks_of(load_recipe("dawnbench-resnet18", ADAMW_LAYER_DECAY))} >= {"layer_decay",
                                                                                                 "no_bias_decay"}
    with pytest.raises(RecipeError, match="not used by recipe"):
        tricks_of(load_recipe("dawnbench-resnet18"), ["ghost_bn"])


def test_ladder_adds_tricks_back_in_order():
    r = load_recipe("cifar10-94")
    v = plan(r, [], tricks_of(r, ["label_smoothing", "tta"]))
    labels = [x["label"] for x in v]
    assert labels == ["recipe", "ladder: none", "ladder: +label_smoothing", "ladder: +tta"]
    assert v[1]["recipe"].train.label_smoothing == 0 and v[1]["recipe"].eval.tta == "none"
    assert v[2]["recipe"].train.label_smoothing == 0.2 and v[2]["recipe"].eval.tta == "none"
    assert v[3]["recipe"] == r and v[3]["against"] == "ladder: +label_smoothing"


def test_epochs_to_target_interpolates():
    assert epochs_to_target([(6, 0.92), (8, 0.935), (10, 0.945)], 0.94) == {"epochs": pytest.approx(9.0), "bound": "="}
    assert epochs_to_target([(6, 0.95), (8, 0.96)], 0.94) == {"epochs": 6, "bound": "<="}
    assert epochs_to_target([(6, 0.90), (8, 0.91)], 0.94) == {"epochs": 8, "bound": ">"}


# ------------------------------------------------------------------ the commands, for real
@pytest.fixture(scope="module")
def benches(bench_records):
    root, a, b, _ = bench_records
    return root, a, b


def test_bench_writes_the_record(benches):
    root, stdout, _ = benches
    rec = json.loads((root / "a" / "bench.json").read_text())
    assert rec["recipe"] == "fashion-mnist" and rec["target"] == 0.92 and len(rec["runs"]) == 3
    assert [r["seed"] for r in rec["runs"]] == [0, 1, 2]
    for run in rec["runs"]:
        t = run["times"]
        assert 0 < t["train+eval"] <= t["end_to_end"] <= t["run_start_to_stop"]
        assert 0 <= run["test_acc"] <= 1
    accs = [r["test_acc"] for r in rec["runs"]]
    s = rec["summary"]
    assert s["test_acc"]["mean"] == pytest.approx(np.mean(accs))
    assert s["p_value_mean_at_least_target"] == pytest.approx(stats.ttest_1samp(accs, 0.92, alternative="greater").pvalue)
    assert s["frac_at_target"] == pytest.approx(np.mean(np.array(accs) >= 0.92))
    assert set(s["times"]) == {"train+eval", "end_to_end", "run_start_to_stop"}
    assert len({r["test_acc"] for r in rec["runs"]}) > 1                   # independent seeds
    env = rec["environment"]
    for key in ("device", "device_name", "cpu_model", "cpu_cores", "torch_version", "git_commit", "git_dirty",
                "command"):
        assert key in env
    assert rec["recipe_config"]["eval"]["every"] == 0 and len(rec["recipe_hash"]) == 12
    assert rec["flops"]["total_flops"] > 0 and rec["compile_seconds"] > 0
    assert "mean ± std" in stdout and "p (mean ≥ target)" not in stdout
    # a p-value, named as one; the tiny runs are far below the 92% target, so it is near 1 and says why
    assert s["test_acc"]["mean"] < 0.9 and s["p_value_mean_at_least_target"] > 0.95
    row = next(line for line in stdout.splitlines() if "one-sided t-test p-value" in line)
    assert "(H0: mean ≤ target, H1: mean > target)" in row
    assert "not below 0.05: no evidence that the mean is above the target" in row
    caption = "95% CI: Student's t interval for the mean; for times its lower end is cut at 0 s"
    assert caption in " ".join(stdout.split())
    assert all(d["ci95"][0] >= 0 and "cut at 0" in d["ci95_method"] for d in s["times"].values())


def _expected_clause(a: list[float], b: list[float], alpha: float, kind: str) -> str:
    """The verdict's clause for B against A, worked out here with scipy, not speedrun."""
    p = stats.ttest_ind(b, a, equal_var=False).pvalue
    diff = np.mean(b) - np.mean(a)
    if kind == "time":
        return ("B is faster" if diff < 0 else "B is slower") if p < alpha else "time not different"
    return ("accuracy higher" if diff > 0 else "accuracy lower") if p < alpha else "accuracy not different"


def test_compare_gives_the_verdict_the_t_tests_give(benches):
    root, _, _ = benches
    proc = speedrun("compare", root / "a" / "bench.json", root / "b", "--json", root / "cmp.json")
    result = json.loads((root / "cmp.json").read_text())
    a = json.loads((root / "a" / "bench.json").read_text())
    b = json.loads((root / "b" / "bench.json").read_text())
    ta, tb = ([r["times"]["train+eval"] for r in x["runs"]] for x in (a, b))
    aa, ab = ([r["test_acc"] for r in x["runs"]] for x in (a, b))
    assert result["time"]["p"] == pytest.approx(stats.ttest_ind(tb, ta, equal_var=False).pvalue)
    assert result["verdict"].startswith(_expected_clause(ta, tb, 0.05, "time"))
    assert ", " + _expected_clause(aa, ab, 0.05, "accuracy") in result["verdict"]
    assert result["verdict"] in " ".join(proc.stdout.split())             # printed as written


def test_compare_verdict_wording():
    def fake(times, accs):
        return {"recipe": "x", "environment": {"device_name": "d"},
                "runs": [{"times": {"train+eval": t}, "test_acc": a} for t, a in zip(times, accs)]}
    a = fake([3.0, 3.1, 3.05, 2.95], [0.940, 0.941, 0.939, 0.9405])
    b = fake([2.0, 2.1, 2.05, 1.95], [0.9402, 0.9398, 0.9411, 0.9399])
    v = compare(a, b)["verdict"]
    assert v.startswith("B is faster by 1 s") and "accuracy not different" in v
    v = compare(b, a)["verdict"]
    assert v.startswith("B is slower by 1 s")


def test_ablate_writes_table_and_chart(bench_records):
    root, _, _, stdout = bench_records
    out = root / "abl"
    rec = json.loads((out / "ablate.json").read_text())
    labels = [v["label"] for v in rec["variants"]]
    assert labels == ["recipe", "without label_smoothing", "without tta", "ladder: none", "ladder: +tta"]
    without_tta = rec["variants"][2]
    assert without_tta["delta_acc"] is not None and len(without_tta["grid"]) == 2
    assert without_tta["grid"][0]["epochs"] == pytest.approx(0.375)
    assert rec["recipe_config"]["name"] == "fashion-mnist"
    png = (out / "ablation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "without label_smoothing" in stdout and "epochs to target" in stdout


def test_run_flops_counts_each_step_at_the_size_it_trains_at():
    """Progressive resizing: steps at 16 px cost what a 16 px image costs, not a full one."""
    from speedrun.engine import flops
    from speedrun.engine.sizes import epoch_image_side
    recipe = load_recipe("cifar10-94", ["train.epochs=4", "data.progressive=[[0.0, 0.5], [0.5, 1.0]]"])
    spe = 10
    sizes = [(epoch_image_side(recipe, e, 32),) * 2 for e in range(4) for _ in range(spe)]
    assert sizes.count((16, 16)) == 20 and sizes.count((32, 32)) == 20
    got = flops.run_flops(recipe, 3, 10, (32, 32), sizes, 100)
    small, full = (flops.per_image_flops(recipe, 3, 10, s)["train"] for s in ((16, 16), (32, 32)))
    assert small < 0.3 * full                                   # a quarter of the pixels, plus the head
    batch = recipe.data.batch_size
    assert got["train_flops"] == pytest.approx(20 * batch * (small + full))
    assert got["train_steps_by_size"] == {"16x16": 20, "32x32": 20}
    plain = flops.run_flops(load_recipe("cifar10-94", ["train.epochs=4"]), 3, 10, (32, 32), [(32, 32)] * 40, 100)
    assert got["eval_flops"] == plain["eval_flops"] and got["train_flops"] < 0.7 * plain["train_flops"]


def test_steps_after_the_whitening_freeze_are_counted_without_the_first_input_gradient():
    """An eager step in one process takes the frozen whitening bias out of the backward, so the
    first convolution's input gradient is not computed: those steps count that much less."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode
    from speedrun.engine import flops
    recipe = load_recipe("cifar10-94-fast")
    got = flops.run_flops(recipe, 3, 10, (32, 32), [(32, 32)] * 10, 100, frozen_from=4)
    every = flops.run_flops(recipe, 3, 10, (32, 32), [(32, 32)] * 10, 100)
    assert got["steps_without_whitening_gradient"] == 6 and every["steps_without_whitening_gradient"] == 0
    # the input gradient of the first 3x3 convolution (24 -> 64 channels) on the 31x31 whitened map,
    # counted on a convolution of its own
    x = torch.randn(2, 24, 31, 31, requires_grad=True)
    w = torch.randn(64, 24, 3, 3, requires_grad=True)
    counted = []
    for needs in (True, False):
        x.requires_grad_(needs)
        with FlopCounterMode(display=False) as fc:
            F.conv2d(x, w, padding=1).sum().backward()
        counted.append(fc.get_total_flops() / 2)
    input_grad = counted[0] - counted[1]
    assert every["train_flops"] - got["train_flops"] == pytest.approx(6 * recipe.data.batch_size * input_grad)
    assert got["eval_flops"] == every["eval_flops"]


def test_flops_command_reports_the_split(tmp_path, fashion_small):
    proc = speedrun("flops", "fashion-mnist", "--data-dir", fashion_small, "--set", "data.dataset=npz", "--steps", 3,
                    "--json", tmp_path / "f.json")
    rec = json.loads((tmp_path / "f.json").read_text())
    recipe = load_recipe("fashion-mnist", ["data.dataset=npz"])
    assert rec["flops_per_train_image"] > 2 * rec["flops_per_forward_image"]
    steps = total_steps(recipe, 1024)                              # the 1,024-image slice
    # an eager run in one process: the steps after the whitening bias's epochs skip the first input gradient
    frozen = rec["steps_without_whitening_gradient"]
    assert frozen == steps - round(recipe.model.whiten.train_bias_epochs * (1024 // recipe.data.batch_size))
    assert "steps after the whitening bias froze" in proc.stdout
    from speedrun.engine import flops
    lighter = flops.per_image_flops(recipe, 1, 10, (28, 28), whiten_frozen=True)["train"]
    assert lighter < rec["flops_per_train_image"]
    assert rec["train_flops"] == pytest.approx((rec["flops_per_train_image"] * (steps - frozen) + lighter * frozen)
                                               * recipe.data.batch_size)
    assert rec["total_flops"] == pytest.approx(rec["train_flops"] + rec["eval_flops"])
    assert rec["split"]["steps"] == 3
    assert rec["split"]["data_seconds_per_step"] > 0 and rec["split"]["model_seconds_per_step"] > 0
    assert "data time per epoch" in proc.stdout
    assert rec["ideal_seconds"] == pytest.approx(rec["total_flops"] / (rec["known_peak_flops_per_s"]
                                                                     or rec["measured_peak_flops_per_s"]))


@pytest.mark.slow
def test_ablate_resume_keeps_finished_variants_after_a_kill(tmp_path, fashion_small, capsys):
    """Interrupt a real ablation once its first variant is written, then resume it: the
    finished variant is kept as it was and only the missing ones run. (The killed ablation is a
    real process; the refusals, the resume and the report run the same command in this one.)"""
    out = tmp_path / "abl"
    cmd = [sys.executable, "-m", "speedrun", "ablate", "fashion-mnist", "--runs", "2", "--data-dir", str(fashion_small),
           "--out", str(out), *TINY_BENCH, "--set", "train.epochs=2", "--tricks", "label_smoothing,tta"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record_path, first = out / "ablate.json", None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if record_path.exists():
            first = json.loads(record_path.read_text())
            if first["variants"]:
                break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    interrupted = json.loads(record_path.read_text())
    assert 1 <= len(interrupted["variants"]) < 3, "the ablation finished before it could be interrupted"

    # a different setting is refused, naming it, and the record is left as it was (in this
    # process: the same code as the command)
    from speedrun.cli import main
    assert main([*cmd[3:], "--resume", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "recipe" in err
    assert main([*[("3" if a == "2" else a) for a in cmd[3:]], "--resume"]) == 2
    assert "--runs (2 in the record, 3 now)" in capsys.readouterr().err
    assert json.loads(record_path.read_text()) == interrupted

    assert main([*cmd[3:], "--resume"]) == 0, capsys.readouterr().err
    done = json.loads(record_path.read_text())
    assert [v["label"] for v in done["variants"]] == ["recipe", "without label_smoothing", "without tta"]
    kept = interrupted["variants"]
    assert done["variants"][:len(kept)] == kept   # kept rows are not rerun (same runs, same times)
    assert done["resumed"][0]["kept"] == [v["label"] for v in kept]
    assert all(v["delta_acc"] is not None for v in done["variants"][1:])
    assert (out / "ablation.png").exists()
    assert main(["report", str(out)]) == 0, capsys.readouterr().err
    assert "resumed (1)" in (out / "report.md").read_text()


def test_ablate_resume_needs_a_record(tmp_path, fashion_small, cli):
    # (refusals through the command's code in this process; tests/test_failures.py runs them in real ones)
    code, err = cli("ablate", "fashion-mnist", "--runs", 2, "--data-dir", fashion_small, "--out", tmp_path / "none",
                    "--resume")
    assert code == 2 and "no such ablate.json (nothing to resume" in err
    code, err = cli("ablate", "fashion-mnist", "--runs", 2, "--data-dir", fashion_small, "--resume")
    assert code == 2 and "--resume needs --out" in err


def test_compare_names_a_missing_or_broken_record(tmp_path, cli):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "bench.json").write_text('{"runs": [')
    code, err = cli("compare", tmp_path / "absent", tmp_path / "broken")
    assert code == 1 and "absent: no such bench.json" in err
    code, err = cli("compare", tmp_path / "broken", tmp_path / "broken")
    assert code == 1 and "broken/bench.json: not a valid bench.json" in err
