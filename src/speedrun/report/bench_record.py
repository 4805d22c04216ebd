"""Reading the records that ``speedrun bench`` writes, and the words for their statistics.

``bench`` writes a ``bench.json``; ``compare`` and ``report`` read it back through
:func:`load_bench`, which checks that it holds what they read. The labels name how the
record's intervals and p-values were computed, for the tables that show them."""
from __future__ import annotations

from pathlib import Path

from ..files import expect, read_json_record

CI_METHOD = "Student's t interval for the mean"
"""How a record's 95% confidence intervals are computed (``ci95_method``)."""

P_VALUE_LABEL = "one-sided t-test p-value (H0: mean ≤ target, H1: mean > target)"
"""What a record's ``p_value_mean_at_least_target`` is, in words for tables: a p-value, not a
chance of reaching the target."""


def load_bench(path: str | Path) -> dict:
    """A bench.json, checked to hold what compare and report read (else RecordError naming it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "bench.json"
    record = read_json_record(path, "bench.json", "runs", "make one with `speedrun bench`")
    check_bench(record, path)
    record["_path"] = str(path)
    return record


def check_bench(record: dict, path: Path) -> None:
    """RecordError naming ``path`` unless ``record`` has the fields and types a bench.json has."""
    expect(record.get("recipe"), str, path, "'recipe'")
    expect(record.get("environment"), dict, path, "'environment'")
    for i, run in enumerate(expect(record["runs"], list, path, "'runs'")):
        expect(run, dict, path, f"runs[{i}]")
        expect(run.get("test_acc"), (int, float), path, f"runs[{i}].test_acc")
        expect(run.get("test_acc_no_tta"), (int, float), path, f"runs[{i}].test_acc_no_tta")
        for region, seconds in expect(run.get("times"), dict, path, f"runs[{i}].times").items():
            expect(seconds, (int, float), path, f"runs[{i}].times.{region}")
