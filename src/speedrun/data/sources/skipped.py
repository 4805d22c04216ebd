"""Images skipped as unreadable under ``data.skip_corrupt`` (a corrupt file, a decompression
bomb): each one named with why it could not be read, once at the end of the run and in its
summary.json, the first :data:`LISTED` of them (a folder may hold thousands)."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

LISTED = 100
"""Skipped files listed in summary.json; the rest are counted."""
SHOWN = 5
"""Skipped files named in the line printed at the end of a run."""


class Skipped(NamedTuple):
    """An image left out with data.skip_corrupt: its file and why it could not be read."""
    path: str
    reason: str


def reason_of(message: str, path: str | Path) -> str:
    """The why of the data layer's message about an unreadable ``path``, without the file's
    name in front and the advice on skipping behind."""
    text = message.removeprefix(f"{path}: ")
    return text.split(". Replace or delete")[0].split("; remove or shrink it")[0]


def listed(files: dict[str, str], count: int) -> dict:
    """summary.json's entries for ``count`` skipped images of which ``files`` (path -> reason)
    are known by name: the first LISTED named, how many are not."""
    names = [{"path": p, "reason": r} for p, r in list(files.items())[:LISTED]]
    return {"skipped_files": names, "skipped_files_not_listed": max(0, count - len(names))}


def skipped_line(files: dict[str, str], count: int, record: str | Path | None = None) -> str:
    """One line naming the skipped images (the first SHOWN) and the ``record`` listing them."""
    shown = [f"{p} ({r})" for p, r in list(files.items())[:SHOWN]]
    more = count - len(shown)
    named = min(len(files), LISTED)
    where = "" if record is None else \
        "; " + ("all are listed" if named == count else f"{named} are listed by name") + f" in {record}"
    if not shown:
        return f"skipped {count} unreadable image{'s' if count != 1 else ''} (data.skip_corrupt); their names " \
               "were not recorded (the decoded cache was made by an older speedrun)"
    return (f"skipped {count} unreadable image{'s' if count != 1 else ''} (data.skip_corrupt): " + "; ".join(shown)
            + (f"; and {more} more" if more > 0 else "") + where)
