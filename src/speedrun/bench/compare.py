"""``speedrun compare A/bench.json B/bench.json``: is B faster, and is it as accurate?

Both questions are answered with Welch's t-test (unequal variances) on the per-run values,
and the answer is put in one plain sentence."""
from __future__ import annotations

import math

from ..errors import RecordError
from .stats import describe, describe_times, welch


def _p(p: float) -> str:
    return "p=n/a" if math.isnan(p) else (f"p={p:.2g}" if p >= 1e-4 else "p<0.0001")


def compare(a: dict, b: dict, region: str = "train+eval", alpha: float = 0.05) -> dict:
    for rec in (a, b):
        if any(region not in run["times"] for run in rec["runs"]):
            raise RecordError(f"{rec.get('_path', 'bench')}: has no timing region {region!r}; "
                            f"it has {', '.join(rec['runs'][0]['times'])}")
    ta = [r["times"][region] for r in a["runs"]]
    tb = [r["times"][region] for r in b["runs"]]
    aa = [r["test_acc"] for r in a["runs"]]
    ab = [r["test_acc"] for r in b["runs"]]
    time_test, acc_test = welch(ta, tb), welch(aa, ab)

    dt, pt = time_test["diff"], time_test["p"]
    rel = dt / describe(ta)["mean"] if ta else math.nan
    if pt < alpha:
        time_text = f"B is {'faster' if dt < 0 else 'slower'} by {abs(dt):.3g} s ({abs(rel):.1%}, {_p(pt)})"
    else:
        time_text = f"time not different (B {dt:+.3g} s, {_p(pt)})"
    da, pa = acc_test["diff"], acc_test["p"]
    if pa < alpha:
        acc_text = (f"accuracy {'higher' if da > 0 else 'lower'} by {abs(da) * 100:.3g} points "
                    f"({_p(pa)})")
    else:
        acc_text = f"accuracy not different ({da * 100:+.3g} points, {_p(pa)})"
    few = min(len(ta), len(tb)) < 2
    verdict = ("too few runs for a test (need at least 2 each); " if few else "") + f"{time_text}, {acc_text}"
    return {
        "region": region,
        "alpha": alpha,
        "a": {"path": a.get("_path"), "recipe": a["recipe"], "recipe_hash": a.get("recipe_hash"),
              "time": describe_times(ta), "test_acc": describe(aa)},
        "b": {"path": b.get("_path"), "recipe": b["recipe"], "recipe_hash": b.get("recipe_hash"),
              "time": describe_times(tb), "test_acc": describe(ab)},
        "time": time_test,
        "test_acc": acc_test,
        "verdict": verdict,
        "same_device": a["environment"].get("device_name") == b["environment"].get("device_name"),
    }
