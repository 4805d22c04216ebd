"""Using what a run trained: loading a finished run, preparing images as its evaluation did
(loaded.py), and the commands built on it: predict, evaluate, export."""
from .loaded import LoadedRun, load_run, prepare_images

__all__ = ["LoadedRun", "load_run", "prepare_images"]
