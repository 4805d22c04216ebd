"""Issue 5's candidate techniques: orthogonalised filter updates and cheaper TTA."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from speedrun.engine.evaluate import tta_logits
from speedrun.models import build_model
from speedrun.optim import build_optimizer
from speedrun.optim.orthogonal import OptimizerList, OrthogonalFilters, newton_schulz, ns_dtype
from speedrun.recipe import OptimConfig, load_recipe

from test_cli import speedrun


def test_newton_schulz_approximates_the_orthogonal_polar_factor():
    torch.manual_seed(0)
    g = torch.randn(4, 64, 576)
    u, _, vt = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vt
    for steps, band in ((5, (0.6, 1.25)), (3, (0.3, 1.25))):
        x = newton_schulz(g, steps)
        sv = torch.linalg.svdvals(x)
        assert sv.min() > band[0] and sv.max() < band[1], (steps, sv.min(), sv.max())
        cos = (x * polar).sum((1, 2)) / (x.norm(dim=(1, 2)) * polar.norm(dim=(1, 2)))
        assert (cos > 0.9).all()
    tall = newton_schulz(g.mT, 5)                                       # rows > cols handled by transposing
    assert torch.allclose(tall, newton_schulz(g, 5).mT, atol=1e-5)
    batched = newton_schulz(g, 3)
    assert torch.allclose(batched[2], newton_schulz(g[2:3], 3)[0], atol=1e-6)


def test_newton_schulz_in_bf16_orthogonalises_as_well_as_fp32():
    """optim.ns_precision=bf16: the same band of singular values and direction as fp32, the
    result handed back in the gradient's dtype."""
    torch.manual_seed(0)
    g = torch.randn(3, 128, 1152)
    x32, x16 = newton_schulz(g, 3, dtype=torch.float32), newton_schulz(g, 3, dtype=torch.bfloat16)
    assert x16.dtype == torch.float32 and not torch.equal(x16, x32)      # really computed in bf16
    sv = torch.linalg.svdvals(x16)
    assert sv.min() > 0.3 and sv.max() < 1.25
    cos = (x16 * x32).sum((1, 2)) / (x16.norm(dim=(1, 2)) * x32.norm(dim=(1, 2)))
    assert (cos > 0.99).all()


@pytest.mark.parametrize("setting, device, precision, expected", [
    ("auto", "cuda", "fp32", torch.bfloat16),       # the records' choice on GPUs, whatever the run's precision
    ("auto", "cuda", "bf16", torch.bfloat16),
    ("auto", "cpu", "bf16", torch.bfloat16),        # a CPU with native bf16 (precision auto picked bf16)
    ("auto", "cpu", "fp32", torch.float32),         # a CPU without: bf16 products would be emulated
    ("fp32", "cuda", "bf16", torch.float32),
    ("bf16", "cpu", "fp32", torch.bfloat16),
])
def test_newton_schulz_dtype_decision(setting, device, precision, expected):
    assert ns_dtype(setting, device, precision) == expected


def test_optimizer_runs_newton_schulz_in_the_dtype_it_is_given():
    torch.manual_seed(2)
    conv = nn.Conv2d(16, 32, 3, bias=False)
    steps = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = conv.weight.detach().clone().requires_grad_()
        opt = OrthogonalFilters([w], lr=0.1, norm_every=0, ns_dtype=dtype)
        w.grad = torch.randn_like(w, generator=torch.Generator().manual_seed(3))
        before = w.detach().clone()
        opt.step()
        steps[dtype] = (w.detach() - before).flatten()
        assert w.dtype == torch.float32
    s32, s16 = steps[torch.float32], steps[torch.bfloat16]
    assert not torch.equal(s32, s16) and float(s32 @ s16 / (s32.norm() * s16.norm())) > 0.99


def test_orthogonal_filter_step_by_hand():
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(8, 4, 3, 3))
    w0 = w.detach().clone()
    opt = OrthogonalFilters([w], lr=0.1, momentum=0.5, nesterov=True, ns_steps=3, norm_every=1)
    g = torch.randn_like(w)
    w.grad = g.clone()
    opt.step()
    buf = g                                                         # first step: buffer = g
    update = g + 0.5 * buf
    normed = w0 * (8 ** 0.5 / w0.norm())
    ortho = newton_schulz(update.reshape(8, 36)[None], 3)[0] * max(1.0, 8 / 36) ** 0.5
    assert torch.allclose(w.detach(), normed - 0.1 * ortho.view_as(w0), atol=1e-6)
    with pytest.raises(ValueError, match="4-D conv filters"):
        OrthogonalFilters([nn.Parameter(torch.ones(3, 3))], lr=0.1)


def test_filters_are_renormalised_only_every_n_steps():
    w = nn.Parameter(torch.randn(16, 8, 3, 3) * 5)
    opt = OrthogonalFilters([w], lr=1e-3, norm_every=3)
    norms = []
    for _ in range(3):
        w.grad = torch.randn_like(w)
        opt.step()
        norms.append(float(w.detach().norm()))
    assert abs(norms[0] - 4.0) > 1 and abs(norms[2] - 4.0) < 0.1       # sqrt(16) = 4 after step 3


def test_build_optimizer_routes_conv_filters_to_orthogonal_updates():
    net = build_model(load_recipe("cifar10-94").model, 3, 10)
    cfg = OptimConfig(lr=10.0, ref_batch=1024, momentum=0.85, filters="orthogonal", filter_lr=0.24,
                      weight_decay=0.0133)
    opt = build_optimizer(net, cfg, 2000)
    assert isinstance(opt, OptimizerList)
    names = {g["name"]: g for g in opt.param_groups}
    assert set(names) == {"filters", "weight", "norm_bias", "whiten_bias"}
    assert all(p.ndim == 4 for p in names["filters"]["params"]) and len(names["filters"]["params"]) == 6
    assert [p.ndim for p in names["weight"]["params"]] == [2]              # the linear head stays SGD
    assert names["filters"]["base_lr"] == 0.24
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    state = opt.state_dict()
    opt2 = build_optimizer(net, cfg, 2000)
    opt2.load_state_dict(state)
    assert opt2.param_groups[-1]["state"]["steps_taken"] == 1


@pytest.mark.parametrize("tta", ["flip", "flip_translate"])
def test_partial_tta_applies_the_views_to_the_least_confident_images(tta):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 5)).eval()
    x = torch.randn(40, 3, 10, 10)
    full, plain = tta_logits(model, x, tta)
    part, plain2 = tta_logits(model, x, tta, fraction=0.25)
    assert torch.allclose(plain, plain2)
    top2 = plain.topk(2, 1).values
    chosen = (top2[:, 0] - top2[:, 1]).topk(10, largest=False).indices
    rest = torch.ones(40, dtype=torch.bool)
    rest[chosen] = False
    assert torch.allclose(part[chosen], full[chosen], atol=1e-5)
    assert torch.allclose(part[rest], plain[rest])
    assert torch.allclose(tta_logits(model, x, tta, fraction=1.0)[0], full)


def test_flop_count_follows_the_tta_fraction():
    from speedrun.engine.flops import per_image_flops, run_flops
    r = load_recipe("cifar10-94", ["eval.tta_fraction=0.2"])
    forward = per_image_flops(r, 3, 10, (32, 32))["forward"]
    assert run_flops(r, 3, 10, (32, 32), [], 10_000)["eval_flops"] == pytest.approx(10_000 * forward * (1 + 5 * 0.2))


def test_flop_counts_and_peaks_are_kept_for_the_next_process_and_only_for_the_same_key(tmp_path, monkeypatch):
    """What a count is kept under: the model recipe and the size (and the model code and torch);
    a kept count equals a fresh one. A file that is not JSON or a cache folder that cannot be
    written costs a recount, never an error."""
    from speedrun.engine import flops
    monkeypatch.setenv("SPEEDRUN_CACHE", str(tmp_path / "cache"))
    counted = []
    real = flops.count_per_image_flops
    monkeypatch.setattr(flops, "count_per_image_flops", lambda *a: counted.append(a[3:]) or real(*a))
    r = load_recipe("cifar10-94", ["model.widths=[8,16,16]"])
    first = flops.per_image_flops(r, 3, 10, (32, 32))
    assert flops.per_image_flops(r, 3, 10, (32, 32)) == first == real(r, 3, 10, (32, 32)) and len(counted) == 1
    flops.per_image_flops(r, 3, 10, (24, 24))
    wider = flops.per_image_flops(load_recipe("cifar10-94", ["model.widths=[16,16,16]"]), 3, 10, (32, 32))
    assert len(counted) == 3 and wider["train"] > first["train"]
    kept = tmp_path / "cache" / flops.KEPT_FILE
    assert {v["kind"] for v in json.loads(kept.read_text()).values()} == {"per_image_flops"}
    kept.write_text("{not json")
    assert flops.per_image_flops(r, 3, 10, (32, 32)) == first and len(counted) == 4
    assert len(json.loads(kept.read_text())) == 1                        # written again, whole
    before = kept.read_text()
    monkeypatch.setenv("SPEEDRUN_CACHE", str(kept))                      # a file where the folder should be
    assert flops.per_image_flops(r, 3, 10, (32, 32)) == first and len(counted) == 5
    assert flops.kept_peak("cpu", "a CPU (1 threads)", "fp32") > 0 and kept.read_text() == before


def test_an_eager_run_whose_counts_are_kept_does_not_import_the_compiler(tmp_path, fashion_small):
    """The first eager run counts its FLOPs (on a CPU copy of the model, without importing torch's
    compiler or sympy: on the meta device or under torch's own FlopCounterMode they cost about
    1.5-2.5 s of CPU time) and measures the CPU's peak; a second run of the same model with the
    same cache folder reads both, reporting the same figures; neither imports torch._dynamo."""
    env = {**os.environ, "SPEEDRUN_CACHE": str(tmp_path / "cache")}
    args = ["train", "fashion-mnist", "--data-dir", str(fashion_small), "--device", "cpu", "--set", "data.dataset=npz",
            "--set", "train.epochs=0.5", "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=256"]
    imported, summaries = [], []
    for name in ("first", "second"):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "speedrun", *args, "--out",
                               str(tmp_path / name)], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        imported.append({line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line})
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    assert not {"torch._dynamo", "sympy"} & (imported[0] | imported[1])
    first, second = summaries
    assert first["total_flops"] == second["total_flops"] > 0 and first["compile"] is False
    assert first["peak_flops_per_s"] == second["peak_flops_per_s"] > 0 and second["peak_source"] == "measured matmul"


@pytest.mark.parametrize("filters", ["orthogonal", "same"])
def test_candidate_recipe_trains_with_orthogonal_filters(cifar_small, tmp_path, filters):
    """The candidate's conv filters are updated by orthogonalised steps with their norms reset
    to sqrt(out channels) every step: after training every filter bank has that norm (the
    schedule ends at LR 0, so the last step adds nothing). With plain SGD filters
    (filters="same") they do not, so this check fails with the feature off."""
    speedrun("train", "cifar10-94-fast", "--data-dir", cifar_small, "--set", "data.dataset=npz", "--out",
             tmp_path / "r", "--set", "eval.every=0", "--set", "train.epochs=2", "--set", "model.widths=[16,32,32]",
             "--set", "data.batch_size=256", "--set", "averaging.kind=none", "--set", f"optim.filters={filters}",
             "--set", "model.identity_init=false")              # Dirac filters start at the reset norm
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["test_acc"] > 0.15                                  # 8 steps on 1,024 images; chance: 0.1
    state = torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    filters_ = {k: v for k, v in state.items() if v.ndim == 4 and k != "features.0.weight"}   # not whitening
    assert len(filters_) == 6
    ratios = [float(w.norm() / w.shape[0] ** 0.5) for w in filters_.values()]
    if filters == "orthogonal":
        assert all(abs(r - 1) < 0.01 for r in ratios), ratios
    else:
        assert all(abs(r - 1) > 0.2 for r in ratios), ratios
