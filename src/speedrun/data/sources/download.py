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


# tarfile's 'data' filter came with Python 3.11.4; Debian 12's Python 3.11.2 has none
data_filter = getattr(tarfile, "data_filter", None)


def refusal(member: tarfile.TarInfo, target: Path) -> str | None:
    """Why ``member`` may not be extracted into ``target``, or None: tarfile's 'data' filter
    where Python has it (no absolute paths, no '..', no links leaving the folder, no device
    files); before Python 3.11.4 only plain files and folders inside ``target`` pass (all a
    genuine dataset archive holds)."""
    if os.path.isabs(member.name) or member.name.startswith(("/", "\\")):
        return "it has an absolute path"          # (the data filter would strip the slash)
    if data_filter is not None:
        try:
            data_filter(member, str(target))
        except tarfile.FilterError as err:
            return str(err)
        return None
    if not (member.isfile() or member.isdir()):
        return "it is a link or a special file"
    root = os.path.realpath(target)
    if os.path.commonpath([root, os.path.realpath(os.path.join(root, member.name))]) != root:
        return "it would land outside the destination"
    return None


def safe_extract(archive: Path, target: Path) -> list[Path]:
    """Extract a tar archive into ``target``, refusing members that would land outside it
    (:func:`refusal`) and naming the offending member when it refuses."""
    target.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for m in members:
                why = refusal(m, target)
                if why is not None:
                    raise DataError(f"{archive}: refusing to extract member {m.name!r}: {why}. "
                                    "The archive is not a genuine dataset archive.")
            if data_filter is not None:
                tar.extractall(target, filter="data")
            else:
                for m in members:                 # (owner, mode and times not taken from the archive)
                    tar.extract(m, target, set_attrs=False)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise DataError(f"{archive}: cannot read the archive ({err}); it is truncated or corrupt. "
                        "Delete it and download it again.") from None
    return [target / m.name for m in members if m.isfile()]
