"""``speedrun report DIR``: a self-contained HTML page (images embedded) and a Markdown
version (images beside it) for a run folder, a bench record or an ablation record."""
from __future__ import annotations

import base64
import html
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RecipeError, RecordError
from ..files import atomic_write_bytes, atomic_write_text, check_output_folder, read_json_record, read_text
from ..optim.params import step_lr
from ..optim.schedule import lr_multipliers, momenta
from ..recipe import recipe_from_dict
from . import plots
from .bench_record import CI_METHOD, P_VALUE_LABEL, load_bench
from .evaluation import evaluation_section


@dataclass
class Report:
    title: str
    facts: list[tuple[str, str]] = field(default_factory=list)
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)
    figures: list[tuple[str, str, bytes]] = field(default_factory=list)   # (name, caption, png)


def _pct(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2%}"


def _num(x, fmt=".3g") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _ci(d: dict, scale=1.0, fmt=".3f") -> str:
    lo, hi = d["ci95"]
    return f"{d['mean'] * scale:{fmt}} ± {_num(d['std'] * scale, fmt)} (95% CI {_num(lo * scale, fmt)}–{_num(hi * scale, fmt)})"


def _schedule_figure(config: dict, steps: int, epochs: float) -> bytes:
    recipe = recipe_from_dict(config)
    per_epoch = max(1, round(steps / epochs))
    base = step_lr(recipe.optim, recipe.data.batch_size)
    lrs = [m * base for m in lr_multipliers(recipe.schedule, steps, per_epoch)]
    return plots.schedule(lrs, momenta(recipe.schedule, recipe.optim.momentum, steps), per_epoch)


def _environment_facts(env: dict) -> list[tuple[str, str]]:
    keys = ["device", "device_name", "precision", "compile", "channels_last", "torch_version", "cuda_version",
            "cpu_model", "cpu_cores", "git_commit", "git_dirty", "command"]
    facts = [(k, str(env[k])) for k in keys if k in env]
    if env.get("gpu_clocks"):
        facts.append(("gpu_clocks", json.dumps(env["gpu_clocks"])))
    return facts


def run_report(folder: Path) -> Report:
    s = read_json_record(folder / "summary.json", "summary.json", "recipe", "a finished run writes one")
    history = [json.loads(line) for line in read_text(folder / "metrics.jsonl", "metrics.jsonl").splitlines()
               if line.strip()]
    config = tomllib.loads(read_text(folder / "config.toml", "config.toml"))
    rep = Report(f"speedrun run: {s['recipe']}")
    rep.facts = [("test accuracy (" + s.get("tta", "TTA") + ")", _pct(s["test_acc"])),
                 ("test accuracy without TTA", _pct(s["test_acc_no_tta"])),
                 ("target", _pct(s.get("target"))), ("epochs", _num(s["epochs"], "g")),
                 ("train seconds", _num(s["train_seconds"], ".2f")),
                 ("compile seconds", _num(s["compile_seconds"], ".2f")),
                 ("wall seconds", _num(s["wall_seconds"], ".2f")), ("seed", str(s["seed"]))]
    if s.get("total_flops"):
        rep.facts += [("training FLOPs per image", f"{s['flops_per_train_image'] / 1e6:.1f} M"),
                      ("achieved FLOP/s", f"{_num(s['achieved_flops_per_s'], '.3g')}"),
                      ("utilisation", _pct(s.get("utilisation")))]
    stop = s.get("stop_at_target")                      # train.stop_at_target: where it stopped, its checks' cost
    if stop:
        reached = stop["reached"]
        rep.facts.append(("stop at target", (f"{_pct(reached['holdout_acc'])} on the validation split at epoch "
                                             f"{reached['epoch']}, step {reached['step']}" if reached else
                                             f"{_pct(stop['target'])} not reached on the validation split")
                          + f" ({stop['checks']} checks of {stop['holdout_images']:,} images, "
                            f"{stop['check_seconds']:.2f} s)"))
    rep.facts += _environment_facts(s)
    held = any(h.get("holdout_acc") is not None for h in history)
    rep.tables.append(("per epoch", ["epoch", "train loss", "train acc", *(["validation acc"] if held else []),
                                     "test acc (no TTA)", "lr", "seconds"],
                       [[str(h["epoch"]), f"{h['train_loss']:.4f}", _pct(h["train_acc"]),
                         *([_pct(h.get("holdout_acc"))] if held else []), _pct(h["test_acc"]),
                         f"{h['lr']:.4g}", f"{h['seconds']:.2f}"] for h in history]))
    rep.figures.append(("curves", "training curves", plots.training_curves([history])))
    rep.figures.append(("schedule", "learning-rate schedule", _schedule_figure(config, s["steps"], s["epochs"])))
    evaluated = evaluation_section(folder)              # what `speedrun evaluate` wrote, if it ran
    if evaluated:
        rep.facts += evaluated[0]
        rep.tables += evaluated[1]
        rep.figures += evaluated[2]
    return rep


def bench_report(path: Path) -> Report:
    b = load_bench(path)
    s = b["summary"]
    rep = Report(f"speedrun bench: {b['recipe']} ({s['runs']} runs)")
    rep.facts = [("mean test accuracy", _ci(s["test_acc"], 100, ".3f") + " %"),
                 ("target", _pct(b["target"])),
                 ("fraction of runs at target", _pct(s["frac_at_target"])),
                 (P_VALUE_LABEL, _num(s["p_value_mean_at_least_target"])),
                 ("compile / warm-up seconds", _num(b["compile_seconds"], ".2f"))]
    for region, d in s["times"].items():
        rep.facts.append((f"{region} seconds", _ci(d, 1, ".3f")))
    rep.facts.append(("95% CI", f"{CI_METHOD}; for times its lower end is cut at 0 s, the least possible value"))
    if b.get("flops"):
        f = b["flops"]
        rep.facts += [("FLOPs per training image", f"{f['flops_per_train_image'] / 1e6:.1f} M"),
                      ("total FLOPs per run", f"{f['total_flops']:.3g}"),
                      ("achieved FLOP/s", _num(f["achieved_flops_per_s"])),
                      (f"peak FLOP/s ({f.get('peak_source')})", _num(f["peak_flops_per_s"])),
                      ("utilisation", _pct(f["utilisation"])),
                      ("ideal seconds at 100% of peak", _num(f["ideal_seconds"], ".3g"))]
    rep.facts += _environment_facts(b["environment"])
    regions = list(s["times"])
    rep.tables.append(("runs", ["seed", "test acc", "no TTA", *regions],
                       [[str(r["seed"]), _pct(r["test_acc"]), _pct(r["test_acc_no_tta"]),
                         *[f"{r['times'][k]:.3f}" for k in regions]] for r in b["runs"]]))
    accs = [r["test_acc"] for r in b["runs"]]
    rep.figures.append(("accuracy", "accuracy across runs", plots.accuracy_histogram(accs, b["target"])))
    rep.figures.append(("times", "time per run", plots.time_per_run({k: [r["times"][k] for r in b["runs"]]
                                                                    for k in regions})))
    histories = [r["history"] for r in b["runs"] if r.get("history")]
    if histories:
        rep.figures.append(("curves", "training curves (all runs)", plots.training_curves(histories)))
    run0 = b["runs"][0]
    rep.figures.append(("schedule", "learning-rate schedule",
                        _schedule_figure(b["recipe_config"], run0["steps"], run0["epochs"])))
    return rep


def ablate_report(path: Path) -> Report:
    a = read_json_record(path, "ablate.json", "variants", "make one with `speedrun ablate`")
    rep = Report(f"speedrun ablate: {a['recipe']} ({a['runs_per_variant']} runs per variant)")
    rep.facts = [("target", _pct(a["target"])), ("epochs grid", ", ".join(f"{g:g}" for g in a["epochs_grid"]))]
    rep.facts += _environment_facts(a["environment"])
    for i, r in enumerate(a.get("resumed", []), 1):
        env = r["environment"]
        rep.facts.append((f"resumed ({i})", f"kept {len(r['kept'])} finished variants; the rest ran at commit "
                          f"{env.get('git_commit')} (dirty: {env.get('git_dirty')}) on {env.get('device_name')}"))
    rep.tables.append(("variants", ABLATION_COLUMNS, ablation_rows(a)))
    rep.figures.append(("ablation", "change against the reference variant",
                        plots.ablation_chart(a["variants"], a["target"])))
    return rep


ABLATION_COLUMNS = ["variant", "mean acc", "Δ acc (points)", "p", "train+eval s", "Δ time s", "p",
                    "epochs to target"]


def ablation_rows(a: dict) -> list[list[str]]:
    rows = []
    for v in a["variants"]:
        e = v["epochs_to_target"]
        ett = "—" if e["epochs"] is None else f"{'' if e['bound'] == '=' else e['bound'] + ' '}{e['epochs']:.3g}"
        rows.append([v["label"], _pct(v["test_acc"]["mean"]),
                     "—" if v["delta_acc"] is None else f"{v['delta_acc'] * 100:+.2f}", _num(v["p_acc"], ".2g"),
                     f"{v['time']['mean']:.3f}",
                     "—" if v["delta_time"] is None else f"{v['delta_time']:+.3f}", _num(v["p_time"], ".2g"), ett])
    return rows


def build(target: Path) -> Report:
    for name, builder in (("summary.json", lambda: run_report(target)),
                          ("bench.json", lambda: bench_report(target / "bench.json")),
                          ("ablate.json", lambda: ablate_report(target / "ablate.json"))):
        if (target / name).is_file():
            try:
                return builder()
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecipeError) as err:
                raise RecordError(f"{target}: its records are not complete speedrun records, so no report can be "
                                  f"made ({type(err).__name__}: {str(err)[:200]}); was the folder edited or "
                                  "written by another version?") from None
    raise RecordError(f"{target}: no summary.json, bench.json or ablate.json here; point `speedrun report` "
                      "at a run folder or the folder of a bench or ablate record")


def to_html(rep: Report) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(rep.title)}</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
             "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%}</style>",
             f"</head><body><h1>{e(rep.title)}</h1>", "<table class='facts'>"]
    parts += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rep.facts]
    parts.append("</table>")
    for name, caption, png in rep.figures:
        data = base64.b64encode(png).decode()
        parts.append(f"<figure><img id='fig-{e(name)}' alt='{e(caption)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{e(caption)}</figcaption></figure>")
    for title, header, rows in rep.tables:
        parts.append(f"<h2>{e(title)}</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def to_markdown(rep: Report, files_dir: str) -> str:
    lines = [f"# {rep.title}", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in rep.facts]
    for name, caption, _ in rep.figures:
        lines += ["", f"![{caption}]({files_dir}/{name}.png)"]
    for title, header, rows in rep.tables:
        lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_report(target: Path) -> tuple[Path, Path]:
    check_output_folder(target, "report folder")          # before the work of building the report
    rep = build(target)
    check_output_folder(target, "report folder", need_bytes=sum(len(png) for *_, png in rep.figures) + (1 << 20))
    files = target / "report_files"
    for name, _, png in rep.figures:
        atomic_write_bytes(files / f"{name}.png", png)
    html_path, md_path = target / "report.html", target / "report.md"
    atomic_write_text(html_path, to_html(rep))
    atomic_write_text(md_path, to_markdown(rep, files.name))
    return html_path, md_path
