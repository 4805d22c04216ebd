"""LARS and LAMB against hand computations of the published formulas, and how the recipe
chooses and configures them (and AdamW, whose rule tests/test_adamw.py checks)."""
import math

import pytest
import torch
import torch.nn as nn

from speedrun.models import BatchNorm, PatchWhitening
from speedrun.optim import LAMB, LARS, SGD, AdamW, build_optimizer
from speedrun.recipe import NormConfig, OptimConfig


# ------------------------------------------------------------------------------------------
# Per-tensor references, written straight from the papers' update rules
# ------------------------------------------------------------------------------------------

def lars_reference(ws, grads_per_step, lr, momentum, nesterov, wd, eta, adapt):
    ws = [w.clone() for w in ws]
    bufs = [None] * len(ws)
    for grads in grads_per_step:
        for i, (w, g) in enumerate(zip(ws, grads)):
            d = g + wd * w
            wn, gn = w.norm(), g.norm()
            trust = eta * wn / (gn + wd * wn) if adapt and wn > 0 and gn > 0 else 1.0
            bufs[i] = trust * d if bufs[i] is None else momentum * bufs[i] + trust * d
            step = trust * d + momentum * bufs[i] if nesterov else bufs[i]
            ws[i] = w - lr * step
    return ws


def lamb_reference(ws, grads_per_step, lr, betas, eps, wd, adapt):
    b1, b2 = betas
    ws = [w.clone() for w in ws]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (w, g) in enumerate(zip(ws, grads)):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat, v_hat = ms[i] / (1 - b1 ** t), vs[i] / (1 - b2 ** t)
            r = m_hat / (v_hat.sqrt() + eps) + wd * w
            wn, rn = w.norm(), r.norm()
            trust = wn / rn if adapt and wn > 0 and rn > 0 else 1.0
            ws[i] = w - lr * trust * r
    return ws


def run(opt_class, ws, grads_per_step, **group):
    params = [nn.Parameter(w.clone()) for w in ws]
    opt = opt_class([dict(params=params, **group)], group["lr"])
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def tensors(seed, *shapes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in shapes]


SHAPES = [(4, 3, 3, 3), (5, 4), (5,)]


# ------------------------------------------------------------------------------------------
# LARS
# ------------------------------------------------------------------------------------------

def test_lars_one_step_by_hand():
    w, g = torch.tensor([3.0, 4.0]), torch.tensor([0.6, 0.8])          # ||w|| = 5, ||g|| = 1
    got = run(LARS, [w], [[g]], lr=2.0, momentum=0.9, nesterov=False, weight_decay=0.1,
              trust_coefficient=0.01, adapt=True)[0]
    trust = 0.01 * 5 / (1 + 0.1 * 5)                                   # 1/30
    d = torch.tensor([0.6 + 0.3, 0.8 + 0.4])
    assert torch.allclose(got, w - 2.0 * trust * d)                     # buffer starts at trust*d
    assert torch.allclose(got, torch.tensor([2.94, 3.92]))


def test_lars_nesterov_one_step_by_hand():
    w, g = torch.tensor([3.0, 4.0]), torch.tensor([0.6, 0.8])
    got = run(LARS, [w], [[g]], lr=2.0, momentum=0.9, nesterov=True, weight_decay=0.1,
              trust_coefficient=0.01, adapt=True)[0]
    td = torch.tensor([0.9, 1.2]) / 30
    assert torch.allclose(got, w - 2.0 * (td + 0.9 * td))


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("adapt", [True, False])
def test_lars_two_steps_match_the_reference(nesterov, adapt):
    ws = tensors(0, *SHAPES)
    steps = [tensors(1, *SHAPES), tensors(2, *SHAPES)]
    hp = dict(lr=0.5, momentum=0.9, nesterov=nesterov, weight_decay=5e-4, trust_coefficient=0.02)
    got = run(LARS, ws, steps, adapt=adapt, **hp)
    want = lars_reference(ws, steps, hp["lr"], hp["momentum"], nesterov, hp["weight_decay"],
                          hp["trust_coefficient"], adapt)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_without_adaptation_is_torch_sgd_with_l2_decay(nesterov):
    ws = tensors(3, *SHAPES)
    steps = [tensors(4, *SHAPES), tensors(5, *SHAPES)]
    got = run(LARS, ws, steps, lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01,
              trust_coefficient=0.001, adapt=False)
    want = run(torch.optim.SGD, ws, steps, lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


def test_lars_trust_is_one_for_a_zero_weight_or_zero_gradient():
    zero_w, w = torch.zeros(3), torch.tensor([1.0, 2.0, 2.0])
    g, zero_g = torch.tensor([0.5, -1.0, 2.0]), torch.zeros(3)
    got = run(LARS, [zero_w, w], [[g, zero_g]], lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.1,
              trust_coefficient=0.001, adapt=True)
    assert torch.allclose(got[0], -0.1 * g)                             # zero weight: plain step
    assert torch.allclose(got[1], w - 0.1 * 0.1 * w)                    # zero grad: decay only, trust 1
    assert all(torch.isfinite(t).all() for t in got)


def test_lars_groups_keep_their_own_settings():
    w, g = torch.tensor([3.0, 4.0]), torch.tensor([0.6, 0.8])
    a, b = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt = LARS([dict(params=[a]), dict(params=[b], adapt=False, lr=0.5)], lr=2.0, momentum=0.9,
               weight_decay=0.1, trust_coefficient=0.01)
    a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    d = torch.tensor([0.9, 1.2])
    assert torch.allclose(a.detach(), w - 2.0 * d / 30)
    assert torch.allclose(b.detach(), w - 0.5 * d)


# ------------------------------------------------------------------------------------------
# LAMB
# ------------------------------------------------------------------------------------------

def test_lamb_one_step_by_hand():
    w, g = torch.tensor([3.0, 4.0]), torch.tensor([0.5, -2.0])
    got = run(LAMB, [w], [[g]], lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1, adapt=True)[0]
    # bias correction makes the first moments m_hat = g and v_hat = g^2 exactly
    r = g / (g.abs() + 1e-6) + 0.1 * w                                   # ~ [1.3, -0.6]
    trust = 5.0 / r.norm()
    assert torch.allclose(r, torch.tensor([1.3, -0.6]), atol=1e-5)
    assert torch.allclose(got, w - 0.1 * trust * r)


def test_lamb_second_step_uses_bias_corrected_moments():
    w = torch.tensor([3.0, 4.0])
    g1, g2 = torch.tensor([0.5, -2.0]), torch.tensor([1.0, 1.0])
    b1, b2, eps, wd, lr = 0.9, 0.99, 1e-8, 0.0, 0.1
    got = run(LAMB, [w], [[g1], [g2]], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adapt=True)[0]
    w1 = w - lr * 5.0 * torch.sign(g1) / math.sqrt(2)                  # step 1: r = sign(g), |r| = sqrt 2
    m_hat = ((1 - b1) * b1 * g1 + (1 - b1) * g2) / (1 - b1 ** 2)
    v_hat = ((1 - b2) * b2 * g1 ** 2 + (1 - b2) * g2 ** 2) / (1 - b2 ** 2)
    r = m_hat / (v_hat.sqrt() + eps)
    assert torch.allclose(got, w1 - lr * w1.norm() / r.norm() * r, atol=1e-6)


@pytest.mark.parametrize("adapt", [True, False])
def test_lamb_two_steps_match_the_reference(adapt):
    ws = tensors(6, *SHAPES)
    steps = [tensors(7, *SHAPES), tensors(8, *SHAPES)]
    hp = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    got = run(LAMB, ws, steps, adapt=adapt, **hp)
    want = lamb_reference(ws, steps, hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"], adapt)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


def test_lamb_without_adaptation_is_adamw():
    ws = tensors(9, *SHAPES)
    steps = [tensors(10, *SHAPES), tensors(11, *SHAPES)]
    got = run(LAMB, ws, steps, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.05, adapt=False)
    want = run(torch.optim.AdamW, ws, steps, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.05)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6)


def test_lamb_trust_is_one_for_a_zero_weight():
    g = torch.tensor([0.5, -2.0, 1.0])
    got = run(LAMB, [torch.zeros(3)], [[g]], lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1,
              adapt=True)[0]
    assert torch.allclose(got, -0.1 * g / (g.abs() + 1e-6))


def test_lamb_state_dict_round_trip_continues_identically():
    ws, steps = tensors(12, *SHAPES), [tensors(13, *SHAPES), tensors(14, *SHAPES)]
    want = run(LAMB, ws, steps, lr=0.01, weight_decay=0.01)
    params = [nn.Parameter(w.clone()) for w in ws]
    first = LAMB(params, lr=0.01, weight_decay=0.01)
    for p, g in zip(params, steps[0]):
        p.grad = g.clone()
    first.step()
    second = LAMB(params, lr=0.01, weight_decay=0.01)
    second.load_state_dict(first.state_dict())
    for p, g in zip(params, steps[1]):
        p.grad = g.clone()
    second.step()
    for a, b in zip(want, params):
        assert torch.allclose(a, b.detach())


# ------------------------------------------------------------------------------------------
# No host synchronisation inside a step
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opt_class", [LARS, LAMB, AdamW])
def test_step_never_reads_a_tensor_back_to_the_host(opt_class, monkeypatch):
    ws = tensors(15, *SHAPES) + [torch.zeros(3)]
    params = [nn.Parameter(w) for w in ws]
    groups = [dict(params=[params[0], params[1], params[3]]), dict(params=[params[2]], adapt=False)]
    opt = opt_class(groups, lr=0.1, weight_decay=0.01)                   # zero weight: adapted group
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    for _ in range(2):
        for p, g in zip(params, tensors(16, *SHAPES, (3,))):
            p.grad = g
        opt.step()
    assert calls == []


# ------------------------------------------------------------------------------------------
# Choosing and configuring the optimizer from the recipe
# ------------------------------------------------------------------------------------------

def _net():
    """One parameter of each role: conv weight, linear bias, BN scale and bias, whitening bias."""
    return nn.Sequential(PatchWhitening(3, 2, 1e-3, True, False), nn.Conv2d(24, 4, 1, bias=False),
                         BatchNorm(4, NormConfig()), nn.Flatten(), nn.Linear(4, 2))


def _by_name(opt):
    return {g["name"]: g for g in opt.param_groups}


@pytest.mark.parametrize("name, cls", [("sgd", SGD), ("lars", LARS), ("lamb", LAMB), ("adamw", AdamW)])
@pytest.mark.parametrize("scaling, scale", [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_build_optimizer_picks_the_class_and_per_step_lr(name, cls, scaling, scale):
    cfg = OptimConfig(name=name, lr=2.0, ref_batch=256, lr_scaling=scaling, momentum=0.8,
                      norm_bias_lr_mult=3.0, whiten_bias_lr_mult=0.5)
    opt = build_optimizer(_net(), cfg, 1024)
    assert type(opt) is cls
    base = 2.0 * scale * (1.0 if name in ("lamb", "adamw") else 0.2)
    groups = _by_name(opt)
    assert set(groups) == {"weight", "bias", "norm_weight", "norm_bias", "whiten_bias"}
    for role, mult in {"weight": 1.0, "bias": 1.0, "norm_bias": 3.0, "whiten_bias": 0.5}.items():
        g = groups[role]
        assert g["lr"] == pytest.approx(base * mult) and g["base_lr"] == g["lr"] and g["lr_mult"] == mult


def test_sgd_decay_follows_the_batch_scale():
    """SGD's decoupled decay per step is weight_decay * (1 - momentum) * scale, whatever lr."""
    for scaling, scale in (("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)):
        cfg = OptimConfig(lr=7.0, ref_batch=256, lr_scaling=scaling, momentum=0.8, weight_decay=0.01)
        g = _by_name(build_optimizer(_net(), cfg, 1024))["weight"]
        assert g["lr"] * g["weight_decay"] == pytest.approx(0.01 * 0.2 * scale)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_layerwise_groups_adapt_weights_only_by_default(name):
    cfg = OptimConfig(name=name, lr=1.0, ref_batch=256, weight_decay=5e-5, no_decay_bias_norm=True)
    groups = _by_name(build_optimizer(_net(), cfg, 256))
    assert {k: g["adapt"] for k, g in groups.items()} == {
        "weight": True, "bias": False, "norm_weight": False, "norm_bias": False, "whiten_bias": False}
    assert {k: g["weight_decay"] for k, g in groups.items()} == {
        "weight": 5e-5, "bias": 0.0, "norm_weight": 0.0, "norm_bias": 0.0, "whiten_bias": 0.0}
    everything = cfg.model_copy(update={"adapt_bias_norm": True, "no_decay_bias_norm": False})
    groups = _by_name(build_optimizer(_net(), everything, 256))
    assert all(g["adapt"] for g in groups.values())
    assert all(g["weight_decay"] == 5e-5 for g in groups.values())      # the published coefficient


def test_recipe_hyperparameters_reach_the_groups():
    lars = build_optimizer(_net(), OptimConfig(name="lars", lr=1.0, ref_batch=256, momentum=0.85,
                                               nesterov=False, trust_coefficient=0.02), 256)
    assert all(g["momentum"] == 0.85 and g["nesterov"] is False and g["trust_coefficient"] == 0.02
               for g in lars.param_groups)
    lamb = build_optimizer(_net(), OptimConfig(name="lamb", lr=1.0, ref_batch=256, betas=(0.8, 0.99),
                                               eps=1e-8), 256)
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-8 and "momentum" not in g
               for g in lamb.param_groups)


@pytest.mark.parametrize("name", ["sgd", "lars", "lamb", "adamw"])
def test_update_with_device_hyperparameters_equals_an_eager_step_with_those_values(name):
    """The training step's update (schedule multiplier and momentum as 0-d tensors, a frozen
    group decided by a device flag) does exactly what an eager step with the same values as
    group floats does; LAMB and AdamW keep their betas, the frozen group does not move."""
    cfg = OptimConfig(name=name, lr=1.0, ref_batch=256, norm_bias_lr_mult=4.0)
    nets = [_net(), _net()]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [build_optimizer(n, cfg, 256) for n in nets]
    gen = torch.Generator().manual_seed(0)
    whiten = _by_name(opts[0])["whiten_bias"]["params"][0]
    whiten_before = whiten.detach().clone()
    for step in range(2):
        grads = [torch.randn(p.shape, generator=gen) for p in nets[0].parameters()]
        for n in nets:
            for p, g in zip(n.parameters(), grads):
                p.grad = g.clone()
        opts[0].update(torch.tensor(0.25), torch.tensor(0.8), frozenset({"whiten_bias"}), torch.tensor(True))
        for g in opts[1].param_groups:
            g["lr"] = 0.0 if g["name"] == "whiten_bias" else 0.25 * g["base_lr"]
            if name not in ("lamb", "adamw"):
                g["momentum"] = 0.8
        opts[1].step()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    assert torch.equal(whiten.detach(), whiten_before)
