"""Opening the recipe's dataset, whatever it is, and the pipeline that feeds it to the engine.

Built-in sets and ``.npz`` arrays are loaded whole (uint8) and trained through the
device-resident path; image folders are streamed from disk by worker processes (decode a
folder once with ``speedrun data prepare`` to train it resident). Both pipelines offer the
engine the same methods (``epoch``, ``test_batches``, ``whitening_sample``, ``n_train``,
``image_size``, ``mean``/``std``, ``skipped``, ``crops_in_workers``), so it never asks
which one it holds. Settings
the recipe leaves to the data (``data.image_size = 0``, ``data.eval_crop = 0``) are chosen
here from a sample of the images, and written back into the recipe so the run's
``config.toml`` records the values actually used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..recipe import Recipe, RecipeError, apply_overrides, recipe_from_dict
from .arrays import load_npz
from ..errors import DataError
from .folder import ImageList, folder_splits, probe
from .builtin import SPECS, ArrayDataset, load_dataset
from .resident import ResidentData
from .shard import Shard
from .stream import StreamedData, sample_stats


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


def nearest_multiple(x: float, k: int = 8) -> int:
    """The multiple of ``k`` nearest to ``x``, at least ``k`` (image sizes)."""
    return max(k, int(round(x / k)) * k)


def resolve_from_data(recipe: Recipe, median_side: int | None) -> Recipe:
    """Fill the recipe's data-dependent 'auto' values."""
    overrides = []
    size = recipe.data.image_size
    if recipe.data.dataset == "folder" and not size:
        size = min(224, nearest_multiple(median_side))
        overrides.append(f"data.image_size={size}")
    if recipe.data.dataset == "folder" and not recipe.data.eval_crop:
        overrides.append(f"data.eval_crop={1.0 if size <= 64 else 0.875}")
    if not overrides:
        return recipe
    return recipe_from_dict(apply_overrides(recipe.to_dict(), overrides), source=recipe.name)


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
    return recipe_from_dict(apply_overrides(recipe.to_dict(), [f"data.batch_size={per * device_count()}",
                                                               "data.per_device_batch=0"]), source=recipe.name)


def open_source(recipe: Recipe, data_dir=None) -> tuple[Recipe, ArrayDataset | FolderSource]:
    """(the recipe with data-derived values filled in, the dataset)."""
    recipe = resolve_batch(recipe)
    d = recipe.data
    if d.dataset in ("folder", "npz") and not d.path:
        if not data_dir:
            what = "image folder" if d.dataset == "folder" else ".npz file"
            raise RecipeError(f"dataset '{d.dataset}' needs the {what}: pass --data-dir PATH or --set data.path=PATH")
        recipe = recipe_from_dict(apply_overrides(recipe.to_dict(), [f"data.path={str(data_dir)!r}"]),
                                  source=recipe.name)
        d = recipe.data
    if d.dataset == "folder":
        train, val = folder_splits(d.path, d.val_fraction, d.split_seed)
        info = probe(train)
        recipe = resolve_from_data(recipe, info["median_shorter_side"])
        mean, std = sample_stats(train, info["channels"], recipe.data.image_size, d.decoder)
        return recipe, FolderSource(train, val, info["channels"], recipe.data.image_size, mean, std, str(d.path))
    if d.dataset == "npz":
        return recipe, load_npz(d.path)
    if d.dataset in SPECS:
        return recipe, load_dataset(d.dataset, data_dir)
    raise DataError(f"unknown dataset {d.dataset!r}")


def open_pipeline(source, recipe: Recipe, runtime, seed: int, shard: Shard = Shard()):
    """The pipeline that feeds ``source`` to the engine for one run (the first touch of the
    data): streamed for an image folder, device-resident for arrays. ``shard``: this process's share of every training and evaluation batch."""
    if isinstance(source, FolderSource):
        return StreamedData(source, recipe, runtime, seed, shard)
    translate = recipe.augment.translate if recipe.augment.crop == "translate" else 0
    return ResidentData(source, runtime.device, runtime.dtype, runtime.memory_format, translate, shard)
