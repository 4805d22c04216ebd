"""One run at a time in a run folder: an exclusive ``flock`` on ``.speedrun.lock`` inside it.

The kernel drops a ``flock`` when the process that holds it ends, however it ends (``kill -9``
and the out-of-memory killer included), so a lock file left behind by a killed run is free and
is simply taken over; the process id written in the file only names the holder in messages.
This module sits with the plumbing: it imports only ``errors`` and ``files``.
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from .errors import RunFolderError, SpeedrunError
from .files import disk_error, make_folder, remove_folders

LOCK_NAME = ".speedrun.lock"


def _holder(fd: int) -> str:
    """The process id the lock file names, or '' when it names none."""
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True
    return True


class RunFolderLock:
    """Held while a run writes into ``folder``; :meth:`release` (on any exit) frees it and
    removes the lock file and the folders made for it when nothing else was written there.
    A lock that cannot be taken (a full or read-only disk) leaves nothing behind."""

    def __init__(self, folder: Path, option: str = "--out"):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.made: list[Path] = []                   # the folder and parents made for the lock, deepest first
        self.taken_over = ""                         # the pid of a killed run whose lock file was left
        self.fd = -1
        if self.folder.is_dir() and self.path.exists():
            self._refuse_if_held(option)             # nothing is created or changed when refused
        try:
            self.made = make_folder(self.folder)
            self.fd = self._take(option)
        except SpeedrunError as err:                 # (the disk's own words, with the option that named it)
            remove_folders(self.made)
            raise type(err)(f"{option} {self.folder}: {err}") from None
        except BaseException:
            remove_folders(self.made)
            raise

    def _refuse_if_held(self, option: str) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            who = f"process {pid}" if pid else "another process"
            raise RunFolderError(f"{option} {self.folder} is in use by a run that is still going ({who} holds "
                                 f"{self.path}); wait for it to end, or pass another {option} folder") from None
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _open(self) -> tuple[int, bool]:
        """The lock file opened for writing, and whether this call created it."""
        while True:
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                pass
            try:
                return os.open(self.path, os.O_RDWR), False
            except FileNotFoundError:                # (removed by a run releasing it meanwhile)
                continue

    def _take(self, option: str) -> int:
        while True:
            try:
                fd, created = self._open()
            except OSError as err:
                raise disk_error(self.path, err, "create the lock file") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._refuse_if_held(option)         # (raced with another run starting: refused there)
                continue
            try:                                     # a releasing run may have removed the file we locked
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            old = _holder(fd)
            try:                                     # the pid first, then the length: a failed write changes nothing
                pid = f"{os.getpid()}\n".encode()
                if os.pwrite(fd, pid, 0) != len(pid):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.ftruncate(fd, len(pid))
            except OSError as err:
                if created:                          # (removed while still held, as release does)
                    try:
                        self.path.unlink()
                    except OSError:
                        pass
                os.close(fd)
                raise disk_error(self.path, err) from None
            if old and old != str(os.getpid()) and not _alive(old):
                self.taken_over = old
            return fd

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no other run holds a removed file)
        and free it; then remove the folders made for it if they are empty."""
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)                            # (closing drops the flock)
        self.fd = -1
        remove_folders(self.made)
