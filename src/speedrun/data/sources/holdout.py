"""The validation split that ``train.stop_at_target`` checks the target on.

A share of the training images (``data.holdout`` of each class, chosen with ``data.split_seed``)
is held out where the data is opened, before anything is measured or trained on them: the
training set shrinks, and the held-out images are evaluated as test images are. The choice
depends only on the training labels, the fraction and the seed, so a resumed run, a bench's
next run and ``speedrun evaluate`` hold out the same images, and a folder holds out the same
files streamed or decoded into its cache. The test set is never touched.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ...errors import RecipeError
from .builtin import ArrayDataset
from .cache import shrink
from .folder import ImageList, split_indices


def hold_out_images(images: ImageList, fraction: float, seed: int, data: str = "the data"
                    ) -> tuple[ImageList, ImageList]:
    """(the training images kept, those held out) of an image folder's training list;
    ``data`` names the data in the refusal when none can be held out."""
    kept, held = _split(np.asarray(images.labels), len(images.classes), fraction, seed, data)
    return images.subset(kept), images.subset(held)


def hold_out_arrays(ds: ArrayDataset, fraction: float, seed: int, data: str = "the data") -> ArrayDataset:
    """``ds`` with ``fraction`` of its training images moved to its holdout (at the evaluation
    size: a decoded folder's training images may be stored larger than it evaluates)."""
    kept, held = (torch.from_numpy(i) for i in _split(ds.train_y.numpy(), ds.num_classes, fraction, seed, data))
    held_x = ds.train_x.index_select(0, held)
    if tuple(held_x.shape[2:]) != ds.eval_size:
        held_x = shrink(held_x, ds.eval_size[0])
    return replace(ds, train_x=ds.train_x.index_select(0, kept), train_y=ds.train_y[kept], holdout_x=held_x,
                   holdout_y=ds.train_y[held], holdout_index=held)


def _split(labels: np.ndarray, classes: int, fraction: float, seed: int, data: str) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) positions; refused, before anything is made of the data, where no class
    has an image to spare (split_indices holds out at least one image of each class with two
    or more, and none of a class with one, whatever the fraction)."""
    kept, held = split_indices(labels, classes, fraction, seed)
    if not len(held):
        images = len(labels)
        raise RecipeError(f"train.stop_at_target checks the target on a validation split held out of the training "
                          f"images (data.holdout={fraction} of each class, at least one image of a class with two or "
                          f"more), and {data} has {images} training image{'' if images == 1 else 's'} in {classes} "
                          f"class{'' if classes == 1 else 'es'}, none with more than one, so none can be held out: "
                          "give it more training images (a class needs two or more for one to be held out), or drop "
                          "train.stop_at_target")
    return kept, held


def holdout_images(source) -> int:
    """Images in ``source``'s holdout (0: none held out)."""
    labels = getattr(source, "holdout_y", None)
    return 0 if labels is None else len(labels)
