"""Opening the recipe's dataset, whatever it is, and the pipeline that feeds it to the engine.

Built-in sets and ``.npz`` arrays are loaded whole (uint8) and trained through the
device-resident path; image folders are streamed from disk by worker processes (decode a
folder once with ``speedrun data prepare`` to train it resident). Both pipelines offer the
engine the same methods (``epoch``, ``test_batches``, ``holdout_batches``,
``whitening_sample``, ``n_train``, ``image_size``, ``mean``/``std``, ``skipped``,
``crops_in_workers``), so it never asks which one it holds. With ``train.stop_at_target`` a
validation split is held out of the training images here, as the data is opened
(:mod:`speedrun.data.sources.holdout`). Settings
the recipe leaves to the data (``data.image_size = 0``, ``data.eval_crop = 0``) are chosen
here from a sample of the images, and written back into the recipe so the run's
``config.toml`` records the values actually used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ...recipe import Recipe, RecipeError, apply_overrides, new_network, recipe_from_dict, set_values
from ..sources.arrays import load_npz
from ...errors import DataError
from ..sources.folder import ImageList, folder_splits, probe
from ..sources.builtin import SPECS, ArrayDataset, load_dataset
from ..sources.cache import open_cached, use_cache
from ..sources.holdout import hold_out_arrays, hold_out_images
from ..sources.choices import choose, choose_finetune, default_eval_crop, small_image_size, your_network
from .resident import ResidentData
from .shard import Shard
from .stream import StreamedData, default_workers, sample_stats, start_worker_server


@dataclass
class FolderSource:
    """An image folder, split and measured, ready to stream."""
    crops_in_workers = True               # a class attribute: its pipeline crops while decoding
    train: ImageList
    val: ImageList
    channels: int
    size: int
    mean: torch.Tensor
    std: torch.Tensor
    source: str
    eval_side: int = 0
    choices: list[str] = field(default_factory=list)
    holdout: ImageList | None = None      # train.stop_at_target: training images held out, never trained on

    @property
    def eval_size(self) -> tuple[int, int]:
        side = self.eval_side or self.size
        return (side, side)

    @property
    def classes(self) -> list[str]:
        return self.train.classes

    @property
    def num_classes(self) -> int:
        return len(self.train.classes)

    @property
    def in_channels(self) -> int:
        return self.channels

    @property
    def image_size(self) -> tuple[int, int]:
        return (self.size, self.size)

    @property
    def train_y(self):
        return self.train.labels

    @property
    def test_y(self):
        return self.val.labels

    @property
    def holdout_y(self):
        return None if self.holdout is None else self.holdout.labels


def size_as_set(user: list[str] | None) -> int | None:
    """The training size a ``--set data.image_size=N`` among ``user`` gives (the last one), or None."""
    for item in reversed(user or []):
        key, _, value = item.partition("=")
        if key.strip() == "data.image_size":
            try:
                return int(value.strip()) or None
            except ValueError:                      # (refused, naming the field, where the recipe is built)
                return None
    return None


def resolve_from_data(recipe: Recipe, info: dict, n_train: int, n_classes: int,
                      user: list[str] | None = None, start: dict | None = None) -> tuple[Recipe, list[str]]:
    """Fill the recipe's data-dependent values: with ``data.auto_choices`` (the ``folder``
    recipe) the choices of :mod:`speedrun.data.sources.choices`, under the user's ``--set`` values
    (``user``), which are applied last, to the sections the data chose (the model's were held
    back until now: :func:`~speedrun.recipe.held_for_data`); else only the 'auto' sizes.
    Returns the recipe (as it will run: auto_choices off, every value filled in) and the
    reasons to say. ``start``: what weights to start from tell of themselves (their [model]
    section, the sizes they were trained and evaluated at, a line naming them): the folder
    recipe then fine-tunes them (:func:`~speedrun.data.sources.choices.choose_finetune`)."""
    d, median = recipe.data, info["median_shorter_side"]
    if d.dataset != "folder":
        return recipe, []
    if d.auto_choices:
        c = choose(median, n_train, n_classes, d.batch_size) if start is None else \
            choose_finetune(start, median, n_train, n_classes, size_as_set(user))
        raw = recipe.to_dict()
        for k, section in c.sections.items():
            if section is None:
                raw.pop(k, None)
            else:
                raw[k] = section
        # an unknown field names the model the data chose, and lists that model's fields
        source = f"{recipe.name} with what the data chose ({c.reasons[0]})"
        yours = new_network(raw, list(user or []))
        if yours is not None:                        # your network, not the one the data chose
            c.reasons = [your_network(r, yours) for r in c.reasons]
            mult = raw.get("optim", {}).get("norm_bias_lr_mult", 1.0)
            if mult != 1.0:                          # (it goes with the speed net's frozen batch-norm scale)
                c.values["optim.norm_bias_lr_mult"] = 1.0
                c.reasons.insert(1, f"batch-norm biases at the weights' LR (the speed net's {mult:g}x goes with its "
                                    "frozen batch-norm scale)")
        raw = apply_overrides(set_values(raw, c.values, source), list(user or []))
        recipe = recipe_from_dict(set_values(raw, {"data.auto_choices": False}, source), source=source,
                                  overrides=list(user or []), over_source=True)
        kept = [o.split("=", 1)[0].strip() for o in (user or [])]
        reasons = c.reasons + ([f"kept as set: {', '.join(kept)}"] if kept else [])
        return recipe, reasons
    values = {}
    size = d.image_size
    if not size:
        size = small_image_size(median)
        values["data.image_size"] = size
    if not d.eval_crop:
        values["data.eval_crop"] = default_eval_crop(size)
    return (recipe.with_values(values) if values else recipe), []


def device_count() -> int:
    """Devices taking part in training: the torch.distributed world, else $WORLD_SIZE, else 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_batch(recipe: Recipe) -> Recipe:
    """data.per_device_batch -> data.batch_size for the devices at hand."""
    per = recipe.data.per_device_batch
    if not per:
        return recipe
    return recipe.with_values({"data.batch_size": per * device_count(), "data.per_device_batch": 0})


def start_workers_early(recipe: Recipe) -> None:
    """Start the decoding workers' fork server now, before the weights a folder run starts from
    are opened, where the folder may be streamed: the server's own start (a fresh interpreter
    importing torch, numpy and Pillow, seconds on a small CPU) then runs beside the opening of the
    weights (timm's import alone takes seconds) instead of after it. Where the folder turns out
    to be decoded once into a cache, the server serves nothing and ends with the process."""
    d = recipe.data
    if d.dataset == "folder" and d.cache != "on" and default_workers(d.workers) > 0:
        start_worker_server()


def open_source(recipe: Recipe, data_dir=None, say=None, start: dict | None = None
                ) -> tuple[Recipe, ArrayDataset | FolderSource]:
    """(the recipe with data-derived values filled in, the dataset). The dataset's
    ``choices`` say what was chosen from the data and why; ``say`` reports a cache being made;
    ``start``: weights to start from, as :func:`resolve_from_data` takes them."""
    if recipe.data.dataset == "imagenette":             # found or fetched, then an image folder
        from ..sources.imagenette import resolve_imagenette
        recipe = resolve_imagenette(recipe, data_dir)
    user = list(recipe._overrides)
    recipe = resolve_batch(recipe)
    d = recipe.data
    if d.dataset in ("folder", "npz") and not d.path:
        if not data_dir:
            what = "image folder" if d.dataset == "folder" else ".npz file"
            raise RecipeError(f"dataset '{d.dataset}' needs the {what}: pass --data-dir PATH or --set data.path=PATH")
        recipe = recipe.with_values({"data.path": str(data_dir)})
        d = recipe.data
    if d.dataset == "folder":
        train, val = folder_splits(d.path, d.val_fraction, d.split_seed)
        info = probe(train)
        recipe, reasons = resolve_from_data(recipe, info, len(train), len(train.classes), user, start)
        d, channels = recipe.data, info["channels"]
        evaluate = d.eval_size or d.image_size
        smallest = max(evaluate, d.image_size)
        if d.cache_size and d.cache_size < smallest:
            raise RecipeError(f"data.cache_size={d.cache_size} is smaller than the images it must give: at least "
                              f"{smallest} px (data.eval_size and data.image_size); raise it, or 0 for the "
                              "evaluation size")
        stored = max(d.cache_size, smallest)
        # held out here, before a cache is made or the statistics sampled (held-out images are never seen), and
        # refused here where the data has no image to spare
        kept, holdout = hold_out_images(train, d.holdout, d.split_seed, d.path) if recipe.train.stop_at_target \
            else (train, None)
        cached, why = use_cache(d.cache, recipe.augment.crop, d.eval_crop, len(train) + len(val), channels, stored)
        if cached:                                  # stored at least as large as the training crops
            ds, ds.cache = open_cached(train, val, channels, stored, d, d.image_size, say or (lambda m: None),
                                       eval_size=smallest)
            ds = _held_out(recipe, ds)                  # (the same images as ``holdout``: the choice is the labels')
            ds.choices = reasons + [why]
            return recipe, ds
        if d.decoder == "torchvision":              # streamed through the device's decoder (device_stream)
            from ..sources.device_decode import torchvision_io
            torchvision_io()                        # (refused here, before a run folder is made, where it is missing)
            why += "; each batch decoded and cropped on the run's device by torchvision (data.decoder=torchvision)"
        train = kept
        workers = default_workers(d.workers) > 0
        if workers:
            start_worker_server()                   # (its imports overlap the sampling below)
        mean, std = sample_stats(train, channels, d.image_size, d.decoder)
        if workers:
            start_worker_server(wait=True)
        src = FolderSource(train, val, channels, d.image_size, mean, std, str(d.path), evaluate, holdout=holdout)
        src.choices = reasons + [why] if reasons else []
        return recipe, src
    if d.dataset == "npz":
        return recipe, _held_out(recipe, load_npz(d.path))
    if d.dataset in SPECS:
        return recipe, _held_out(recipe, load_dataset(d.dataset, data_dir))
    raise DataError(f"unknown dataset {d.dataset!r}")


def _held_out(recipe: Recipe, ds: ArrayDataset) -> ArrayDataset:
    """``ds`` with its validation split held out of the training images (train.stop_at_target)."""
    d = recipe.data
    data = d.path if d.dataset in ("folder", "npz") else d.dataset
    return hold_out_arrays(ds, d.holdout, d.split_seed, data) if recipe.train.stop_at_target else ds


def place_source(source, runtime):
    """``source`` ready for a run's first touch: an array data set's images already on the
    device in the runtime's layout (moved before the run's clock starts); a folder as it is
    (streamed: decoded and moved batch by batch, inside the clock)."""
    return source if isinstance(source, FolderSource) else source.placed(runtime.device, runtime.memory_format)


def open_pipeline(source, recipe: Recipe, runtime, seed: int, shard: Shard = Shard()):
    """The pipeline that feeds ``source`` to the engine for one run (the first touch of the
    data): streamed for an image folder, device-resident for arrays. ``shard``: this process's share of every training and evaluation batch."""
    if isinstance(source, FolderSource):
        if recipe.data.decoder == "torchvision":            # decoded and cropped on the device
            from .device_stream import DeviceStreamedData
            return DeviceStreamedData(source, recipe, runtime, seed, shard)
        return StreamedData(source, recipe, runtime, seed, shard)
    translate = recipe.augment.translate if recipe.augment.crop == "translate" else 0
    return ResidentData(source, runtime.device, runtime.dtype, runtime.memory_format, translate, shard,
                        recipe.augment.whole_epoch)
