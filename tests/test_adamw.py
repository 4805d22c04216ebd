"""AdamW (optim.name = "adamw") against torch.optim.AdamW step for step, its recipe defaults and
units, and layer-wise LR decay (optim.layer_decay): the multipliers per block of speedrun's real
networks, with every optimizer, orthogonal filter updates, fine-tuning's held groups, a model's
own blocks, fp32 master weights and a checkpoint. The compiled bf16 run that learns with both is
an entry of the recipe matrix (tests/matrix.py: FIELDS)."""
import dataclasses
import io

import pytest
import torch
import torch.nn as nn

from speedrun.engine import checkpoint
from speedrun.engine.loop import Session
from speedrun.engine.runtime import compiled_graphs, resolve_runtime
from speedrun.models import build_model
from speedrun.optim import AdamW, build_optimizer
from speedrun.optim.orthogonal import OptimizerList
from speedrun.optim.params import block_of, blocks, head_of, step_lr
from speedrun.recipe import FinetuneConfig, OptimConfig, RuntimeConfig, load_recipe


def tensors(seed, *shapes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen) for s in shapes]


SHAPES = [(4, 3, 3, 3), (6, 5), (6,), (5,)]
LRS = [1e-3, 3e-3, 2e-3, 5e-4, 0.0, 1e-3]           # a schedule's multipliers of the peak LR, one per step


def pair(wd: float, lr: float = 1.0):
    """The same four tensors under speedrun's AdamW and torch's: a decayed group (the 4-D and
    2-D weights) and an undecayed one (the 1-D ones, as biases and norms are by default), the
    second at half the first's LR (as a block under layer decay)."""
    ws = tensors(0, *SHAPES)
    ours = [nn.Parameter(w.clone()) for w in ws]
    theirs = [nn.Parameter(w.clone()) for w in ws]
    hp = dict(betas=(0.9, 0.99), eps=1e-8)
    a = AdamW([dict(params=ours[:2], weight_decay=wd, lr=lr), dict(params=ours[2:], weight_decay=0.0, lr=lr / 2)],
              lr, **hp)
    b = torch.optim.AdamW([dict(params=theirs[:2], weight_decay=wd, lr=lr),
                           dict(params=theirs[2:], weight_decay=0.0, lr=lr / 2)], lr=lr, **hp)
    return ours, theirs, a, b


def give(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adamw_steps_as_torch_adamw_with_a_changing_lr(wd):
    """step(): each group's lr set as a schedule sets it, six steps; the bias corrections
    counted on the device match torch's host counter."""
    ours, theirs, a, b = pair(wd)
    for t, lr in enumerate(LRS):
        grads = tensors(10 + t, *SHAPES)
        for opt in (a, b):
            for i, g in enumerate(opt.param_groups):
                g["lr"] = lr if i == 0 else lr / 2
        give(ours, grads)
        give(theirs, grads)
        a.step()
        b.step()
        for x, y in zip(ours, theirs):
            torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-7)
    assert all(float(g["state"]["step"]) == len(LRS) for g in a.param_groups)
    moved = [(x.detach() - w).abs().max() for x, w in zip(ours, tensors(0, *SHAPES))]
    assert min(moved) > 1e-3                                      # (the updates are not vanishingly small)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_the_training_steps_update_with_device_hyperparameters_is_torch_adamw(wd):
    """update(): the schedule's multiplier as a 0-d tensor times each group's base_lr, a
    momentum from a schedule ignored (the betas stay), as the training step calls it."""
    ours, theirs, a, b = pair(wd, lr=2e-3)
    for t, mult in enumerate([0.2, 1.0, 0.6, 0.07, 0.5]):
        grads = tensors(20 + t, *SHAPES)
        for i, g in enumerate(b.param_groups):
            g["lr"] = 2e-3 * mult * (1 if i == 0 else 0.5)
        give(ours, grads)
        give(theirs, grads)
        a.update(torch.tensor(mult), torch.tensor(0.85))
        b.step()
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-7)


def test_the_compiled_update_equals_the_eager_one_and_never_recompiles():
    """The update traced by dynamo (aot_eager, as the matrix compiles it) over steps whose LR
    changes: one graph with no break (fullgraph), compiled once, the same weights as the eager
    update."""
    ws = tensors(1, *SHAPES)
    eager, traced = ([nn.Parameter(w.clone()) for w in ws] for _ in range(2))
    opts = [AdamW([dict(params=ps[:2], weight_decay=0.05), dict(params=ps[2:], weight_decay=0.0, lr=5e-4,
                                                                   base_lr=5e-4)], 1e-3) for ps in (eager, traced)]
    torch._dynamo.reset()
    update = torch.compile(opts[1].update, backend="aot_eager", dynamic=False, fullgraph=True)
    graphs = []
    for t, mult in enumerate([0.2, 1.0, 0.5, 0.1]):
        grads = tensors(30 + t, *SHAPES)
        give(eager, grads)
        give(traced, grads)
        opts[0].update(torch.tensor(mult))
        before = compiled_graphs()
        update(torch.tensor(mult))
        graphs.append(compiled_graphs() - before)
    assert graphs[0] >= 1 and graphs[1:] == [0, 0, 0]
    for x, y in zip(eager, traced):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-8)


def test_the_state_round_trips_through_a_checkpoint_and_continues_bit_for_bit():
    ws, grads = tensors(2, *SHAPES), [tensors(40 + t, *SHAPES) for t in range(4)]
    whole = [nn.Parameter(w.clone()) for w in ws]
    opt = AdamW(whole, 1e-3, weight_decay=0.05)
    for g in grads:
        give(whole, g)
        opt.update(torch.tensor(0.5))
    cut = [nn.Parameter(w.clone()) for w in ws]
    first = AdamW(cut, 1e-3, weight_decay=0.05)
    for g in grads[:2]:
        give(cut, g)
        first.update(torch.tensor(0.5))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = AdamW(cut, 1e-3, weight_decay=0.05)                  # (a new process: fresh state)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    for g in grads[2:]:
        give(cut, g)
        second.update(torch.tensor(0.5))
    assert all(torch.equal(a, b) for a, b in zip(whole, cut))
    assert float(second.param_groups[0]["state"]["step"]) == 4


# ------------------------------------------------------------------------------------------
# The recipe: defaults and units
# ------------------------------------------------------------------------------------------

def _by_role(opt) -> dict:
    return {g["name"]: g for g in opt.param_groups}


def test_adamw_leaves_biases_and_norms_undecayed_by_default_and_the_others_keep_theirs():
    net = build_model(load_recipe("dawnbench-resnet18", ["model.width=8"]).model, 3, 10)
    adamw = load_recipe("dawnbench-resnet18", ["optim.name=adamw", "optim.lr=1e-3", "optim.weight_decay=0.05"])
    assert adamw.optim.no_decay_bias_norm is True and adamw.optim.eps == 1e-8
    groups = _by_role(build_optimizer(net, adamw.optim, 256))
    assert {k: g["weight_decay"] for k, g in groups.items()} == {
        "weight": 0.05, "bias": 0.0, "norm_weight": 0.0, "norm_bias": 0.0}
    decayed = adamw.with_values({"optim.no_decay_bias_norm": False})
    assert all(g["weight_decay"] == 0.05 for g in build_optimizer(net, decayed.optim, 256).param_groups)
    # the resolved values are written into config.toml, which reads back the same
    assert load_recipe("dawnbench-resnet18", ["optim.name=adamw", "optim.lr=1e-3"]).to_toml().count(
        "no_decay_bias_norm = true") == 1
    for name in ("sgd", "lars", "lamb"):
        cfg = OptimConfig(name=name, lr=1.0, ref_batch=256)
        assert cfg.no_decay_bias_norm is False and cfg.eps == 1e-6, name
    assert OptimConfig(name="adamw", lr=1e-3, ref_batch=256, eps=1e-6, no_decay_bias_norm=False).eps == 1e-6


@pytest.mark.parametrize("scaling, scale", [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_adamw_lr_is_adams_per_step_lr_at_ref_batch_and_its_decay_torchs_coefficient(scaling, scale):
    cfg = OptimConfig(name="adamw", lr=1e-3, ref_batch=256, lr_scaling=scaling, momentum=0.8, weight_decay=0.05,
                      norm_bias_lr_mult=2.0)
    opt = build_optimizer(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2)),
                          cfg, 1024)
    assert type(opt) is AdamW and step_lr(cfg, 1024) == pytest.approx(1e-3 * scale)   # not momentum-normalised
    g = _by_role(opt)
    assert g["weight"]["lr"] == pytest.approx(1e-3 * scale) and g["weight"]["weight_decay"] == 0.05
    assert g["norm_bias"]["lr"] == pytest.approx(2e-3 * scale) and g["norm_bias"]["weight_decay"] == 0.0
    assert all(x["betas"] == (0.9, 0.999) and x["eps"] == 1e-8 for x in opt.param_groups)


# ------------------------------------------------------------------------------------------
# Layer-wise LR decay
# ------------------------------------------------------------------------------------------

def _block_mults(opt, cfg) -> dict[int, float]:
    """Each parameter's LR multiplier (by id) with its role's multiplier divided out."""
    roles = {"norm_bias": cfg.norm_bias_lr_mult, "whiten_bias": cfg.whiten_bias_lr_mult}
    return {id(p): g["lr_mult"] / roles.get(g["name"], 1.0) for g in opt.param_groups for p in g["params"]}


SPEEDNET_BLOCKS = {"features.0.": 0, "features.2.0.": 1, "features.2.1.": 2, "features.3.0.": 3, "features.3.1.": 4,
                   "features.4.0.": 5, "features.4.1.": 6, "head.": 7}
RESNET18_BLOCKS = {"stem.": 0, "stages.0.0.": 1, "stages.0.1.": 2, "stages.1.0.": 3, "stages.1.1.": 4, "stages.2.0.": 5,
                   "stages.2.1.": 6, "stages.3.0.": 7, "stages.3.1.": 8, "final.": 9, "head.": 10}


@pytest.mark.parametrize("recipe, sets, table", [
    ("cifar10-94", ["model.widths=[8,16,16]"], SPEEDNET_BLOCKS),
    ("dawnbench-resnet18", ["model.width=8"], RESNET18_BLOCKS)], ids=["speednet", "resnet18"])
@pytest.mark.parametrize("name", ["sgd", "lars", "lamb", "adamw"])
def test_layer_decay_gives_each_block_its_power_of_the_decay(recipe, sets, table, name):
    """0.75 ** (depth - block) for each block of the speed net (whitening, six conv layers, the
    classifier) and of a ResNet-18 (stem, eight residual blocks, the final norm, the
    classifier), with every optimizer; the groups' LRs follow, and the role multipliers
    apply on top."""
    lr = {"sgd": 2.0, "lars": 2.0}.get(name, 1e-3)
    r = load_recipe(recipe, [*sets, f"optim.name={name}", f"optim.lr={lr}", "optim.layer_decay=0.75"])
    model = build_model(r.model, 3, 10)
    opt = build_optimizer(model, r.optim, r.data.batch_size)
    depth = max(table.values())
    mults = _block_mults(opt, r.optim)
    names = dict(model.named_parameters())
    for n, p in names.items():
        if not p.requires_grad and id(p) not in mults:
            continue                                          # (the whitening filters: fixed)
        block = next(b for prefix, b in table.items() if n.startswith(prefix))
        assert mults[id(p)] == pytest.approx(0.75 ** (depth - block), rel=1e-12), n
        assert block_of(model)[id(p)] == block, n
    head = [g for g in opt.param_groups if any(id(p) in head_of(model) for p in g["params"])]
    assert head and all(g["lr_mult"] == 1.0 and g["base_lr"] == pytest.approx(step_lr(r.optim, r.data.batch_size))
                        for g in head if g["name"] == "weight")
    for g in opt.param_groups:                                   # lr = per-step lr x role x block
        assert g["base_lr"] == pytest.approx(step_lr(r.optim, r.data.batch_size) * g["lr_mult"]), g["name"]
    off = build_optimizer(model, r.optim.model_copy(update={"layer_decay": 1.0}), r.data.batch_size)
    assert sorted(g["name"] for g in off.param_groups) == sorted({g["name"] for g in off.param_groups})


def test_layer_decay_reaches_the_orthogonal_filters_block_by_block_and_leaves_their_decay_as_it_was():
    r = load_recipe("cifar10-94-fast", ["model.widths=[8,16,16]", "optim.layer_decay=0.5", "optim.filter_norm_every=0",
                                        "optim.filter_weight_decay=0.01"])
    model = build_model(r.model, 3, 10)
    opt = build_optimizer(model, r.optim, r.data.batch_size)
    assert isinstance(opt, OptimizerList)
    filters = [g for g in opt.param_groups if g["name"] == "filters"]
    block, names = block_of(model), {id(p): n for n, p in model.named_parameters()}
    assert len(filters) == 6                                      # one per conv layer of the speed net
    for g in filters:
        (p,) = g["params"]
        assert g["lr"] == pytest.approx(r.optim.filter_lr * 0.5 ** (7 - block[id(p)])), names[id(p)]
        # the decay per step at multiplier 1 is the field's, whatever the block's LR
        assert g["lr"] * g["weight_decay"] == pytest.approx(0.01 * step_lr(r.optim, r.data.batch_size) / r.optim.lr)


def test_a_held_group_stays_as_it_was_under_head_only_and_moves_once_released():
    """Fine-tuning's head epochs with AdamW and layer decay: every group but the classifier
    (and the batch norms, which train with it) is held at LR 0 by the device flag, to the bit,
    decay included; released, the held groups move."""
    r = load_recipe("dawnbench-resnet18", ["model.width=8", "optim.name=adamw", "optim.lr=1e-3",
                                           "optim.weight_decay=0.05", "optim.layer_decay=0.7"])
    model = build_model(r.model, 3, 10)
    opt = build_optimizer(model, r.optim, 64, finetune=FinetuneConfig(head_epochs=1))
    held = [p for g in opt.param_groups if g["held"] for p in g["params"]]
    free = [p for g in opt.param_groups if not g["held"] for p in g["params"]]
    assert held and free and {id(p) for p in free} >= head_of(model)
    before = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(0)
    for now in (True, True, False):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.update(torch.tensor(1.0), head_only=torch.tensor(now))
        if now:
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before) if any(p is h for h in held))
    after = dict(zip(map(id, model.parameters()), before))
    assert all(not torch.equal(p.detach(), after[id(p)]) for p in held)
    assert all(not torch.equal(p.detach(), after[id(p)]) for p in free)


def test_layer_decay_and_lr_first_are_one_rule():
    """lr_first = layer_decay ** depth gives the same multipliers: the recipe takes one or the
    other (test_failures.py refuses both)."""
    r = load_recipe("dawnbench-resnet18", ["model.width=8", "optim.layer_decay=0.8"])
    model = build_model(r.model, 3, 10)
    by_decay = _block_mults(build_optimizer(model, r.optim, 64), r.optim)
    tuned = r.optim.model_copy(update={"layer_decay": 1.0})
    by_first = _block_mults(build_optimizer(model, tuned, 64, finetune=FinetuneConfig(lr_first=0.8 ** 10)), tuned)
    assert by_decay.keys() == by_first.keys()
    assert all(by_decay[k] == pytest.approx(by_first[k], rel=1e-9) for k in by_decay)


class Declared(nn.Module):
    """A network of the user's that names its own blocks (in an order the structural rule
    would not find: the classifier is built first)."""

    def __init__(self, blocks_fn=None):
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.body = nn.Conv2d(4, 8, 3)
        self.stem = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(8)
        self.blocks_fn = blocks_fn

    def speedrun_blocks(self):
        return self.blocks_fn(self) if self.blocks_fn else [self.stem, [*self.body.parameters(),
                                                                         *self.norm.parameters()], self.head]


def test_a_model_that_names_its_blocks_is_taken_at_its_word_and_checked():
    model = Declared()
    assert blocks(model)[id(model.head.weight)] == 0                    # the structural rule: order of definition
    block = block_of(model)
    assert [block[id(p)] for p in (model.stem.weight, model.body.bias, model.norm.weight, model.head.bias)] == \
        [0, 1, 1, 2]
    cfg = OptimConfig(name="adamw", lr=1e-3, ref_batch=64, layer_decay=0.5)
    mults = _block_mults(build_optimizer(model, cfg, 64), cfg)
    assert mults[id(model.stem.weight)] == 0.25 and mults[id(model.norm.bias)] == 0.5 and \
        mults[id(model.head.weight)] == 1.0
    with pytest.raises(ValueError, match="stem.weight, stem.bias are in no block"):
        block_of(Declared(lambda m: [[*m.body.parameters(), *m.norm.parameters()], m.head]))
    with pytest.raises(ValueError, match="head.weight is in blocks 1 and 2"):
        block_of(Declared(lambda m: [m.stem, [m.head.weight, *m.body.parameters(), *m.norm.parameters()], m.head]))


# ------------------------------------------------------------------------------------------
# A real run's checkpoint
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(fashion):
    return dataclasses.replace(fashion, train_x=fashion.train_x[:512], train_y=fashion.train_y[:512],
                               test_x=fashion.test_x[:64], test_y=fashion.test_y[:64])


def test_a_run_resumed_from_a_mid_epoch_checkpoint_ends_with_the_uninterrupted_weights(tiny, tmp_path):
    """AdamW's moments and step counters, with layer decay's groups, in a real checkpoint of a
    speed-net run (fp32, eager) written after step 5 of 8: the run continued from it ends
    with the weights of the run that wrote it, bit for bit."""
    recipe = load_recipe("fashion-mnist", ["model.widths=[8,16,16]", "data.batch_size=64", "train.epochs=1",
                                           "optim.name=adamw", "optim.lr=2e-3", "optim.norm_bias_lr_mult=1.0",
                                           "optim.weight_decay=0.05", "optim.layer_decay=0.8",
                                           "checkpoint.every_steps=5", "eval.tta=none"])
    runtime = dataclasses.replace(resolve_runtime(RuntimeConfig(), torch.device("cpu")), precision="fp32")
    session = Session(recipe, tiny, runtime)
    assert isinstance(session.step.opt, AdamW) and len(session.step.opt.param_groups) > 5
    whole = session.run(checkpoint_dir=tmp_path)
    state = checkpoint.load(tmp_path)
    assert state["step"] == 5 and whole.steps == 8
    resumed = session.run(resume=state)
    assert resumed.resumed_from_step == 5
    assert whole.state_dict.keys() == resumed.state_dict.keys()
    assert all(torch.equal(whole.state_dict[k], resumed.state_dict[k]) for k in whole.state_dict)
