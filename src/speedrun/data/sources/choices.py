"""What the ``folder`` recipe chooses from the data it is given.

The rules look only at what the images are (their size, how many there are), never at which
data set they come from, and every choice is an ordinary recipe field: a field the user set
with ``--set`` is kept as given. The decision and its reasons are said at the start of the run
and kept in its summary.

- **Photos** (median shorter side of at least ``PHOTO_SIDE`` px): the settings of the shipped
  photo recipe (``PHOTO_RECIPE``: a ResNet with the Bag-of-Tricks tweaks, random-resized crops,
  progressive resizing), trained at ``PHOTO_TRAIN_SIDE`` px or 0.8 of the images' side where
  they are smaller, and evaluated a quarter larger (Touvron et al., 2019: random-resized crops
  make objects look larger in training than in a centre crop, so testing at a higher
  resolution matches their apparent size), from a decoded cache.
- **Small images**: the recipe's own speed net at the images' size (up to 224 px).
- **A small folder**: the batch is halved (down to 16) until an epoch has at least four steps.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

PHOTO_SIDE = 96
"""Median shorter side (px) from which a folder is treated as photos."""
PHOTO_TRAIN_SIDE = 128
"""Training side (px) for photos: the Imagenette leaderboard's smallest size, a budget that
two CPU cores train five epochs of 10,000 images in within minutes."""
EVAL_OVER_TRAIN = 1.25
"""Evaluation side over training side for random-resized-crop training."""
PHOTO_RECIPE = "imagenette"
"""The shipped recipe whose model, augmentation, optimizer, schedule and training sections
photos get."""
PHOTO_SECTIONS = ("augment", "model", "optim", "schedule", "averaging", "train", "eval")
FINETUNE_RECIPE = "finetune"
"""The shipped recipe whose optimizer, schedule, averaging, training and fine-tuning sections a
folder gets with weights to start from."""
FINETUNE_SECTIONS = ("optim", "schedule", "averaging", "train", "finetune")
PHOTO_DATA_FIELDS = ("batch_size", "progressive", "cache")
MIN_STEPS_PER_EPOCH = 4
MIN_BATCH = 16


def nearest_multiple(x: float, k: int = 8) -> int:
    """The multiple of ``k`` nearest to ``x``, at least ``k`` (image sizes)."""
    return max(k, int(round(x / k)) * k)


def small_image_size(median_side: int) -> int:
    """Training size of small images: their median shorter side, a multiple of 8, at most 224."""
    return min(224, nearest_multiple(median_side))


def default_eval_crop(size: int) -> float:
    """Centre crop fraction for evaluation: whole images up to 64 px, 0.875 above."""
    return 1.0 if size <= 64 else 0.875


@dataclass
class Choices:
    """Recipe values chosen from the data (by dotted field name), and the reasons, one per choice."""
    values: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    sections: dict = field(default_factory=dict)      # whole sections to replace (photos); None: to remove

    def line(self) -> str:
        return "; ".join(self.reasons)


def small_folder_batch(n_train: int, batch: int) -> int:
    """The batch for ``n_train`` training images: halved (not below 16, nor above the set)
    until an epoch has at least four steps."""
    while batch > MIN_BATCH and batch * MIN_STEPS_PER_EPOCH > n_train:
        batch //= 2
    return max(1, min(batch, n_train))


def shipped(name: str) -> dict:
    text = (resources.files("speedrun") / "recipes" / f"{name}.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def photo_recipe() -> dict:
    return shipped(PHOTO_RECIPE)


def choose(median_side: int, n_train: int, n_classes: int, batch_size: int) -> Choices:
    """The folder recipe's choices for images whose median shorter side is ``median_side``."""
    c = Choices()
    if median_side >= PHOTO_SIDE:
        preset = photo_recipe()
        # a section the photo recipe leaves out takes the defaults (None: removed), not the folder recipe's
        c.sections = {k: preset.get(k) for k in PHOTO_SECTIONS}
        train = min(PHOTO_TRAIN_SIDE, nearest_multiple(0.8 * median_side))
        evaluate = min(nearest_multiple(median_side), nearest_multiple(EVAL_OVER_TRAIN * train))
        data = preset["data"]
        c.values.update({f"data.{k}": data[k] for k in PHOTO_DATA_FIELDS if k in data})
        c.values.update({"data.image_size": train, "data.eval_size": evaluate, "data.eval_crop": 1.0})
        model = preset["model"]
        net = f"ResNet-{model.get('depth', 50)}{model.get('variant', 'a').upper()}"
        if preset.get("optim", {}).get("filters") == "orthogonal":
            net += " with orthogonalised filter updates"
        c.reasons.append(f"photos (median shorter side {median_side} px >= {PHOTO_SIDE}): {net} as in the "
                         f"{PHOTO_RECIPE} recipe, random-resized crops trained at {train} px"
                         + (" (progressive from smaller)" if data.get("progressive") else "")
                         + f", evaluated at {evaluate} px")
        batch = data.get("batch_size", batch_size)
    else:
        size = small_image_size(median_side)
        c.values.update({"data.image_size": size, "data.eval_crop": default_eval_crop(size)})
        c.reasons.append(f"small images (median shorter side {median_side} px < {PHOTO_SIDE}): the speed net "
                         f"at {size} px")
        batch = batch_size
    fitted = small_folder_batch(n_train, batch)
    if fitted != batch:
        c.values["data.batch_size"] = fitted
        c.reasons.append(f"batch {fitted} for {n_train} training images (at least {MIN_STEPS_PER_EPOCH} steps "
                         "an epoch)")
    c.reasons.append(f"{n_classes} classes")
    return c



def your_network(reason: str, name: str) -> str:
    """A reason of :func:`choose` with the network it names replaced by yours (``model.name``
    set to another kind): the data then chooses the sizes, batch and training, not the network."""
    yours = f"your network (model.name={name})"
    if reason.startswith("small images"):
        return reason.replace(": the speed net at", f": {yours} at")
    if reason.startswith("photos"):
        head, _, rest = reason.partition("): ")
        net, _, tail = rest.partition(" as in the ")
        return f"{head}): {yours} with the training of the {tail}" if tail else reason
    return reason


def choose_finetune(start: dict, median_side: int, n_train: int, n_classes: int,
                    size_as_set: int | None = None) -> Choices:
    """The folder recipe's choices for weights to start from (``start``: their [model] section
    as ``model``, the sides they were trained and evaluated at as ``image_size`` and
    ``eval_size`` where known, a line naming them as ``description``): the data's own choices
    of augmentation and evaluation (:func:`choose`), the network of the weights, the
    fine-tuning recipe's optimizer, schedule, training and batch, and the weights' sizes.
    ``size_as_set``: the training size the user set (``data.image_size``), which the line then names."""
    preset = shipped(FINETUNE_RECIPE)
    c = choose(median_side, n_train, n_classes, preset["data"]["batch_size"])   # (photos: the photo recipe's)
    if median_side < PHOTO_SIDE and "data.batch_size" not in c.values:
        c.values["data.batch_size"] = preset["data"]["batch_size"]
    c.sections.update({k: preset.get(k) for k in FINETUNE_SECTIONS})
    c.sections["model"] = start["model"]
    c.values.pop("data.progressive", None)
    trained, evaluated = start.get("image_size"), start.get("eval_size")
    if trained:
        c.values["data.image_size"] = trained
        if "data.eval_size" in c.values:
            c.values["data.eval_size"] = max(trained, evaluated or trained)
    if median_side < PHOTO_SIDE:
        c.sections["augment"] = preset.get("augment")
        c.sections["eval"] = preset.get("eval")
        # (the network is the weights', not the speed net the data alone would have chosen)
        c.reasons = [r.split(": the speed net at")[0] if r.startswith("small images") else r for r in c.reasons]
        c.values["data.eval_crop"] = default_eval_crop(c.values["data.image_size"])
    crop = start.get("eval_crop")
    if crop and median_side >= PHOTO_SIDE:          # (small images are evaluated whole)
        c.values["data.eval_crop"] = crop
    sizes = (f"at {size_as_set} px as set (data.image_size)" if size_as_set else
             f"at {trained} px, as the weights were trained" if trained else "at the data's size") + (
        f", evaluated on centre crops of {crop:g} of the images as they were" if crop and median_side >= PHOTO_SIDE
        else "")
    c.reasons.insert(0, f"fine-tuning {start['description']} {sizes} (the {FINETUNE_RECIPE} recipe's schedule: "
                     f"the classifier alone for {preset['finetune']['head_epochs']} epochs, then the whole network)")
    return c
