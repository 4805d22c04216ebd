"""Datasets: finding and verifying files, device-resident batches, batched augmentation."""
from ..errors import DataError
from .builtin import ArrayDataset, load_dataset

__all__ = ["ArrayDataset", "DataError", "load_dataset"]
