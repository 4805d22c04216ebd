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

import torch

from .builtin import ArrayDataset
from .cache import shrink
from .folder import ImageList, split_indices


def hold_out_images(images: ImageList, fraction: float, seed: int) -> tuple[ImageList, ImageList]:
    """(the training images kept, those held out) of an image folder's training list."""
    kept, held = split_indices(images.labels, len(images.classes), fraction, seed)
    return images.subset(kept), images.subset(held)


def hold_out_arrays(ds: ArrayDataset, fraction: float, seed: int) -> ArrayDataset:
    """``ds`` with ``fraction`` of its training images moved to its holdout (at the evaluation
    size: a decoded folder's training images may be stored larger than it evaluates)."""
    kept, held = (torch.from_numpy(i) for i in split_indices(ds.train_y.numpy(), ds.num_classes, fraction, seed))
    held_x = ds.train_x.index_select(0, held)
    if tuple(held_x.shape[2:]) != ds.eval_size:
        held_x = shrink(held_x, ds.eval_size[0])
    return replace(ds, train_x=ds.train_x.index_select(0, kept), train_y=ds.train_y[kept], holdout_x=held_x,
                   holdout_y=ds.train_y[held], holdout_index=held)


def holdout_images(source) -> int:
    """Images in ``source``'s holdout (0: none held out)."""
    labels = getattr(source, "holdout_y", None)
    return 0 if labels is None else len(labels)
