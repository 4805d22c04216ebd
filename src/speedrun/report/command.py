"""The ``report`` command: an HTML (and Markdown) report of a run, bench or ablate folder."""
from __future__ import annotations

from pathlib import Path

from ..errors import RecordError
from .console import make_console

out = make_console()


def report_command(args) -> int:
    from .html import write_report
    target = Path(args.target)
    if not target.is_dir():
        raise RecordError(f"{target}: not a folder; pass a run folder or the folder holding bench.json/ablate.json")
    html_path, md_path = write_report(target)
    out.print(f"wrote {html_path}\nwrote {md_path}")
    return 0
