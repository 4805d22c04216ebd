"""The errors a user can act on, by kind. Every module raises these; the command line turns
each into one line ``speedrun: error: ...`` and an exit code, never a traceback.

This module sits lowest in the package: it imports nothing from speedrun.
"""
from __future__ import annotations


class SpeedrunError(Exception):
    """An expected failure; the message names the file, field, option or step and what to do."""

    exit_code = 1


class UsageError(SpeedrunError, ValueError):
    """A command-line option with a value the command cannot use."""

    exit_code = 2


class RecipeError(UsageError):
    """A recipe that cannot be used; the message names the field or file."""


class DataError(SpeedrunError, RuntimeError):
    """Missing, corrupt or unusable data; the message names the file and what to do."""


class RunFolderError(SpeedrunError, RuntimeError):
    """An output path that cannot be used (exists, is a file, is read-only, the disk is full)."""

    exit_code = 2


class RecordError(SpeedrunError, RuntimeError):
    """A record (bench.json, summary.json, ablate.json, metrics.jsonl) that is missing, not
    speedrun's, or incomplete."""


class CheckpointError(SpeedrunError, RuntimeError):
    """A checkpoint or weights file that cannot be read or does not fit the run."""


class TrainingStopped(SpeedrunError, RuntimeError):
    """Training ended early for a reason the message explains (NaN loss, out of memory)."""


class DistributedError(SpeedrunError, RuntimeError):
    """A process of a multi-process job cannot join, differs from the others, or lost them."""


class ExportError(SpeedrunError, RuntimeError):
    """A model that cannot be exported to a format, or whose export does not compute what the
    run's model computes."""
