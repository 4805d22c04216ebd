"""Your own network (``model.name = "custom"``): ``model.factory`` names a function,
``"package.module:function"`` or ``"path/to/file.py:function"``, that speedrun calls as
``function(in_channels, num_classes, **model.args)`` and that returns a ``torch.nn.Module``.

A run records the factory (a file's path made absolute) and the SHA-256 of its source file in
its recipe (``model.factory_sha256``, in config.toml and the checkpoint); building the network
again (``--resume``, ``predict``, ``evaluate``, ``export``) imports the factory again and
refuses, in one line, a file that is missing or has changed since. Whatever the factory does
wrong (raises, returns something else) is one :class:`~speedrun.errors.RecipeError` line naming
``model.factory``.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch.nn as nn

from ..errors import RecipeError


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


def split(factory: str) -> tuple[str, str]:
    """('path/to/file.py' or 'package.module', 'function') of ``model.factory``."""
    where, _, function = factory.rpartition(":")
    return where.strip(), function.strip()


def is_file_form(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def source_file(factory: str, trained: bool = False) -> Path:
    """The source file the factory is defined in (without importing a file form); ``trained``:
    a run was trained with it (its recipe records the file's SHA-256)."""
    where, _ = split(factory)
    if is_file_form(where):
        path = Path(where).expanduser()
        if not path.is_file():
            todo = ("the run was trained with it: put it back" if trained else
                    "give the path of the .py file that defines the function")
            raise RecipeError(f"model.factory={factory}: no such file {path}"
                              + ("" if path.is_absolute() else f" (from {Path.cwd()})") + f"; {todo}")
        return path.resolve()
    module = _import_module(factory, where)
    file = getattr(module, "__file__", None)
    if not file:
        raise RecipeError(f"model.factory={factory}: the module {where} has no source file to record; put the factory "
                          "in a .py file")
    return Path(file).resolve()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _import_module(factory: str, where: str) -> ModuleType:
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        if err.name and where.startswith(err.name):
            raise RecipeError(f"model.factory={factory}: no module named {err.name!r} on the Python path; install "
                              "the package, or give 'path/to/file.py:function'") from None
        raise RecipeError(f"model.factory={factory}: importing {where} failed ({_first_line(err)})") from None
    except Exception as err:
        raise RecipeError(f"model.factory={factory}: importing {where} failed ({_first_line(err)})") from None


_file_modules: dict[tuple[str, str], ModuleType] = {}


def _import_file(factory: str, path: Path, digest: str) -> ModuleType:
    """The module of a factory file, imported once per process for a given content (its folder
    on the import path while it imports, so that it can import files beside it)."""
    key = (str(path), digest)
    if key in _file_modules:
        return _file_modules[key]
    name = f"speedrun_factory_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{digest[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                          # (classes defined there must be importable by name)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise RecipeError(f"model.factory={factory}: importing {path} failed ({_first_line(err)})") from None
    finally:
        sys.path.remove(str(path.parent))
    _file_modules[key] = module
    return module


def load_factory(cfg) -> Callable:
    """The function ``cfg.factory`` names, its source checked against ``cfg.factory_sha256``
    where the recipe records one."""
    where, function = split(cfg.factory)
    path = source_file(cfg.factory, bool(cfg.factory_sha256))
    digest = sha256_file(path)
    if cfg.factory_sha256 and digest != cfg.factory_sha256:
        raise RecipeError(f"model.factory={cfg.factory}: {path} has changed since the run was trained (SHA-256 "
                          f"{cfg.factory_sha256[:12]}... recorded, {digest[:12]}... now); put back the file the run "
                          "was trained with (or, for a new run, set model.factory_sha256='')")
    module = _import_file(cfg.factory, path, digest) if is_file_form(where) else _import_module(cfg.factory, where)
    fn = getattr(module, function, None)
    if fn is None:
        raise RecipeError(f"model.factory={cfg.factory}: {path.name} defines no {function!r}")
    if not callable(fn):
        raise RecipeError(f"model.factory={cfg.factory}: {function} is a {type(fn).__name__}, not a function")
    return fn


def build_custom(cfg, in_channels: int, num_classes: int) -> nn.Module:
    """``factory(in_channels, num_classes, **cfg.args)``, checked to be a module."""
    fn = load_factory(cfg)
    try:
        model = fn(in_channels, num_classes, **cfg.args)
    except Exception as err:
        raise RecipeError(f"model.factory={cfg.factory} raised {_first_line(err)} when called as "
                          f"{split(cfg.factory)[1]}({in_channels}, {num_classes}"
                          f"{''.join(f', {k}={v!r}' for k, v in cfg.args.items())})") from None
    if not isinstance(model, nn.Module):
        shown = repr(model)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise RecipeError(f"model.factory={cfg.factory} returned {shown} (of type {type(model).__name__}), not a "
                          "torch.nn.Module: return the network")
    return model


def recorded(cfg) -> dict:
    """The [model] values a run records of its factory: the file's path made absolute and its
    SHA-256 (a recipe that records one already keeps it, and is checked against it)."""
    path = source_file(cfg.factory, bool(cfg.factory_sha256))
    where, function = split(cfg.factory)
    factory = f"{path}:{function}" if is_file_form(where) else cfg.factory
    return {"model.factory": factory, "model.factory_sha256": cfg.factory_sha256 or sha256_file(path)}


def network_line(cfg, model: nn.Module) -> str:
    params = sum(p.numel() for p in model.parameters())
    return (f"network: {cfg.factory} (your factory; source SHA-256 {cfg.factory_sha256[:12]}...), "
            f"{params:,} parameters")
