"""Optimizers (SGD, LARS, LAMB), parameter groups, schedules and weight averaging."""
from .averaging import WeightAverage, build_averager
from .layerwise import LAMB, LARS
from .params import build_optimizer, classify, set_step_hyperparams
from .schedule import lr_multipliers, momenta

__all__ = ["LAMB", "LARS", "WeightAverage", "build_averager", "build_optimizer", "classify", "lr_multipliers",
           "momenta", "set_step_hyperparams"]
