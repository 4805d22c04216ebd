"""speedrun: train image classifiers to a target accuracy in the least time.

From Python: ``speedrun.train(...)``, ``speedrun.bench(...)`` and ``speedrun.load_run(...)``
(docs/python.md); they are imported on first use, so ``import speedrun`` stays cheap."""
__version__ = "0.1.0"

_API = ("train", "bench", "load_run", "Run", "RunStopped")


def __getattr__(name):
    if name in _API:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'speedrun' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
