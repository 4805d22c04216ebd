"""A run's folder: config.toml, metrics.jsonl, summary.json and the final weights.

Every file is written whole to a temporary name and renamed into place, so a crash never
leaves a half-written record; an existing run in the folder is never overwritten.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

_UMASK = os.umask(0)
os.umask(_UMASK)


def _publish(tmp: str, path: Path) -> None:
    """Give the finished temporary file normal permissions and move it into place."""
    os.chmod(tmp, 0o666 & ~_UMASK)
    os.replace(tmp, path)


class RunFolderError(RuntimeError):
    pass


def read_json_record(path: Path, kind: str, key: str, missing_hint: str, error=RunFolderError) -> dict:
    """Load a JSON record written by speedrun (``kind``: its file name, e.g. ``bench.json``),
    raising ``error`` naming the file when it is absent, unreadable or lacks ``key``."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such {kind} ({missing_hint})") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: not a valid {kind} ({err})") from None
    if not isinstance(record, dict) or not record.get(key):
        raise error(f"{path}: holds no {key}; it is not a finished {kind} record")
    return record


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_torch_save(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        _publish(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_run_dir(recipe_name: str, root: Path = Path("runs")) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"{recipe_name}-{stamp}"
    i = 1
    while path.exists():
        i += 1
        path = root / f"{recipe_name}-{stamp}-{i}"
    return path


class RunRecord:
    """Writes one run's files into ``folder``."""

    def __init__(self, folder: Path, resume_history: list[dict] | None = None):
        """``resume_history``: continuing a checkpointed run in its own folder, with the
        epochs it had completed."""
        self.folder = Path(folder)
        if resume_history is None and ((self.folder / "summary.json").exists()
                                       or (self.folder / "metrics.jsonl").exists()):
            raise RunFolderError(f"{self.folder} already holds a run; pass another --out folder "
                                 "(or remove that one) so that no record is overwritten")
        if resume_history is not None and (self.folder / "summary.json").exists():
            raise RunFolderError(f"{self.folder} holds a finished run; there is nothing to resume")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._metrics: list[str] = [json.dumps(h) for h in resume_history or []]

    def write_config(self, toml_text: str) -> None:
        atomic_write_text(self.folder / "config.toml", toml_text)

    def reset_metrics(self) -> None:
        """Forget the epochs of an attempt that was abandoned (the batch finder retrying)."""
        self._metrics = []
        (self.folder / "metrics.jsonl").unlink(missing_ok=True)

    def append_metrics(self, row: dict) -> None:
        self._metrics.append(json.dumps(row))
        atomic_write_text(self.folder / "metrics.jsonl", "\n".join(self._metrics) + "\n")

    def write_summary(self, summary: dict) -> None:
        atomic_write_json(self.folder / "summary.json", summary)

    def save_weights(self, state_dict: dict, name: str = "model.pt") -> Path:
        path = self.folder / name
        atomic_torch_save(path, {k: v.detach().cpu() for k, v in state_dict.items()})
        return path
