"""The ``bench``, ``compare``, ``ablate``, ``flops`` and ``report`` commands."""
from __future__ import annotations

import math
import time
from pathlib import Path

from rich.table import Table

from ..engine.loop import Session
from ..engine.plan import plan_run
from ..engine.runtime import device_name, pick_device, resolve_runtime
from ..errors import RecordError, RunFolderError
from ..files import OutputFolder, atomic_write_bytes, atomic_write_json, check_output_file, read_json_record
from ..recipe import load_recipe
from ..report.bench_record import CI_METHOD, P_VALUE_LABEL, load_bench
from ..report.console import TrainingProgress, make_console
from ..engine import flops
from .ablate import run_ablation
from .compare import compare
from .runner import run_bench
from .stats import p_value_text
from .structure import real_batches, timed_step

out = make_console()


def _fmt(d: dict, scale: float = 1.0, digits: int = 3) -> str:
    lo, hi = d["ci95"]
    std = "n/a" if math.isnan(d["std"]) else f"{d['std'] * scale:.{digits}f}"
    ci = "" if math.isnan(lo) else f"  [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"
    return f"{d['mean'] * scale:.{digits}f} ± {std}{ci}"


CI_CAPTION = f"95% CI: {CI_METHOD}; for times its lower end is cut at 0 s, the least possible value"


def _out_folder(path: Path | None, kind: str, recipe: str, filename: str) -> OutputFolder:
    """The command's output folder, checked (nothing is written yet)."""
    folder = path or Path("runs") / f"{kind}-{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (folder / filename).exists():
        raise RunFolderError(f"{folder / filename} already exists; pass another --out folder so that no "
                             "record is overwritten")
    return OutputFolder(folder)


def _recipe_and_device(args, defaults: list[str]):
    """The recipe with the command's defaults and the user's --set/--seed, and the device; the
    run itself is planned (data opened, runtime resolved, batch fitted) by plan_run."""
    overrides = defaults + list(args.overrides) + ([f"train.seed={args.seed}"] if args.seed is not None else [])
    recipe = load_recipe(args.recipe, overrides)
    device = pick_device(args.device)
    resolve_runtime(recipe.runtime, device)     # a runtime this device refuses stops here, before any output
    return recipe, device


# ------------------------------------------------------------------------------------------
def bench_command(args) -> int:
    # monitoring evaluations are off unless asked for: they only cost wall time
    recipe, device = _recipe_and_device(args, ["eval.every=0"])
    folder = _out_folder(args.out, "bench", recipe.name, "bench.json")
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
    t.add_row("test accuracy (%)", _fmt(s["test_acc"], 100))
    t.add_row("without TTA (%)", _fmt(s["test_acc_no_tta"], 100))
    for region, d in s["times"].items():
        t.add_row(f"{region} (s)", _fmt(d))
    t.add_row("runs at target", f"{s['frac_at_target']:.0%} (target {record['target']:.2%})")
    t.add_row(P_VALUE_LABEL, p_value_text(s["p_value_mean_at_least_target"]))
    t.add_row("compile + warm-up (s)", f"{record['compile_seconds']:.2f}")
    f = record.get("flops") or {}
    if f.get("utilisation"):
        t.add_row("utilisation", f"{f['utilisation']:.1%} of {f['peak_flops_per_s']:.3g} FLOP/s ({f['peak_source']})")
    t.add_row("record", str(path))
    t.caption = CI_CAPTION
    out.print(t)


# ------------------------------------------------------------------------------------------
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
    t.add_row("time (s)", _fmt(result["a"]["time"]), _fmt(result["b"]["time"]),
              f"{result['time']['diff']:+.4f}", f"{result['time']['p']:.3g}")
    t.add_row("accuracy (%)", _fmt(result["a"]["test_acc"], 100), _fmt(result["b"]["test_acc"], 100),
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


# ------------------------------------------------------------------------------------------
def ablate_command(args) -> int:
    from ..report.html import ABLATION_COLUMNS, ablation_rows
    from ..report.plots import ablation_chart
    recipe, device = _recipe_and_device(args, ["eval.every=0"])
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None
    grid = args.epochs_grid
    previous = None
    if args.resume:
        if args.out is None:
            raise RunFolderError("--resume needs --out: the folder of the interrupted ablation")
        previous = read_json_record(args.out / "ablate.json", "ablate.json", "variants",
                                    "nothing to resume; run without --resume to start the ablation",
                                    RunFolderError)
        folder = OutputFolder(args.out)
    else:
        folder = _out_folder(args.out, "ablate", recipe.name, "ablate.json")
    try:
        with TrainingProgress(recipe.name, args.log_every) as progress:
            def on_variant(row):
                progress.print(f"{row['label']}: acc {row['test_acc']['mean']:.4f}, "
                               f"train+eval {row['time']['mean']:.3f} s")
            record = run_ablation(recipe, device, args.runs, args.data_dir, split(args.tricks), split(args.ladder),
                                  grid, folder.path / "ablate.json", progress, on_variant, previous)
    except BaseException:
        folder.discard()
        raise
    chart = folder.path / "ablation.png"
    atomic_write_bytes(chart, ablation_chart(record["variants"], record["target"]))
    t = Table(title=f"ablate {recipe.name}: {args.runs} runs per variant")
    for col in ABLATION_COLUMNS:
        t.add_column(col, justify="right")
    for row in ablation_rows(record):
        t.add_row(*row)
    out.print(t)
    out.print(f"record: {folder.path / 'ablate.json'}\nchart: {chart}")
    return 0


# ------------------------------------------------------------------------------------------
def time_split(session: Session, steps: int = 20, seed: int = 0) -> dict:
    """Seconds per step spent producing batches (data) and in the training step on them
    (model), with a device sync between the two, on a throw-away run of ``session``."""
    rt = session.runtime
    batches = real_batches(session, seed)
    x, y, size = next(batches)            # untimed: the run's set-up (reset, pipeline, whitening fit) is in here
    data_s = model_s = 0.0
    for _ in range(steps):
        model_s += timed_step(session, x, y, size)
        rt.synchronize()
        t0 = time.perf_counter()
        x, y, size = next(batches)
        rt.synchronize()
        data_s += time.perf_counter() - t0
    session.reset(seed)
    return {"steps": steps, "data_seconds_per_step": data_s / steps, "model_seconds_per_step": model_s / steps,
            "data_seconds_per_epoch": data_s / steps * session.steps_per_epoch,
            "model_seconds_per_epoch": model_s / steps * session.steps_per_epoch}


def flops_command(args) -> int:
    recipe, device = _recipe_and_device(args, [])
    if args.json:
        check_output_file(Path(args.json), "--json", overwrite=True)
    plan = plan_run(recipe, args.data_dir, device)
    recipe, ds, runtime = plan.recipe, plan.source, plan.runtime
    session = Session(recipe, ds, runtime, warm_up=True)
    total = session.run_flops(session.total_steps)
    name = device_name(runtime.device)
    peak = flops.known_peak(name, runtime.precision)
    measured = flops.measured_peak(runtime.device.type, runtime.precision)
    split = time_split(session, args.steps)
    ideal = total["total_flops"] / (peak or measured)
    model_rate = total["flops_per_train_image"] * recipe.data.batch_size / split["model_seconds_per_step"]
    record = {"recipe": recipe.name, "device_name": name, "precision": runtime.precision, **total,
              "known_peak_flops_per_s": peak, "measured_peak_flops_per_s": measured,
              "ideal_seconds": ideal, "split": split, "model_flops_per_s": model_rate,
              "model_utilisation": model_rate / (peak or measured)}
    t = Table(title=f"flops {recipe.name} on {name} ({runtime.precision})", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("forward FLOPs per image", f"{total['flops_per_forward_image'] / 1e6:,.2f} M")
    t.add_row("training FLOPs per image (fwd + bwd)", f"{total['flops_per_train_image'] / 1e6:,.2f} M")
    if len(total["train_steps_by_size"]) > 1:
        t.add_row("training steps by image size", ", ".join(f"{n} at {size}" for size, n in
                                                           total["train_steps_by_size"].items()))
    if total["steps_without_whitening_gradient"]:
        t.add_row("steps after the whitening bias froze", f"{total['steps_without_whitening_gradient']} "
                  "(no input gradient for the first convolution)")
    t.add_row("training FLOPs per run", f"{total['train_flops']:.4g}")
    t.add_row("evaluation FLOPs (with TTA)", f"{total['eval_flops']:.4g}")
    t.add_row("peak FLOP/s", (f"{peak:.4g} (datasheet); " if peak else "") + f"{measured:.4g} (measured matmul)")
    t.add_row("ideal time at 100% of peak", f"{ideal:.3g} s")
    t.add_row("data time per epoch", f"{split['data_seconds_per_epoch']:.3f} s")
    t.add_row("model time per epoch", f"{split['model_seconds_per_epoch']:.3f} s")
    t.add_row("model FLOP/s (training steps)", f"{model_rate:.4g} ({record['model_utilisation']:.1%} of peak)")
    out.print(t)
    if split["data_seconds_per_step"] > 0.2 * split["model_seconds_per_step"]:
        out.print("[yellow]the input pipeline takes over a fifth of each step: it is a bottleneck[/]")
    if args.json:
        atomic_write_json(Path(args.json), record)
    return 0


# ------------------------------------------------------------------------------------------
def report_command(args) -> int:
    from ..report.html import write_report
    target = Path(args.target)
    if not target.is_dir():
        raise RecordError(f"{target}: not a folder; pass a run folder or the folder holding bench.json/ablate.json")
    html_path, md_path = write_report(target)
    out.print(f"wrote {html_path}\nwrote {md_path}")
    return 0
