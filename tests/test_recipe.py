import pytest

from speedrun.recipe import (Recipe, RecipeError, load_recipe, parse_override, recipe_from_dict,
                             shipped_recipes, total_steps)


def test_every_shipped_recipe_validates():
    names = shipped_recipes()
    assert {"cifar10-94", "fashion-mnist", "page-resnet9", "dawnbench-resnet18"} <= set(names)
    for name in names:
        r = load_recipe(name)
        assert r.name == name
        assert r.description


def test_cifar10_94_is_at_most_ten_epochs_and_targets_94():
    r = load_recipe("cifar10-94")
    assert r.train.epochs <= 10 and r.target == 0.94


def test_resolved_recipe_round_trips_through_toml(tmp_path):
    r = load_recipe("cifar10-94", ["optim.lr=7.5", "model.widths=[32, 64, 64]"])
    path = tmp_path / "config.toml"
    path.write_text(r.to_toml())
    again = load_recipe(str(path))
    assert again == r and again.digest() == r.digest()
    assert again.optim.lr == 7.5 and again.model.widths == [32, 64, 64]


def test_override_values_are_toml_and_bare_words_are_strings():
    assert parse_override("optim.lr=0.5") == (["optim", "lr"], 0.5)
    assert parse_override("model.widths=[8, 16]") == (["model", "widths"], [8, 16])
    assert parse_override("eval.tta=flip") == (["eval", "tta"], "flip")
    assert parse_override("optim.nesterov=false") == (["optim", "nesterov"], False)
    with pytest.raises(RecipeError, match="key=value"):
        parse_override("optim.lr")


def test_bad_value_names_the_field():
    with pytest.raises(RecipeError) as err:
        load_recipe("cifar10-94", ["optim.lr=-1"])
    assert "'optim.lr'" in str(err.value) and "-1" in str(err.value)
    with pytest.raises(RecipeError, match="'eval.tta'"):
        load_recipe("cifar10-94", ["eval.tta=sideways"])
    with pytest.raises(RecipeError, match="'model.norm.momentum'"):
        load_recipe("cifar10-94", ["model.norm.momentum=2"])


def test_unknown_field_is_named_with_a_suggestion():
    with pytest.raises(RecipeError) as err:
        load_recipe("cifar10-94", ["optim.lrr=1"])
    msg = str(err.value)
    assert "unknown recipe field 'optim.lrr'" in msg and "did you mean 'optim.lr'" in msg
    with pytest.raises(RecipeError, match="unknown recipe field 'model.whiten.kernal'"):
        load_recipe("cifar10-94", ["model.whiten.kernal=3"])
    with pytest.raises(RecipeError, match="unknown recipe field 'model.depth'"):
        load_recipe("cifar10-94", ["model.depth=18"])   # a resnet field on a speednet


def test_missing_field_and_cross_field_checks():
    raw = load_recipe("fashion-mnist").to_dict()
    del raw["optim"]["lr"]
    with pytest.raises(RecipeError, match="'optim.lr' is required"):
        recipe_from_dict(raw)
    with pytest.raises(RecipeError, match="ghost_batch=48 must divide the micro-batch"):
        load_recipe("fashion-mnist", ["model.norm.ghost_batch=48"])
    with pytest.raises(RecipeError, match="knots must start at 0 and end at 1"):
        load_recipe("fashion-mnist", ["schedule.knots=[0.1, 0.5, 1.0]"])
    with pytest.raises(RecipeError, match="convs has 2 entries but widths has 3"):
        load_recipe("fashion-mnist", ["model.convs=[1, 1]"])


def test_unknown_recipe_name_suggests_a_shipped_one():
    with pytest.raises(RecipeError, match="did you mean 'cifar10-94'"):
        load_recipe("cifar10-49")


def test_bad_toml_file_is_named(tmp_path):
    bad = tmp_path / "mine.toml"
    bad.write_text("name = \n")
    with pytest.raises(RecipeError, match="mine.toml: not valid TOML"):
        load_recipe(str(bad))


def test_partial_last_epoch_counts_steps():
    r = load_recipe("cifar10-94")
    assert total_steps(r, 50_000) == 476      # ceil(9.9 * 48), as airbench94
    assert isinstance(r, Recipe)


def test_filter_decay_that_renormalisation_would_undo_is_refused():
    """With the filters' norms reset every step, decay on them does nothing: asking for it is
    an error naming the field; with norms reset less often it is accepted."""
    with pytest.raises(RecipeError, match="optim.filter_weight_decay has no effect with optim.filter_norm_every = 1"):
        load_recipe("cifar10-94-fast", ["optim.filter_weight_decay=0.01"])
    r = load_recipe("cifar10-94-fast", ["optim.filter_weight_decay=0.01", "optim.filter_norm_every=4"])
    assert r.optim.filter_weight_decay == 0.01
    assert load_recipe("cifar10-94-fast").optim.filter_weight_decay == 0


def test_options_without_a_meaning_are_gone():
    """data.pipeline had one legal value per dataset kind; channels_last 'auto' always meant on."""
    with pytest.raises(RecipeError, match="unknown recipe field 'data.pipeline'"):
        load_recipe("fashion-mnist", ["data.pipeline=resident"])
    with pytest.raises(RecipeError, match="'runtime.channels_last'"):
        load_recipe("fashion-mnist", ["runtime.channels_last=auto"])
    assert load_recipe("fashion-mnist", ["runtime.channels_last=false"]).runtime.channels_last is False


def test_filter_decay_shrinks_filters_between_norm_resets():
    """optim.filter_weight_decay is applied (decoupled, following the schedule) on the steps
    between resets: with resets every 4 steps and no gradient, 3 steps shrink each filter."""
    import torch
    import torch.nn as nn
    from speedrun.optim import build_optimizer
    from speedrun.recipe import OptimConfig
    net = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.Flatten(), nn.Linear(8, 2))
    cfg = OptimConfig(lr=10.0, ref_batch=1024, momentum=0.85, filters="orthogonal", filter_norm_every=4,
                      filter_weight_decay=0.05, weight_decay=0.0)
    opt = build_optimizer(net, cfg, 1024)
    w = net[0].weight
    w.data.mul_(8 ** 0.5 / w.norm())                        # at the reset norm
    before = w.detach().clone()
    for _ in range(3):
        w.grad = torch.zeros_like(w)
        net[2].weight.grad = torch.zeros_like(net[2].weight)
        net[2].bias.grad = torch.zeros_like(net[2].bias)
        opt.step()
    per_step = 0.05 * (1 - 0.85)                             # decoupled decay per step at multiplier 1
    assert torch.allclose(w.detach(), before * (1 - per_step) ** 3, rtol=1e-5)


def test_with_values_sets_python_values_and_checks_them_as_a_loaded_recipe_is():
    r = load_recipe("fashion-mnist", ["optim.lr=7.5"])
    before = r.to_dict()
    path = 'C:\\my "data" \\ it\'s'                       # no --set text could carry it back unchanged
    new = r.with_values({"data.batch_size": 128, "model.norm.momentum": 0.5, "data.path": path,
                         "augment.rrc_scale": (0.25, 1.0)})
    assert new.data.batch_size == 128 and new.model.norm.momentum == 0.5 and new.data.path == path
    assert new.augment.rrc_scale == (0.25, 1.0) and new.optim.lr == 7.5
    assert r.to_dict() == before and new is not r                            # the original is left as it was
    assert new._overrides == ["optim.lr=7.5"] and new._overrides is not r._overrides
    assert r.with_values({}) == r
    with pytest.raises(RecipeError) as err:
        r.with_values({"optim.lrr": 1.0})
    assert "fashion-mnist: unknown recipe field 'optim.lrr'; did you mean 'optim.lr'" in str(err.value)
    with pytest.raises(RecipeError, match=r"mine: bad recipe value for 'model.norm.momentum' \(got 2\)"):
        r.with_values({"model.norm.momentum": 2}, source="mine")
    with pytest.raises(RecipeError, match="'eval.tta'"):
        r.with_values({"eval.tta": "sideways"})
    with pytest.raises(RecipeError, match="ghost_batch=48 must divide the micro-batch"):   # cross-field checks
        r.with_values({"model.norm.ghost_batch": 48})
    with pytest.raises(RecipeError, match="give exactly one of data.batch_size and data.per_device_batch"):
        r.with_values({"data.per_device_batch": 64})
    with pytest.raises(RecipeError, match="fashion-mnist: data.batch_size.x: 'batch_size' is a value, not a section"):
        r.with_values({"data.batch_size.x": 1})
    assert r.to_dict() == before


# A setting of a trick that is off does nothing; a user sweeping it would time a no-op.
NO_OPS = [
    ("cifar10-94-fast", ["augment.low_res=bilinear_in_step"], "augment.low_res = bilinear_in_step", "data.progressive"),
    ("cifar10-94-fast", ["augment.low_res=crop"], "augment.low_res = crop", "data.progressive"),
    ("imagenet-resnet50", ["eval.tta_fraction=0.25"], "eval.tta_fraction = 0.25", "eval.tta = 'none'"),
    ("cifar10-94", ["optim.filter_lr=0.3", "optim.ns_steps=5"], "optim.filter_lr = 0.3, optim.ns_steps = 5",
     "optim.filters = 'same'"),
    ("imagenet-resnet50", ["averaging.decay=0.9"], "averaging.decay = 0.9", "averaging.kind = 'none'"),
    ("page-resnet9", ["averaging.power=2.0"], "averaging.power = 2.0", "averaging.kind = ema"),
    ("dawnbench-resnet18", ["model={name='speednet', widths=[8, 16, 16], whiten={eps=0.01}}"],
     "model.whiten.eps = 0.01", "model.whiten.kernel = 0"),
]


@pytest.mark.parametrize("recipe, sets, field, needs", NO_OPS, ids=[s[0] for _, s, _, _ in NO_OPS])
def test_a_setting_that_does_nothing_is_refused_naming_what_it_needs(recipe, sets, field, needs, cli, tmp_path,
                                                                     monkeypatch):
    from test_failures import assert_unchanged, check_refused, snapshot
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    args = [a for s in sets for a in ("--set", s)]
    err = check_refused(cli("train", recipe, *args, "--data-dir", tmp_path / "data", "--out", tmp_path / "run"),
                        2, field, needs, "does nothing")
    assert err.count("\n") == 1
    assert_unchanged(tmp_path, before)


def test_a_trick_turned_off_keeps_its_settings_and_a_trick_turned_on_uses_them():
    """The switch turned off by the recipe (an ablation) leaves the trick's settings as they
    were; with the switch on, the same settings load; a value at its default is never refused."""
    assert load_recipe("cifar10-94-fast", ["eval.tta=none"]).eval.tta_fraction == 0.25
    assert load_recipe("cifar10-94-fast", ["optim.filters=same"]).optim.filter_lr == 0.24
    assert load_recipe("cifar10-94", ["averaging.kind=none"]).averaging.decay != 0.95
    assert load_recipe("cifar10-94", ["model.whiten.kernel=0"]).model.whiten.train_bias_epochs == 3
    assert load_recipe("imagenet-resnet50", ["eval.tta=flip", "eval.tta_fraction=0.25"]).eval.tta_fraction == 0.25
    assert load_recipe("cifar10-94-fast", ["augment.low_res=bilinear_in_step",
                                           "data.progressive=[[0.0, 0.75], [0.5, 1.0]]"]).augment.low_res \
        == "bilinear_in_step"
    assert load_recipe("imagenet-resnet50", ["eval.tta_fraction=1.0", "averaging.decay=0.95"]).eval.tta == "none"
    again = load_recipe("cifar10-94-fast", ["eval.tta=none"])                     # a run's config.toml loads again
    assert recipe_from_dict(again.to_dict()) == again
