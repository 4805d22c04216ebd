"""A run's folder: config.toml, metrics.jsonl, summary.json and the final weights.

Every file is written whole to a temporary name and renamed into place (``files.py``), so a
crash never leaves a half-written record. A folder that holds any of a run's files is never
used for a new run, the folder is made only when the first file is written, and a run that
fails before it has anything worth keeping removes what it wrote.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..errors import RunFolderError
from ..files import atomic_torch_save, atomic_write_json, atomic_write_text, check_output_folder, make_folder

LOG_FILES = ("steps.csv", "epochs.csv", "tensorboard")
"""What ``--log`` writes (report/loggers.py)."""
RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "model.pt", "checkpoint.pt", "last_good.pt",
             "preprocessing.json", *LOG_FILES)
KEEP_FILES = ("summary.json", "model.pt", "checkpoint.pt", "last_good.pt")
"""Files worth keeping after a failure: a folder holding one of them is never removed."""


def run_folder_bytes(model, recipe) -> int:
    """Disk the run folder of ``recipe``'s run of ``model`` needs: the weights (model.pt,
    last_good.pt) and, with checkpoints, a checkpoint (weights, optimizer state, average)
    written beside the one it replaces."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    c = recipe.checkpoint
    return weights * (2 + (8 if (c.every_steps or c.every_epochs) else 0)) + (1 << 20)


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

    def __init__(self, folder: Path, resume_history: list[dict] | None = None, need_bytes: int = 1 << 20,
                 restarted: bool = False):
        """``resume_history``: continuing a checkpointed run in its own folder, with the epochs
        it had completed. ``restarted``: torchrun restarted this job before it wrote a
        checkpoint; its first attempt's config and metrics are replaced. Checks the folder
        (nothing is written yet)."""
        self.folder = Path(folder)
        self.resuming = resume_history is not None
        if not self.resuming:
            own = ("config.toml", "metrics.jsonl", *LOG_FILES) if restarted else ()
            found = [n for n in RUN_FILES if (self.folder / n).exists() and n not in own]
            if found:
                what = ("an interrupted run (continue it with `speedrun train --resume "
                        f"{self.folder}`)" if "checkpoint.pt" in found and "summary.json" not in found else "a run")
                raise RunFolderError(f"{self.folder} already holds {what} ({', '.join(found)}); pass another "
                                     "--out folder so that nothing is overwritten")
        elif (self.folder / "summary.json").exists():
            raise RunFolderError(f"{self.folder} holds a finished run; there is nothing to resume")
        check_output_folder(self.folder, "--out" if not self.resuming else "--resume", need_bytes)
        self.created = not self.folder.exists()
        self._made: list[Path] = []          # the folder and the parents the first write will make
        made = self.folder
        while not made.exists() and made != made.parent:
            self._made.append(made)
            made = made.parent
        self.written: list[Path] = []
        self._metrics: list[str] = [json.dumps(h) for h in resume_history or []]

    def path_for(self, name: str) -> Path:
        """The path of a file or folder this run writes in its folder (made ready, and removed
        again by :meth:`discard`)."""
        return self._path(name)

    def _path(self, name: str) -> Path:
        make_folder(self.folder)
        path = self.folder / name
        if path not in self.written:
            self.written.append(path)
        return path

    def write_config(self, toml_text: str) -> None:
        atomic_write_text(self._path("config.toml"), toml_text)

    def reset_metrics(self) -> None:
        """Forget the epochs of an attempt that was abandoned (the batch finder retrying)."""
        self._metrics = []
        (self.folder / "metrics.jsonl").unlink(missing_ok=True)

    def append_metrics(self, row: dict) -> None:
        self._metrics.append(json.dumps(row))
        atomic_write_text(self._path("metrics.jsonl"), "\n".join(self._metrics) + "\n")

    def write_summary(self, summary: dict) -> None:
        atomic_write_json(self._path("summary.json"), summary)

    def write_preprocessing(self, preprocessing: dict) -> None:
        """What a model's input must be: how predict, evaluate and export prepare images."""
        atomic_write_json(self._path("preprocessing.json"), preprocessing)

    def save_weights(self, state_dict: dict, name: str = "model.pt") -> Path:
        path = self._path(name)
        atomic_torch_save(path, {k: v.detach().cpu() for k, v in state_dict.items()})
        return path

    def discard(self) -> None:
        """After a failure: remove what this run wrote unless something worth keeping is there
        (weights, a checkpoint, a summary), and the folder too if this run made it and it is empty,
        with the parents it made for it (such as ``runs/``) that are left empty."""
        if self.resuming or any((self.folder / n).exists() for n in KEEP_FILES):
            return
        for path in self.written:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        for folder in self._made:            # deepest first; stops at the first one not empty
            try:
                folder.rmdir()
            except OSError:
                break


class NullRecord:
    """What ranks other than 0 write of a run: nothing (they share rank 0's folder name)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def write_config(self, toml_text: str) -> None: ...
    def reset_metrics(self) -> None: ...
    def append_metrics(self, row: dict) -> None: ...
    def write_summary(self, summary: dict) -> None: ...
    def write_preprocessing(self, preprocessing: dict) -> None: ...
    def discard(self) -> None: ...

    def save_weights(self, state_dict: dict, name: str = "model.pt") -> Path:
        return self.folder / name
