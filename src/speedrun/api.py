"""speedrun from Python: :func:`train`, :func:`bench` and :func:`load_run`.

Each call goes through the command line's own path (its parser, its defaults, the same
``train_command`` and ``bench_command``), so a run started here is the run ``speedrun train``
makes from the same recipe, overrides and seed, bit for bit, and writes the same run folder.
What differs is how it ends: a refusal or a failure raises speedrun's own exception (a
:class:`~speedrun.errors.SpeedrunError`, whose message is the command line's one line), never
``SystemExit``; a run stopped by a signal raises :class:`RunStopped` naming the folder to resume.

Data may be given in memory, as the ``.npz`` source reads it: ``data={"x_train": ...,
"y_train": ..., "x_test": ..., "y_test": ...}`` (uint8 images as NumPy arrays or tensors, N x
H x W, N x H x W x C or N x C x H x W; optional ``classes``). The arrays are stored once, by
content, under speedrun's cache (``$SPEEDRUN_CACHE/arrays/SHA.npz``), so that ``--resume``,
``evaluate`` and ``predict`` find them again.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import RunFolderError, SpeedrunError, UsageError

__all__ = ["FinishedRun", "Run", "RunStopped", "train", "bench", "load_run", "toml_value"]


class RunStopped(SpeedrunError, RuntimeError):
    """A run stopped by SIGTERM, SIGUSR1 or Ctrl-C after writing its checkpoint; ``folder``
    continues with ``train(resume=folder)`` (or ``speedrun train --resume FOLDER``)."""
    exit_code = 75

    def __init__(self, message: str, folder: Path):
        super().__init__(message)
        self.folder = folder


@dataclass
class Run:
    """A finished run: its folder, its summary.json and resolved recipe; ``model`` is the trained
    network (fp32, evaluation mode, loaded from model.pt as ``speedrun predict`` loads it) and
    :meth:`predict` classifies image files as ``speedrun predict`` does."""
    folder: Path
    summary: dict
    _loaded: Any = field(default=None, repr=False)

    @property
    def loaded(self):
        if self._loaded is None:
            self._loaded = load_run(self.folder)
        return self._loaded

    @property
    def model(self):
        return self.loaded.model

    @property
    def recipe(self):
        return self.loaded.recipe

    def predict(self, images, top_k: int = 1, tta: bool = False):
        return self.loaded.predict(images, top_k=top_k, tta=tta)


def toml_value(value: Any) -> str:
    """A Python value as the TOML text a ``--set key=value`` takes (bool, int, float, str, None
    is refused; lists and dicts nest)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))            # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise UsageError(f"set: {value!r} ({type(value).__name__}) is not a recipe value; give a bool, number, string, "
                     "list or dict")


def _sets(values: Mapping[str, Any] | None) -> list[str]:
    if values is None:
        return []
    if not isinstance(values, Mapping):
        raise UsageError(f"set must be a dict of recipe fields to values (e.g. {{'train.epochs': 5}}), not "
                         f"{type(values).__name__}")
    out = []
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise UsageError(f"set: {key!r} is not a recipe field name (e.g. 'optim.lr')")
        out.append(f"{key}={toml_value(value)}")
    return out


def _arrays_file(data: Mapping[str, Any]) -> Path:
    """The in-memory arrays as an .npz under speedrun's cache, named by their content (written
    once, atomically; an existing one is reused)."""
    import numpy as np

    from .data.sources.arrays import REQUIRED
    from .files import atomic_write_with, cache_root
    if not isinstance(data, Mapping):
        raise UsageError(f"data must be a dict of arrays ({', '.join(REQUIRED)}), not {type(data).__name__}")
    missing = [k for k in REQUIRED if k not in data]
    unknown = [k for k in data if k not in (*REQUIRED, "classes")]
    if missing or unknown:
        what = f"it lacks {', '.join(missing)}" if missing else f"{', '.join(map(str, unknown))} is not one of them"
        raise UsageError(f"data: a dict of {', '.join(REQUIRED)} (and optionally classes) is expected; {what}")
    arrays = {}
    for key, value in data.items():
        if hasattr(value, "detach"):                       # a tensor
            value = value.detach().cpu().numpy()
        arrays[key] = np.ascontiguousarray(np.asarray(value))
    digest = hashlib.sha256()
    for key in sorted(arrays):
        a = arrays[key]
        digest.update(f"{key}:{a.dtype.str}:{a.shape}".encode())
        digest.update(a.tobytes() if a.dtype != object else repr(a.tolist()).encode())
    path = cache_root() / "arrays" / f"{digest.hexdigest()[:32]}.npz"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
        atomic_write_with(path, write)
    return path


_last_model: str | None = None
"""The [model] section of this process's last run: compiled graphs are kept for the same model only."""


def _forget_compiled_if_other_model(recipe) -> None:
    global _last_model
    model = json.dumps(recipe.to_dict()["model"], sort_keys=True)
    if _last_model is not None and model != _last_model:
        import torch
        torch._dynamo.reset()
    _last_model = model


@contextlib.contextmanager
def _output(quiet: bool):
    if not quiet:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _parse(argv: list[str]):
    from .cli import build_parser
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        raise UsageError(f"speedrun {' '.join(argv)}: not a valid command (see `speedrun {argv[0]} --help`)") from None
    args.started = time.perf_counter()
    args.before_main = None                     # (a call from Python: no process start of its own)
    return args


def _common(recipe: str | None, data_dir, data, init, set, seed, device) -> list[str]:
    argv = [] if recipe is None else [str(recipe)]
    overrides = _sets(set)
    if data is not None:
        if data_dir is not None:
            raise UsageError("give data (arrays in memory) or data_dir (files), not both")
        overrides = [f"data.dataset={toml_value('npz')}", f"data.path={toml_value(str(_arrays_file(data)))}",
                     *overrides]
    for o in overrides:
        argv += ["--set", o]
    if data_dir is not None:
        argv += ["--data-dir", str(Path(data_dir).expanduser())]
    if init is not None:
        argv += ["--init", str(init)]
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise UsageError(f"seed must be a whole number, not {seed!r}")
        argv += ["--seed", str(seed)]
    if device is not None:
        if device not in ("cpu", "cuda"):
            raise UsageError(f"device must be 'cpu' or 'cuda', not {device!r}")
        argv += ["--device", device]
    return argv


def train(recipe: str | None = None, *, data_dir: str | Path | None = None, data: Mapping[str, Any] | None = None,
          init: str | Path | None = None, set: Mapping[str, Any] | None = None, seed: int | None = None,
          device: str | None = None, out: str | Path | None = None, resume: str | Path | None = None,
          quiet: bool = False) -> Run:
    """Train ``recipe`` (a shipped name or a .toml path) once, as ``speedrun train`` does, and
    return the finished :class:`Run`. ``set`` maps recipe fields to Python values
    (``{"train.epochs": 5, "model.widths": [32, 64, 128]}``); ``init`` is ``--init``; ``out`` the
    run folder (default ``runs/RECIPE-TIMESTAMP``); ``resume`` continues a stopped run's folder.
    ``quiet`` keeps the progress off the terminal. Raises a SpeedrunError on any refusal or
    failure (the command line's one line as its message), :class:`RunStopped` on a stop signal."""
    from .recipe import load_recipe
    from .report.record import new_run_dir
    from .stop_signals import RESUMABLE_EXIT
    if (recipe is None) == (resume is None):
        raise UsageError("train needs a recipe (or resume=RUN_FOLDER to continue a stopped run)")
    if resume is not None:
        if any(v is not None for v in (data_dir, data, init, set, seed, out)):
            raise UsageError("train(resume=...) continues the run as it was: give no other option but device and "
                             "quiet")
        folder = Path(resume)
        argv = ["train", "--resume", str(folder)] + _common(None, None, None, None, None, None, device)
    else:
        argv = ["train", *_common(recipe, data_dir, data, init, set, seed, device)]
        args = _parse(argv)                                  # (checked before the folder is chosen)
        resolved = load_recipe(args.recipe, list(args.overrides) + ([f"train.seed={seed}"] if seed is not None
                                                                    else []))
        folder = Path(out) if out is not None else new_run_dir(resolved.name)
        argv += ["--out", str(folder)]
    args = _parse(argv)
    from .cli import dispatch
    with _output(quiet):
        if resume is None:
            _forget_compiled_if_other_model(resolved)
        code = dispatch(args)
    if code == RESUMABLE_EXIT:
        raise RunStopped(f"stopped by a signal; its checkpoint is in {folder}: continue with "
                         f"speedrun.train(resume={str(folder)!r})", folder)
    if code != 0:
        raise SpeedrunError(f"speedrun train ended with exit code {code}")
    return Run(folder, _read_json(folder / "summary.json"))


def bench(recipe: str, runs: int = 5, *, data_dir: str | Path | None = None, data: Mapping[str, Any] | None = None,
          init: str | Path | None = None, set: Mapping[str, Any] | None = None, seed: int | None = None,
          device: str | None = None, out: str | Path | None = None, quiet: bool = False) -> dict:
    """``speedrun bench RECIPE --runs N``: N seeded runs in this process; returns the bench record
    (``bench.json``: every run, the statistics), written into ``out`` (default
    ``runs/bench-RECIPE-TIMESTAMP``)."""
    from .bench.common import out_folder
    from .recipe import load_recipe
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
        raise UsageError(f"runs must be a whole number above 0, not {runs!r}")
    argv = ["bench", *_common(recipe, data_dir, data, init, set, seed, device), "--runs", str(runs)]
    args = _parse(argv)
    resolved = load_recipe(args.recipe, list(args.overrides))
    folder = Path(out) if out is not None else out_folder(None, "bench", resolved.name, "bench.json").path
    args = _parse(argv + ["--out", str(folder)])
    from .cli import dispatch
    with _output(quiet):
        _forget_compiled_if_other_model(resolved)
        code = dispatch(args)
    if code != 0:
        raise SpeedrunError(f"speedrun bench ended with exit code {code}")
    return _read_json(folder / "bench.json")


class FinishedRun:
    """A finished run folder loaded to be used, as ``speedrun predict``, ``evaluate`` and ``export``
    load it: ``model`` (fp32, evaluation mode, on ``device``), ``recipe``, ``classes``, ``folder``,
    ``preprocessing``, and :meth:`predict`."""

    def __init__(self, loaded):
        self._loaded = loaded

    def __getattr__(self, name):
        return getattr(self._loaded, name)

    def predict(self, images, top_k: int = 1, tta: bool = False) -> list[tuple[Path, list[tuple[str, float]]]]:
        """``speedrun predict`` from Python: for each image file (a path or a list of them), (its
        path, its ``top_k`` likeliest classes with their probabilities, the likeliest first),
        each image prepared as the run's evaluation prepared its own; an unreadable file raises a
        DataError naming it."""
        from .errors import DataError
        from .use.predict import predict
        paths = [Path(images)] if isinstance(images, (str, Path)) else [Path(p) for p in images]
        classes = len(self._loaded.classes)
        if not isinstance(top_k, int) or not 1 <= top_k <= classes:
            raise UsageError(f"top_k={top_k!r}: the run has {classes} classes; give 1 to {classes}")
        found, skipped = predict(self._loaded, paths, top_k=top_k, tta=tta)
        if skipped:
            path, why = skipped[0]
            raise DataError(f"{path}: {why}")
        return [(p.image, [(name, prob) for name, _, prob in p.top]) for p in found]


def load_run(folder: str | Path, device: str | None = None) -> FinishedRun:
    """A finished run folder, ready to use (:class:`FinishedRun`)."""
    from .use.loaded import load_run as _load
    return FinishedRun(_load(folder, device))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RunFolderError(f"{path}: cannot be read ({err})") from None
