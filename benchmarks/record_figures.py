"""The figures of a ``gpu_record.py`` record: each system's (or variant's) summary over its
finished runs (mean, sd, 95% interval, median, min, max of the seconds and the TTA accuracy;
recompiles in the timed runs), the ``--pair`` comparisons, and the table printed at the end."""
from __future__ import annotations

import math
import statistics

from speedrun.bench.stats import describe, describe_times, welch


def summarize(runs: list[dict]) -> dict:
    """Over the runs that finished (a system stopped at its limit keeps its first runs)."""
    secs = [r["seconds"] for r in runs]
    accs = [r["test_acc"] for r in runs]
    out = {"runs": len(runs), "seconds": describe_times(secs), "test_acc": describe(accs)}
    if secs:
        out["seconds"].update(median=statistics.median(secs), min=min(secs), max=max(secs))
        out["test_acc"].update(median=statistics.median(accs), min=min(accs), max=max(accs))
    counts = [r.get("recompiles") for r in runs]
    out["recompiles"] = sum(counts) if counts and None not in counts else None
    return out


def paired_seeds(ea: dict, eb: dict) -> dict | None:
    """Per-seed accuracy differences A - B where both systems ran the same seeds (speedrun
    systems: ``speedrun bench``'s seeds), with a paired t-test; None otherwise."""
    from scipy import stats
    sa = {r.get("seed"): r["test_acc"] for r in ea["runs"] if r.get("seed") is not None}
    sb = {r.get("seed"): r["test_acc"] for r in eb["runs"] if r.get("seed") is not None}
    seeds = sorted(set(sa) & set(sb))
    if not seeds:
        return None
    diffs = [sa[k] - sb[k] for k in seeds]
    p = math.nan
    if len(seeds) >= 2 and statistics.pstdev(diffs) > 0:
        p = float(stats.ttest_rel([sa[k] for k in seeds], [sb[k] for k in seeds]).pvalue)
    return {"seeds": seeds, "test_acc_diff_mean": statistics.fmean(diffs), "test_acc_diff_p": p}


def pair_figures(pairs: list[tuple[str, str]], entries: dict) -> list[dict]:
    """A over B for each asked pair whose both systems have runs: the mean and median time
    ratios, both accuracies, Welch's tests, and the paired-seed difference where there is one."""
    out = []
    for a, b in pairs:
        ea, eb = entries.get(a), entries.get(b)
        if not (ea and eb and ea.get("runs") and eb.get("runs")):
            continue
        ta, tb = [r["seconds"] for r in ea["runs"]], [r["seconds"] for r in eb["runs"]]
        aa, ab = [r["test_acc"] for r in ea["runs"]], [r["test_acc"] for r in eb["runs"]]
        ma, mb = statistics.fmean(ta), statistics.fmean(tb)
        meda, medb = statistics.median(ta), statistics.median(tb)
        fig = {"a": a, "b": b, "time_ratio": ma / mb if mb else None,
               "time_ratio_median": meda / medb if medb else None,
               "seconds_a": ma, "seconds_b": mb, "seconds_median_a": meda, "seconds_median_b": medb,
               "test_acc_a": statistics.fmean(aa), "test_acc_b": statistics.fmean(ab),
               "test_acc_median_a": statistics.median(aa), "test_acc_median_b": statistics.median(ab),
               "test_acc_diff": statistics.fmean(aa) - statistics.fmean(ab),
               "time_welch_p": welch(tb, ta)["p"], "test_acc_welch_p": welch(ab, aa)["p"],
               "runs_a": len(ta), "runs_b": len(tb)}
        paired = paired_seeds(ea, eb)
        if paired:
            fig["paired"] = paired
        out.append(fig)
    return out


def status(entry: dict) -> str:
    if entry.get("cut"):
        cut = entry["cut"]
        return f"  CUT by {cut['by']} at {cut['at_seconds']:.0f} s after {cut['runs_finished']} runs"
    return "" if entry.get("ok") else "  FAILED: " + str(entry.get("error"))


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'system':58s} {'runs':>4s} {'acc mean':>9s} {'acc med':>8s} {'seconds, mean ± sd':>19s} "
          f"{'median':>7s} {'recomp':>6s} {'warm-up':>8s} {'process':>8s}")
    for e in rows:
        s = e.get("summary") or {}
        t, a = s.get("seconds") or {}, s.get("test_acc") or {}
        sd = t.get("std", math.nan)
        secs = f"{t['mean']:.3f} ± {sd:.3f}" if t.get("n") else "-"
        med = f"{t['median']:.3f}" if t.get("n") else "-"
        acc = f"{a['mean']:.2%}" if a.get("n") else "-"
        acc_med = f"{a['median']:.2%}" if a.get("n") else "-"
        rec = s.get("recompiles")
        warm = e.get("warmup_seconds")
        name = f"{e.get('kind', '')} {e.get('system') or e.get('variant')}"
        print(f"{name[:58]:58s} {s.get('runs', 0):4d} {acc:>9s} {acc_med:>8s} {secs:>19s} {med:>7s} "
              f"{'-' if rec is None else rec:>6} {(f'{warm:.1f} s' if warm is not None else '-'):>8s} "
              f"{e.get('process_wall_seconds', 0):6.1f} s{status(e)}")
