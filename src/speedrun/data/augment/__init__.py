"""Batched augmentation on the device: crops, flips, colour changes and mixing images."""
