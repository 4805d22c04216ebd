"""Starting a run from weights (``model.init``): the weights opened once per process, the
recipe's network made the one they were trained as, the data normalised as it was for them,
and each fresh model of the run loaded from them (the classifier replaced for the run's
classes). Opening, converting and checking the weights is :mod:`speedrun.models.pretrained`'s."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import RecipeError
from ..models import build_model
from ..models.pretrained import Pretrained, apply_weights, open_weights
from ..recipe import Recipe, apply_overrides, init_is_weights, recipe_from_dict

_opened: dict[tuple[str, str | None], Pretrained] = {}


def weights_for(recipe: Recipe) -> Pretrained | None:
    """The weights ``model.init`` names (opened on first use, then kept), or None for a scheme."""
    init = recipe.model.init
    if not init_is_weights(init):
        return None
    key = (init, recipe.data.cache_dir)
    if key not in _opened:
        _opened[key] = open_weights(init, recipe.data.cache_dir)
    return _opened[key]


def model_section(pre: Pretrained, init: str) -> dict:
    """The recipe's [model] section for these weights, naming them as its ``init``."""
    return {**pre.model, "init": init}


def start_of(recipe: Recipe) -> dict | None:
    """What the weights ``model.init`` names tell the data layer of themselves (their [model]
    section, the sides they were trained and evaluated at, a line naming them), or None."""
    pre = weights_for(recipe)
    if pre is None:
        return None
    return {"model": model_section(pre, recipe.model.init), "image_size": pre.image_size,
            "eval_size": pre.eval_size, "eval_crop": pre.eval_crop, "description": pre.description}


def settle_model(recipe: Recipe) -> tuple[Recipe, list[str]]:
    """``recipe`` with its [model] section the one its weights were trained as (the user's own
    ``--set model.*`` values applied over it), and the lines that say so; as it is without weights."""
    pre = weights_for(recipe)
    if pre is None:
        if recipe.finetune.head_epochs:
            raise RecipeError(f"{recipe.name}: finetune.head_epochs = {recipe.finetune.head_epochs} trains the "
                              "classifier alone on a network that starts from weights, and this one starts from "
                              "random ones: give the weights to start from with --set model.init=... (a speedrun run "
                              "folder, a weights file, torchvision:NAME or timm:NAME), or set finetune.head_epochs=0")
        return recipe, []
    raw = recipe.to_dict()
    section = model_section(pre, recipe.model.init)
    if pre.model.get("name") == "timm" and recipe.model.name == "timm":    # how to build it stays the recipe's
        section = {**{k: v for k, v in raw["model"].items() if k != "arch"}, **section}
    raw["model"] = section
    mine = [o for o in recipe._overrides if o.split("=", 1)[0].strip().startswith("model.")]
    settled = recipe_from_dict(apply_overrides(raw, mine), source=f"{recipe.name} with model.init={recipe.model.init}",
                               overrides=mine, over_source=True)
    settled._overrides = list(recipe._overrides)
    return settled, [f"weights to start from: {pre.description}"]


def normalise_as_trained(source, pre: Pretrained | None) -> list[str]:
    """The data normalised with the weights' own mean and std where they give them (grey data
    from colour weights: their averages), as the weights saw their training images."""
    if pre is None or pre.mean is None or pre.std is None:
        return []
    mean, std = torch.tensor(pre.mean, dtype=torch.float32), torch.tensor(pre.std, dtype=torch.float32)
    channels = source.in_channels
    if len(mean) != channels:
        mean, std = mean.mean().repeat(channels), std.mean().repeat(channels)
    source.normalisation = (mean, std)                  # (device-resident data)
    if hasattr(source, "std"):                          # (streamed folders)
        source.mean, source.std = mean, std
    shown = lambda t: "/".join(f"{v:.1f}" for v in t.tolist())
    return [f"inputs normalised as the weights were trained: mean {shown(mean)}, std {shown(std)} (0..255 units)"]


def load_into(model: nn.Module, recipe: Recipe, in_channels: int, num_classes: int,
              classes: list[str] | None = None) -> list[str]:
    """Load the run's starting weights into ``model`` (freshly built from the recipe's seed,
    whose new classifier stays where the weights' classes are not the run's); the notes of
    what was adapted. Nothing without weights."""
    pre = weights_for(recipe)
    if pre is None:
        return []
    return apply_weights(model, pre, in_channels, num_classes, classes, recipe.model)


def loaded_lines(recipe: Recipe, source) -> list[str]:
    """Load the weights once into the run's model for ``source``'s data, before anything of the
    run is written, and return what that adapts (a new classifier, a folded first layer): weights
    that do not fit end here, in one line, with nothing on disk."""
    if weights_for(recipe) is None:
        return []
    model = build_model(recipe.model, source.in_channels, source.num_classes)
    return load_into(model, recipe, source.in_channels, source.num_classes, list(source.classes))
