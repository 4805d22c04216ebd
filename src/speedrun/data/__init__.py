"""Datasets, in three subpackages: ``sources`` (where the images come from and how they are
read, verified, decoded and cached), ``pipeline`` (how a run is fed batches) and ``augment``
(batched augmentation on the device). ``prepare`` is the ``speedrun data`` command."""
from ..errors import DataError
from .sources.builtin import ArrayDataset, load_dataset

__all__ = ["ArrayDataset", "DataError", "load_dataset"]
