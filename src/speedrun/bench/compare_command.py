"""The ``compare`` command: two bench records side by side, with Welch t-tests."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ..files import atomic_write_json, check_output_file
from ..report.bench_record import load_bench
from ..report.console import make_console
from .common import CI_CAPTION, fmt
from .compare import compare

out = make_console()


def compare_command(args) -> int:
    if args.json:
        check_output_file(Path(args.json), "--json")
    a, b = load_bench(args.a), load_bench(args.b)
    result = compare(a, b, args.region, args.alpha)
    t = Table(title=f"compare ({args.region})")
    for col in ("", "A", "B", "B - A", "p"):
        t.add_column(col, justify="right")
    t.add_row("recipe", a["recipe"], b["recipe"], "", "")
    t.add_row("runs", str(len(a["runs"])), str(len(b["runs"])), "", "")
    t.add_row("time (s)", fmt(result["a"]["time"]), fmt(result["b"]["time"]),
              f"{result['time']['diff']:+.4f}", f"{result['time']['p']:.3g}")
    t.add_row("accuracy (%)", fmt(result["a"]["test_acc"], 100), fmt(result["b"]["test_acc"], 100),
              f"{result['test_acc']['diff'] * 100:+.3f}", f"{result['test_acc']['p']:.3g}")
    t.caption = CI_CAPTION
    out.print(t)
    if not result["same_device"]:
        out.print("[yellow]note: the two records come from different devices; times are not comparable[/]")
    out.print(f"A = {result['a']['path']}\nB = {result['b']['path']}")
    out.print(f"[bold]{result['verdict']}[/]")
    if args.json:
        atomic_write_json(Path(args.json), result)
    return 0
