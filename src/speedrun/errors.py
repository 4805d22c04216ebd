"""Turning the errors a user can act on into one message and an exit code, no traceback."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

from .data.download import DataError
from .recipe import RecipeError
from .report.record import RunFolderError


class TrainingStopped(RuntimeError):
    """Training ended early for a reason the message explains (NaN loss, out of memory)."""


USER_ERRORS = (RecipeError, DataError, RunFolderError, TrainingStopped)


@dataclass
class Status:
    code: int = 0


@contextmanager
def report_errors():
    status = Status()
    try:
        yield status
    except USER_ERRORS as err:
        print(f"speedrun: error: {err}", file=sys.stderr)
        status.code = 2 if isinstance(err, (RecipeError, RunFolderError)) else 1
    except KeyboardInterrupt:
        print("speedrun: interrupted", file=sys.stderr)
        status.code = 130
