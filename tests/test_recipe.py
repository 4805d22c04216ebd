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
