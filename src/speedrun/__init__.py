"""speedrun: train image classifiers to a target accuracy in the least time."""
__version__ = "0.1.0"
