"""Fetching dataset files: HTTP download with a progress bar and checksum, safe tar extraction.

Every write lands in a temporary name first and is renamed into place only once complete
and verified, so an interrupted download never leaves a file that looks finished.
"""
from __future__ import annotations

import hashlib
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ...errors import DataError


def md5sum(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: Path, md5: str | None = None, timeout: float = 30.0) -> Path:
    """Download ``url`` to ``dest`` (atomically), checking its md5 when one is given."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    h = hashlib.md5()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            columns = (TextColumn(f"downloading {dest.name}"), BarColumn(), DownloadColumn(),
                       TransferSpeedColumn())
            with Progress(*columns, transient=True) as bar:
                task = bar.add_task("download", total=total)
                while block := response.read(1 << 20):
                    out.write(block)
                    h.update(block)
                    bar.advance(task, len(block))
    except (urllib.error.URLError, OSError, TimeoutError) as err:
        part.unlink(missing_ok=True)
        raise ConnectionError(f"could not download {url}: {getattr(err, 'reason', err)}") from None
    if md5 is not None and h.hexdigest() != md5:
        part.unlink(missing_ok=True)
        raise DataError(f"downloaded {url} but its md5 is {h.hexdigest()}, expected {md5}; "
                        "the server sent a different or damaged file, try again later")
    os.replace(part, dest)
    return dest


def safe_extract(archive: Path, target: Path) -> list[Path]:
    """Extract a tar archive into ``target``, refusing members that would land outside it.

    Uses tarfile's 'data' filter (no absolute paths, no '..', no links leaving the folder,
    no device files) and names the offending member when it refuses.
    """
    target.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for m in members:
                try:
                    if os.path.isabs(m.name) or m.name.startswith(("/", "\\")):
                        # the data filter would strip the slash; an absolute name is refused outright
                        raise tarfile.AbsolutePathError(m)
                    tarfile.data_filter(m, str(target))
                except tarfile.FilterError as err:
                    raise DataError(f"{archive}: refusing to extract member {m.name!r}: {err}. "
                                    "The archive is not a genuine dataset archive.") from None
            tar.extractall(target, filter="data")
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DataError(f"{archive}: cannot read the archive ({err}); it is truncated or corrupt. "
                        "Delete it and download it again.") from None
    return [target / m.name for m in members if m.isfile()]

