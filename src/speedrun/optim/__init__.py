"""Optimizers (SGD, LARS, LAMB, AdamW), parameter groups, schedules and weight averaging."""
from .adam import AdamW
from .averaging import WeightAverage, build_averager
from .layerwise import LAMB, LARS
from .base import SGD, Optimizer
from .params import build_optimizer, classify
from .schedule import ScheduleTables, lr_multipliers, momenta

__all__ = ["AdamW", "LAMB", "LARS", "SGD", "Optimizer", "ScheduleTables", "WeightAverage", "build_averager",
           "build_optimizer", "classify", "lr_multipliers", "momenta"]
