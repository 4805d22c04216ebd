import math

import pytest
import torch
import torch.nn as nn

from speedrun.models import BatchNorm, build_model
from speedrun.optim import (WeightAverage, build_optimizer, classify, lr_multipliers, momenta,
)
from speedrun.recipe import (AveragingConfig, NormConfig, OneCycleSchedule, OptimConfig,
                             PiecewiseSchedule, load_recipe)


def _net():
    return build_model(load_recipe("cifar10-94").model, 3, 10)


def test_parameters_are_grouped_by_role():
    groups = classify(_net())
    assert set(groups) == {"weight", "norm_bias", "whiten_bias"}     # BN scale frozen: not trained
    assert all(p.ndim == 4 or p.ndim == 2 for p in groups["weight"])
    assert all(p.ndim == 1 for p in groups["norm_bias"] + groups["whiten_bias"])


def test_decay_is_excluded_from_one_dimensional_parameters():
    net = build_model(load_recipe("dawnbench-resnet18").model, 3, 10)    # has biases and BN scales
    cfg = OptimConfig(lr=1.0, ref_batch=128, weight_decay=5e-4, no_decay_bias_norm=True)
    opt = build_optimizer(net, cfg, 128)
    for g in opt.param_groups:
        one_d = all(p.ndim == 1 for p in g["params"])
        assert (g["weight_decay"] == 0) == one_d, g["name"]
    assert {g["name"] for g in opt.param_groups} == {"weight", "bias", "norm_weight", "norm_bias"}
    with_decay = build_optimizer(net, cfg.model_copy(update={"no_decay_bias_norm": False}), 128)
    assert all(g["weight_decay"] > 0 for g in with_decay.param_groups)


def test_lr_scales_linearly_with_batch_and_is_momentum_normalised():
    net = _net()
    cfg = OptimConfig(lr=10.0, ref_batch=1024, momentum=0.85, norm_bias_lr_mult=64, whiten_bias_lr_mult=2)
    for batch in (512, 1024, 2048):
        lrs = {g["name"]: g["lr"] for g in build_optimizer(net, cfg, batch).param_groups}
        base = 10.0 * 0.15 * batch / 1024                             # airbench94: 1.5 at 1024
        assert lrs["weight"] == pytest.approx(base)
        assert lrs["norm_bias"] == pytest.approx(64 * base)
        assert lrs["whiten_bias"] == pytest.approx(2 * base)


def _decay_after_one_step(lr, batch, mult=1.0, bias_mult=1.0):
    """Fraction of each weight removed by one step with zero gradient, by parameter group."""
    net = nn.Sequential(nn.Conv2d(2, 2, 1, bias=False), BatchNorm(2, NormConfig()))
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(2.0)
    cfg = OptimConfig(lr=lr, ref_batch=100, momentum=0.0, weight_decay=0.01, norm_bias_lr_mult=bias_mult)
    opt = build_optimizer(net, cfg, batch)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.update(torch.tensor(mult))
    return {g["name"]: 1 - g["params"][0].detach().flatten()[0].item() / 2 for g in opt.param_groups}


def test_weight_decay_is_decoupled_from_the_learning_rate():
    base = _decay_after_one_step(lr=1.0, batch=100)
    assert base["weight"] == pytest.approx(0.01, rel=1e-5)       # the stated fraction per ref batch
    assert base["norm_bias"] == pytest.approx(0.01, rel=1e-5)
    for kw in (dict(lr=50.0), dict(bias_mult=64.0)):              # LR and LR multipliers: no effect
        got = _decay_after_one_step(**{"lr": 1.0, "batch": 100, **kw})
        assert got == pytest.approx(base, rel=1e-5)
    assert _decay_after_one_step(lr=1.0, batch=200)["weight"] == pytest.approx(0.02, rel=1e-5)
    assert _decay_after_one_step(lr=1.0, batch=100, mult=0.5)["weight"] == pytest.approx(0.005, rel=1e-5)


@pytest.mark.parametrize("frozen_now", [True, False])
def test_frozen_groups_get_zero_lr_while_the_device_flag_says_so(frozen_now):
    net = _net()
    opt = build_optimizer(net, OptimConfig(lr=1.0, ref_batch=1024, momentum=0.0, weight_decay=0.0), 1024)
    before = {g["name"]: [p.detach().clone() for p in g["params"]] for g in opt.param_groups}
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.update(torch.tensor(0.5), frozen=frozenset({"whiten_bias"}), frozen_now=torch.tensor(frozen_now))
    for g in opt.param_groups:              # w -= lr * 1 per element, lr = 0.5 * base, 0 when frozen
        lr = 0.0 if (g["name"] == "whiten_bias" and frozen_now) else 0.5 * g["base_lr"]
        for p, b in zip(g["params"], before[g["name"]]):
            assert torch.allclose(b - p.detach(), torch.full_like(b, lr)), g["name"]


def test_piecewise_schedule_endpoints_and_knots():
    cfg = PiecewiseSchedule(knots=[0, 0.25, 1], values=[0.2, 1.0, 0.0])
    m = lr_multipliers(cfg, 100)
    assert len(m) == 100
    assert m[0] == pytest.approx(0.2) and m[25] == pytest.approx(1.0)
    assert m[-1] == pytest.approx(1.0 / 75)          # last step sits just before the end knot
    assert max(m) == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(m[:25], m[1:26])) and all(a >= b for a, b in zip(m[25:], m[26:]))


def test_one_cycle_schedule_and_momentum_cycle():
    cfg = OneCycleSchedule(peak_at=0.3, start=0.1, end=0.0, momentum_low=0.85)
    m = lr_multipliers(cfg, 1000)
    assert m[0] == pytest.approx(0.1) and m[300] == pytest.approx(1.0) and m[-1] < 0.002
    mom = momenta(cfg, 0.95, 1000)
    assert mom[0] == pytest.approx(0.95) and mom[300] == pytest.approx(0.85) and mom[-1] > 0.949
    assert momenta(OneCycleSchedule(), 0.9, 10) is None


def test_ema_update_rule():
    net = nn.Linear(3, 2)
    avg = WeightAverage(net, AveragingConfig(kind="ema", every=2, decay=0.9), total_steps=10)
    start = [t.clone() for t in avg.shadow]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    avg.update(1)                                            # not a multiple of every: no change
    assert all(torch.equal(a, b) for a, b in zip(avg.shadow, start))
    avg.update(2)
    for s, s0, live in zip(avg.shadow, start, avg.live):
        assert torch.allclose(s, 0.9 * s0 + 0.1 * live)
    live = [t.clone() for t in avg.live]
    with avg.applied():
        assert all(torch.equal(a, b) for a, b in zip(avg.live, avg.shadow))
    assert all(torch.equal(a, b) for a, b in zip(avg.live, live))   # restored
    avg.finalize()
    assert all(torch.equal(a, b) for a, b in zip(avg.live, avg.shadow))


def test_lookahead_pulls_fast_weights_back_with_a_ramped_decay():
    net = nn.Linear(3, 2)
    avg = WeightAverage(net, AveragingConfig(kind="lookahead", every=5, decay=0.8, power=3), total_steps=10)
    assert avg.decay_at(5) == pytest.approx(0.8 * 0.5 ** 3) and avg.decay_at(10) == pytest.approx(0.8)
    slow = [t.clone() for t in avg.shadow]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    avg.update(10)
    for s, s0 in zip(avg.shadow, slow):
        assert torch.allclose(s, 0.8 * s0 + 0.2 * (s0 + 1))
    assert all(torch.equal(a, b) for a, b in zip(avg.live, avg.shadow))  # fast weights reset


def test_averaging_includes_batch_norm_statistics():
    net = build_model(load_recipe("fashion-mnist").model, 1, 10)
    avg = WeightAverage(net, AveragingConfig(kind="ema"), 10)
    n_float = sum(1 for t in net.state_dict().values() if t.is_floating_point())
    assert len(avg.shadow) == n_float and n_float > len(list(net.parameters()))
    assert math.isclose(sum(t.numel() for t in avg.shadow),
                        sum(t.numel() for t in net.state_dict().values() if t.is_floating_point()))
