"""The ``bench`` command: N seeded runs in one process, with statistics (bench.json)."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ..report.bench_record import P_VALUE_LABEL
from ..report.console import TrainingProgress, make_console
from .common import CI_CAPTION, fmt, out_folder, recipe_and_device
from .runner import run_bench
from .stats import p_value_text

out = make_console()


def bench_command(args) -> int:
    # monitoring evaluations are off unless asked for: they only cost wall time
    recipe, device = recipe_and_device(args, ["eval.every=0"])
    folder = out_folder(args.out, "bench", recipe.name, "bench.json")
    path = folder.path / "bench.json"
    try:
        with TrainingProgress(recipe.name, args.log_every) as progress:
            def on_run(i, run):
                progress.print(f"run {i + 1}/{args.runs} seed {run['seed']}: acc {run['test_acc']:.4f} "
                               f"(no TTA {run['test_acc_no_tta']:.4f}), train+eval {run['times']['train+eval']:.3f} s")
            record = run_bench(recipe, device, args.runs, args.data_dir, out_path=path, progress=progress,
                               on_run=on_run)
    except BaseException:
        folder.discard()
        raise
    print_bench(record, path)
    return 0


def print_bench(record: dict, path: Path) -> None:
    s = record["summary"]
    t = Table(title=f"bench {record['recipe']}: {s['runs']} runs on {record['environment']['device_name']}")
    t.add_column("metric", style="bold")
    t.add_column("mean ± std  [95% CI]", justify="right")
    t.add_row("test accuracy (%)", fmt(s["test_acc"], 100))
    t.add_row("without TTA (%)", fmt(s["test_acc_no_tta"], 100))
    for region, d in s["times"].items():
        t.add_row(f"{region} (s)", fmt(d))
    t.add_row("runs at target", f"{s['frac_at_target']:.0%} (target {record['target']:.2%})")
    t.add_row(P_VALUE_LABEL, p_value_text(s["p_value_mean_at_least_target"]))
    t.add_row("compile + warm-up (s)", f"{record['compile_seconds']:.2f}")
    f = record.get("flops") or {}
    if f.get("utilisation"):
        t.add_row("utilisation", f"{f['utilisation']:.1%} of {f['peak_flops_per_s']:.3g} FLOP/s ({f['peak_source']})")
    t.add_row("record", str(path))
    t.caption = CI_CAPTION
    out.print(t)
