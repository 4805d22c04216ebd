"""Optimizers (SGD, LARS, LAMB), parameter groups, schedules and weight averaging."""
from .averaging import WeightAverage, build_averager
from .layerwise import LAMB, LARS
from .base import SGD, Optimizer
from .params import build_optimizer, classify
from .schedule import ScheduleTables, lr_multipliers, momenta

__all__ = ["LAMB", "LARS", "SGD", "Optimizer", "ScheduleTables", "WeightAverage", "build_averager",
           "build_optimizer", "classify", "lr_multipliers", "momenta"]
