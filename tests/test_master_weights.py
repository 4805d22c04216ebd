"""runtime.master_weights = "fp32": with the model stored in bf16 (runtime.cast = "model"), the
optimizer updates fp32 copies of the weights from the step's bf16 gradients, so an update
smaller than half a bf16 step is kept instead of rounded away."""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

from speedrun.engine.loop import Session
from speedrun.engine.precision import MasterWeights
from speedrun.engine.runtime import resolve_runtime
from speedrun.engine.step import WHITEN_FROZEN
from speedrun.optim import build_optimizer
from speedrun.recipe import OptimConfig, RecipeError, RuntimeConfig, load_recipe

CPU = torch.device("cpu")


def _sgd_on(param: nn.Parameter, stand_ins=None):
    """Plain SGD (no momentum, no decay) at a per-step LR of 1e-3 for a one-weight model."""
    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    model[0].weight = param
    cfg = OptimConfig(lr=1e-3, ref_batch=1, momentum=0.0, nesterov=False)
    return build_optimizer(model, cfg, 1, stand_ins=stand_ins)


def test_a_small_update_is_rounded_away_in_bf16_and_kept_by_fp32_master_weights():
    """A weight of 1 in bf16 (steps of 2**-8 below 1) moved by 1e-3 per step stays 1 for good;
    with fp32 master weights the copy moves by 1e-3 each step and the bf16 weight follows it."""
    plain = nn.Parameter(torch.ones(1, 1, dtype=torch.bfloat16))
    opt = _sgd_on(plain)
    for _ in range(10):
        plain.grad = torch.ones_like(plain)
        opt.update(1.0)
    assert plain.item() == 1.0                                   # every update lost

    kept = nn.Parameter(torch.ones(1, 1, dtype=torch.bfloat16))
    masters = MasterWeights([kept])
    opt = _sgd_on(kept, masters.stand_ins)
    for _ in range(10):
        kept.grad = torch.ones_like(kept)
        masters.take_grads()
        opt.update(1.0)
        masters.write_back()
    assert masters.high[0].item() == pytest.approx(0.99, abs=1e-6)
    assert kept.item() == torch.tensor(0.99).bfloat16().item() < 1.0


def test_master_weights_need_the_model_stored_in_low_precision():
    with pytest.raises(RecipeError, match="runtime.master_weights = fp32 does nothing with runtime.cast = autocast"):
        load_recipe("fashion-mnist", ["runtime.master_weights=fp32"])
    assert load_recipe("fashion-mnist", ["runtime.cast=model", "runtime.master_weights=fp32"]).runtime.master_weights \
        == "fp32"


@pytest.fixture(scope="module")
def tiny(fashion):
    return dataclasses.replace(fashion, train_x=fashion.train_x[:512], train_y=fashion.train_y[:512],
                               test_x=fashion.test_x[:64], test_y=fashion.test_y[:64])


ADAMW = ["optim.name=adamw", "optim.lr=2e-3", "optim.norm_bias_lr_mult=1.0", "optim.weight_decay=0.05",
         "optim.layer_decay=0.8"]


@pytest.mark.parametrize("optim", [[], ADAMW], ids=["sgd", "adamw-layer-decay"])
def test_a_step_updates_the_fp32_weights_as_the_fp32_optimizer_would_from_the_same_bf16_gradients(tiny, optim):
    """One training step of a bf16-stored speed net with fp32 master weights: the fp32 copies
    equal an fp32 update (the recipe's optimizer, built on an fp32 copy of the model) from the
    step's bf16 gradients, to the bit; the bf16 model holds the copies rounded. (AdamW with
    layer decay: its groups found by block for the fp32 copies as for the parameters.)"""
    recipe = load_recipe("fashion-mnist", ["model.widths=[8,16,16]", "data.batch_size=64", "train.epochs=1",
                                           "runtime.cast=model", "runtime.master_weights=fp32",
                                           "averaging.kind=none", "model.whiten.train_bias_epochs=0", *optim])
    runtime = dataclasses.replace(resolve_runtime(RuntimeConfig(), CPU), precision="bf16", cast="model",
                                  master_weights="fp32")
    session = Session(recipe, tiny, runtime)
    step = session.step
    assert step.masters is not None and all(h.dtype == torch.float32 for h in step.params)
    assert any(p.dtype == torch.bfloat16 for p in step.model_params)
    ref_model = copy.deepcopy(step.model).float()
    ref_params = {id(p): r for p, r in zip(step.model.parameters(), ref_model.parameters())}
    with torch.no_grad():
        for p, h in zip(step.masters.low, step.masters.high):
            ref_params[id(p)].copy_(h)
    ref_opt = build_optimizer(ref_model, recipe.optim, recipe.data.batch_size)
    assert [g["lr_mult"] for g in ref_opt.param_groups] == [g["lr_mult"] for g in step.opt.param_groups]

    torch.manual_seed(0)
    x = torch.randn(64, 1, 28, 28).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,))
    scaled, loss, correct, _ = step.forward_loss(x, y, 1.0)
    scaled.backward()
    for p in step.masters.low:
        ref_params[id(p)].grad = p.grad.float()
    lr_mult, momentum = step.schedule.at(step.counter.reshape(1))
    step.update([loss], [correct])
    ref_opt.update(lr_mult, momentum, WHITEN_FROZEN, True)        # (the whitening bias: 0 epochs)

    moved = 0
    for p, h in zip(step.masters.low, step.masters.high):
        ref = ref_params[id(p)].detach()
        assert torch.equal(h, ref)
        assert torch.equal(p.detach(), ref.to(p.dtype))
        moved += int((h != h.to(p.dtype).float()).sum())
    assert moved > 0                     # the fp32 copies hold what bf16 cannot
