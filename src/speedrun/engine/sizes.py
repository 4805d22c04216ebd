"""The image sizes a run trains at: progressive resizing (``data.progressive``), epoch by
epoch and step by step, and where the resizing happens."""
from __future__ import annotations

import math

from ..data.sources.choices import nearest_multiple
from ..recipe import Recipe


def epoch_image_side(recipe: Recipe, epoch: int, full: int) -> int:
    """Training image side in px for ``epoch`` under progressive resizing (``full``, the full
    side, without it): a multiple of 8 px, or of 4 px for images under 64 px, where steps of 8
    are too coarse (a 32 px image trains at 24 and 28 px, as in the 2026 CIFAR-10 record)."""
    if not recipe.data.progressive:
        return full
    frac = epoch / recipe.train.epochs
    scale = [s for f, s in recipe.data.progressive if f <= frac][-1]
    return full if scale == 1 else nearest_multiple(full * scale, 4 if full < 64 else 8)


def step_image_shapes(recipe: Recipe, full: tuple[int, int], total: int, spe: int) -> list[tuple[int, int]]:
    """The (height, width) of the training batches at each of ``total`` steps, ``spe`` steps
    an epoch, of images whose full shape is ``full``."""
    shapes = []
    for e in range(math.ceil(total / spe)):
        s = epoch_image_side(recipe, e, full[0])
        shapes += [full if s == full[0] else (s, s)] * spe
    return shapes[:total]


def run_image_sides(recipe: Recipe, full: int, epochs: int) -> list[int]:
    """Every image side a run of ``epochs`` epochs trains at, smallest first."""
    return sorted({epoch_image_side(recipe, e, full) for e in range(epochs)})


def sizes_share_one_graph(recipe: Recipe, device_type: str, backend: str) -> bool:
    """Whether a compiled step serves every training size with one graph, its batches' height
    and width marked dynamic: progressive resizing in the data pipeline. Resized inside the
    step, the side is a constant of the graph (one graph a side). Not with inductor on a CPU:
    its code generation specializes the sizes again (cifar10-94-cpu on a 2-core Zen 3: 6 graphs
    compiled with the sizes marked, as many as without, against 4 under dynamo's capture
    alone), so marking them only adds a symbolic first compile."""
    cpu_inductor = device_type == "cpu" and backend == "inductor"
    return bool(recipe.data.progressive) and not resized_in_step(recipe) and not cpu_inductor


def resized_in_step(recipe: Recipe) -> bool:
    """Whether progressive resizing happens inside the training step (``augment.low_res =
    "bilinear_in_step"``) rather than in the data pipeline."""
    return bool(recipe.data.progressive) and recipe.augment.low_res == "bilinear_in_step"
