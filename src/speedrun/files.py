"""Files on disk: atomic writes, checks that an output path can be written before any work
starts, and reading speedrun's own JSON records with errors that name the file.

Every write goes to a temporary name in the target folder and is renamed into place, so a
crash or a full disk never leaves a half-written file under the real name. Failures of the
file system (read-only, no permission, disk full, a file where a folder should be) become
:class:`RunFolderError` naming the path, instead of an ``OSError`` or torch's "unexpected pos".
This module sits below the engine and the reports; it imports only ``errors``.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .errors import RecordError, RunFolderError

_UMASK = os.umask(0)
os.umask(_UMASK)

MIN_FREE_BYTES = 1 << 20
"""Free space an output folder needs at least (records, reports); runs ask for more."""


def cache_root(cache_dir: str | None = None) -> Path:
    """speedrun's cache folder (decoded images, compiled code, fetched weights): ``cache_dir``
    where given, else ``$SPEEDRUN_CACHE``, else ``$XDG_CACHE_HOME/speedrun`` or ``~/.cache/speedrun``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SPEEDRUN_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speedrun"


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path):
        path = path.parent
    return path


def _why(err: OSError) -> str:
    return {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.ENOSPC: "the disk is full",
            errno.EDQUOT: "the disk quota is exceeded", errno.EFBIG: "the file is larger than allowed",
            errno.ENOTDIR: "a part of the path is a file, not a folder",
            errno.EEXIST: "a file is in the way (a folder is needed there)",
            errno.EISDIR: "it is a folder"}.get(err.errno, err.strerror or str(err))


def disk_error(path: Path, err: OSError, doing: str = "write") -> RunFolderError:
    """The error to raise when writing ``path`` failed with ``err``; its ``reason`` holds the
    file system's words alone (for callers that say what to do themselves)."""
    error = RunFolderError(f"cannot {doing} {path}: {_why(err)}. Choose another output path, or free the "
                           "space / fix the permissions, then run again")
    error.reason = _why(err)
    return error


def check_output_folder(path: str | os.PathLike, option: str = "--out", need_bytes: int = MIN_FREE_BYTES,
                        given: str | os.PathLike | None = None) -> None:
    """Raise :class:`RunFolderError` unless ``path`` is a folder, or one can be made there, that
    can be written and has ``need_bytes`` free. Leaves nothing behind on disk. ``given``: the
    file the user named, when ``path`` is the folder it goes in (messages quote what was given)."""
    path = Path(path)
    name = f"{option} {given if given is not None else path}"
    if path.exists() and not path.is_dir():
        if given is None:
            raise RunFolderError(f"{name}: a file is in the way (a folder is needed there); choose another path")
        raise RunFolderError(f"{name}: {path} is a file, so no folder can be made under it; choose another path")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise RunFolderError(f"{name}: {base} is a file, so no folder can be made under it; "
                             "choose another path")
    _probe_write(base, name)
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise RunFolderError(f"{name}: the disk holding {base} has {human_bytes(free)} free, and "
                             f"this needs about {human_bytes(need_bytes)}; free some space or choose another path")


def check_output_file(path: str | os.PathLike, option: str = "--out", need_bytes: int = MIN_FREE_BYTES,
                      overwrite: bool = False) -> None:
    """As :func:`check_output_folder`, for a file to be written at ``path``; an existing file is
    refused unless ``overwrite``."""
    path = Path(path)
    if path.is_dir():
        raise RunFolderError(f"{option} {path}: is a folder; give a file name")
    if path.exists() and not overwrite:
        raise RunFolderError(f"{option} {path}: already exists; choose another name so that it is not overwritten")
    check_output_folder(path.parent, option, need_bytes, given=path)


def _probe_write(base: Path, name: str) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=base, prefix=".speedrun-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise RunFolderError(f"{name}: cannot write in {base}: {_why(err)}; choose another path") from None


class OutputFolder:
    """A command's output folder: checked when made (nothing is written yet), created by the
    first write, and removed again by :meth:`discard` if the command fails before it has
    written anything there."""

    def __init__(self, path: str | os.PathLike, option: str = "--out", need_bytes: int = MIN_FREE_BYTES):
        self.path = Path(path)
        check_output_folder(self.path, option, need_bytes)
        self.created = not self.path.exists()

    def discard(self) -> None:
        if self.created and self.path.is_dir() and not any(self.path.iterdir()):
            self.path.rmdir()


def missing_folders(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first: what making it will make."""
    made, p = [], Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        made.append(p)
        p = p.parent
    return made


def remove_folders(made: list[Path]) -> None:
    """Remove the folders ``made`` (deepest first) where they are empty; stops at the first one
    that is not, so nothing but what was made and left empty goes. (Those a failed
    :func:`make_folder` did not get to are skipped.)"""
    for folder in made:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            break


def make_folder(path: Path) -> list[Path]:
    """Make ``path`` and its missing parents; returns those it made, deepest first (to remove
    them again after a failure). A failure removes what it made and names ``path``."""
    made = missing_folders(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        remove_folders(made)
        raise disk_error(path, err, "create the folder") from None
    return made


# ------------------------------------------------------------------------------------------
# Atomic writes
# ------------------------------------------------------------------------------------------

def _publish(tmp: str, path: Path) -> None:
    """Give the finished temporary file normal permissions and move it into place."""
    os.chmod(tmp, 0o666 & ~_UMASK)
    os.replace(tmp, path)


def atomic_write_with(path: Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and rename the result to ``path``; on failure nothing is left
    and the error names ``path`` (the folders made for it are removed again too)."""
    path = Path(path)
    made = make_folder(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as err:
        remove_folders(made)
        raise disk_error(path, err) from None
    try:
        write(tmp)
        _publish(tmp, path)
    except OSError as err:
        _undo(tmp, made)
        raise disk_error(path, err) from None
    except RuntimeError as err:
        # torch.save reports a failed write as a RuntimeError ("unexpected pos ...")
        _undo(tmp, made)
        if "unexpected pos" in str(err) or "failed writing" in str(err):
            free = shutil.disk_usage(_nearest_existing(path.parent)).free
            reason = "the disk is full" if free < MIN_FREE_BYTES else f"the write failed ({err})"
            raise RunFolderError(f"cannot write {path}: {reason} ({human_bytes(free)} free). Free some space "
                                 "or choose another output path, then run again") from None
        raise
    except BaseException:
        _undo(tmp, made)
        raise


def _undo(tmp: str, made: list[Path]) -> None:
    """After a failed atomic write: remove its temporary file and the folders made for it."""
    Path(tmp).unlink(missing_ok=True)
    remove_folders(made)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    atomic_write_with(path, write)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def atomic_torch_save(path: Path, obj) -> None:
    import torch
    atomic_write_with(path, lambda tmp: torch.save(obj, tmp))


# ------------------------------------------------------------------------------------------
# Reading records
# ------------------------------------------------------------------------------------------

def read_text(path: Path, what: str, error=RecordError) -> str:
    """The UTF-8 text of ``path``; ``error`` naming the file when it is missing or not text."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a {what}") from None
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (byte {err.start}); it is not a {what}") from None
    except OSError as err:
        raise error(f"{path}: cannot read the {what}: {_why(err)}") from None


def read_json_record(path: Path, kind: str, key: str, missing_hint: str, error=RecordError) -> dict:
    """Load a JSON record written by speedrun (``kind``: its file name, e.g. ``bench.json``),
    raising ``error`` naming the file when it is absent, unreadable or lacks ``key``."""
    if not Path(path).exists():
        raise error(f"{path}: no such {kind} ({missing_hint})")
    text = read_text(path, kind, error)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{path}: not a valid {kind} ({err})") from None
    if not isinstance(record, dict) or not record.get(key):
        raise error(f"{path}: holds no {key}; it is not a finished {kind} record")
    return record


def expect(value, kind: type | tuple, path: Path, where: str, error=RecordError):
    """``value`` if it has type ``kind``; else ``error`` naming the file and the entry."""
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        value = None                                # JSON true/false is not a number here
    if not isinstance(value, kind):
        raise error(f"{path}: entry {where} is {type(value).__name__}, not what speedrun writes; "
                    "the file is damaged or not a speedrun record")
    return value
