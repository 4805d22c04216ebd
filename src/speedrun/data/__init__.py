"""Datasets: finding and verifying files, device-resident batches, batched augmentation."""
from .download import DataError
from .sources import ArrayDataset, load_dataset

__all__ = ["ArrayDataset", "DataError", "load_dataset"]
