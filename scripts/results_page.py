#!/usr/bin/env python3
"""Write docs/results.md: every record under benchmarks/results/, in tables by what it measured.

    python scripts/results_page.py            # (re)write docs/results.md
    python scripts/results_page.py --check    # exit 1 when docs/results.md is not what it would write

Every figure on the page is read from a record (or computed from a record's figures: means,
minima, maxima, ratios); nothing is typed in by hand. A record whose format this script does
not know, or cannot read, is listed under "Other records" by its file name and its own
"benchmark"/"what" text, never left out. The output depends only on the records: files are
read in sorted order and numbers written in fixed formats, so that writing it twice gives
the same bytes.

A record is a JSON file: every file at the top of benchmarks/results/ (a non-JSON file there
with the stem of a JSON record, such as a `speedrun compare` text, is named beside it) and
every JSON file in its folders (`speedrun bench`/`ablate` folders, run folders, GPU folders;
their reports, plots and logs are not records).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"
COMMAND = "python scripts/results_page.py"
DASH = "—"
DATE = re.compile(r"\b(20\d\d-[01]\d-[0-3]\d)\b")


# ------------------------------------------------------------------------------------------
# Number formats (fixed, so that the page is the same bytes every time)
# ------------------------------------------------------------------------------------------

def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def as_pct(x):
    """An accuracy as a percentage: records hold fractions (0.9389), a few percentages (93.89)."""
    if not is_num(x):
        return None
    return x * 100 if x <= 1.0 else float(x)


def pct(x) -> str:
    p = as_pct(x)
    return DASH if p is None else f"{p:.2f}%"


def num(x) -> str:
    """Seconds and other magnitudes: one decimal from 10 up, three below."""
    if not is_num(x):
        return DASH
    return f"{x:,.1f}" if abs(x) >= 10 else f"{x:.3f}"


def ratio(x) -> str:
    return f"{x:.3f}" if is_num(x) else DASH


def sci(x) -> str:
    """2.15e14"""
    if not is_num(x) or x == 0:
        return DASH if not is_num(x) else "0"
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant}e{int(exp)}"


def count(x) -> str:
    if not is_num(x):
        return DASH
    return f"{x:,.0f}" if float(x).is_integer() or abs(x) >= 1000 else f"{x:,.1f}"


def mean(values):
    vals = [v for v in values if is_num(v)]
    return sum(vals) / len(vals) if vals else None


def median(values):
    vals = [v for v in values if is_num(v)]
    return statistics.median(vals) if vals else None


def spread(values, fmt=num) -> str:
    """'mean (min–max)' of several values, the value alone for one."""
    vals = [v for v in values if is_num(v)]
    if not vals:
        return DASH
    if len(vals) == 1:
        return fmt(vals[0])
    return f"{fmt(sum(vals) / len(vals))} ({fmt(min(vals))}–{fmt(max(vals))})"


def acc_spread(values) -> str:
    vals = [as_pct(v) for v in values if as_pct(v) is not None]
    if not vals:
        return DASH
    if len(vals) == 1:
        return f"{vals[0]:.2f}%"
    return f"{sum(vals) / len(vals):.2f}% ({min(vals):.2f}–{max(vals):.2f})"


def mean_sd(values, fmt=num) -> str:
    vals = [v for v in values if is_num(v)]
    if not vals:
        return DASH
    if len(vals) == 1:
        return fmt(vals[0])
    return (f"{fmt(sum(vals) / len(vals))} ± {fmt(statistics.stdev(vals))} "
            f"({fmt(min(vals))}–{fmt(max(vals))})")


def seeds_text(seeds) -> str:
    s = sorted({x for x in seeds if isinstance(x, int) and not isinstance(x, bool)})
    if not s:
        return ""
    if len(s) == 1:
        return f"seed {s[0]}"
    if s == list(range(s[0], s[-1] + 1)):
        return f"seeds {s[0]}–{s[-1]}"
    return "seeds " + ", ".join(str(x) for x in s)


def runs_cell(n, seeds=()) -> str:
    st = seeds_text(seeds)
    return f"{n} ({st})" if st else str(n)


def cell(text) -> str:
    """Markdown-table-safe text."""
    text = " ".join(str(text).split())
    return text.replace("|", "\\|") if text else DASH


def code(text) -> str:
    return f"`{text}`" if text else DASH


# ------------------------------------------------------------------------------------------
# Records, and what every row says about where and when
# ------------------------------------------------------------------------------------------

class Record:
    def __init__(self, rel: str, data=None, error: str | None = None, companions=(), root: Path = RESULTS):
        self.rel, self.data, self.error, self.companions, self.root = rel, data, error, list(companions), root

    def name_cell(self) -> str:
        out = f"`{self.rel}`"
        for c in self.companions:
            out += f" (+ `{c}`)"
        return out


def load_records(results: Path) -> list[Record]:
    records = []
    top = sorted(p for p in results.iterdir() if p.is_file())
    json_stems = {p.stem for p in top if p.suffix == ".json"}
    companions: dict[str, list[str]] = {}
    for p in top:
        if p.suffix != ".json" and p.stem in json_stems:
            companions.setdefault(p.stem, []).append(p.name)
    paths = [p for p in top if p.suffix == ".json" or p.stem not in json_stems]
    paths += [p for d in sorted(q for q in results.iterdir() if q.is_dir()) for p in sorted(d.rglob("*.json"))]
    for p in sorted(paths, key=lambda q: q.relative_to(results).as_posix()):
        rel = p.relative_to(results).as_posix()
        comp = sorted(companions.get(p.stem, [])) if p.parent == results else []
        if p.suffix != ".json":
            records.append(Record(rel, error="not a JSON record", root=results))
            continue
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            records.append(Record(rel, error=f"not readable as JSON ({type(err).__name__})", companions=comp,
                                  root=results))
            continue
        records.append(Record(rel, data, companions=comp, root=results))
    return records


def environments(data) -> list[dict]:
    """The environment dicts a record holds: its own "environment", else every nested dict
    that names a torch version or a commit (the sides of an A/B record, a run's summary)."""
    if not isinstance(data, dict):
        return []
    env = data.get("environment")
    if isinstance(env, dict):
        return [env]
    found, queue = [], [data]
    while queue:
        node = queue.pop(0)
        if isinstance(node, dict):
            if isinstance(node.get("environment"), dict):      # (a record inside the record: its own)
                found.append(node["environment"])
                continue
            if "torch_version" in node or "git_commit" in node:
                found.append(node)
            queue.extend(node.values())
        elif isinstance(node, list):
            queue.extend(node)
    if not found and ("torch" in data or "gpu" in data):                 # a peer script's own result
        found.append({"torch_version": data.get("torch"), "gpu_name": data.get("gpu")})
    if not found and isinstance(data.get("device_name"), str):           # only the device's name
        found.append({"device_name": data["device_name"]})
    return found


def clean_cpu(name: str) -> str:
    name = re.sub(r"\((R|TM|r|tm)\)", "", name)
    name = re.sub(r"\b(Processor|CPU)\b", "", name)
    name = re.sub(r"\(\d+ threads?\)", "", name)
    return " ".join(name.split())


def device_of(env: dict) -> str | None:
    if env.get("gpu_name"):
        return str(env["gpu_name"])
    if env.get("device") == "cuda" and env.get("device_name"):
        return str(env["device_name"])
    model = env.get("cpu_model") or env.get("device_name")
    if not model:
        return None
    fm = env.get("cpu_family_model")
    return clean_cpu(str(model)) + (f" {fm}" if fm else "")


def is_gpu(env: dict) -> bool:
    return bool(env.get("gpu_name")) or env.get("device") == "cuda"


def commits(envs, given=None) -> str:
    """The distinct commits of some environments, "(dirty)" where any of them was dirty."""
    out: dict[str, bool] = {}
    for e in envs:
        c = given if isinstance(given, str) and given else e.get("git_commit")
        if c:                                   # ("dirty" belongs to the environment's own commit)
            dirty = bool(e.get("git_dirty")) and str(e.get("git_commit", ""))[:7] == str(c)[:7]
            out[str(c)[:7]] = out.get(str(c)[:7], False) or dirty
    return ", ".join(c + (" (dirty)" if dirty else "") for c, dirty in out.items()) or DASH


def distinct(values) -> str:
    out = []
    for v in values:
        if v and v not in out:
            out.append(v)
    return ", ".join(out) if out else DASH


def date_of(rec: Record) -> str:
    """A date the record gives: a date field, else the one date its note names, else the one
    date in its folder's name."""
    d = rec.data if isinstance(rec.data, dict) else {}
    for key in ("date", "started", "timestamp", "when"):
        for src in (d, d.get("environment") if isinstance(d.get("environment"), dict) else {}):
            m = DATE.search(str(src.get(key, "")))
            if m:
                return m.group(1)
    found = sorted(set(DATE.findall(str(d.get("note", ""))))) if isinstance(d.get("note"), str) else []
    if len(found) == 1:
        return found[0]
    found = sorted(set(DATE.findall(rec.rel)))
    return found[0] if len(found) == 1 else DASH


def run_commits(d: dict) -> list[str]:
    """The commits that the runs inside a record (their summaries) name, beside the record's own."""
    found, queue = [], [v for k, v in d.items() if k != "environment"]
    while queue:
        node = queue.pop(0)
        if isinstance(node, dict):
            if isinstance(node.get("git_commit"), str) and node["git_commit"][:7] not in found:
                found.append(node["git_commit"][:7])
            queue.extend(node.values())
        elif isinstance(node, list):
            queue.extend(node)
    return found


def where(rec: Record, envs: list[dict] | None = None) -> list[str]:
    """device, torch, commit and date cells (from ``envs`` where given, else the record's own).
    Where the runs inside a record name other commits than the record (a commit landed while
    it ran), they follow in brackets."""
    d = rec.data if isinstance(rec.data, dict) else {}
    own = envs is None and isinstance(d.get("environment"), dict)
    envs = environments(d) if envs is None else envs
    given = d.get("commit") if isinstance(d.get("commit"), str) else None
    commit = commits(envs, given) if envs else (given or "")[:7] or DASH
    if own and not given:
        runs = run_commits(d)
        if runs and set(runs) != {str(e.get("git_commit"))[:7] for e in envs}:
            commit += f" (runs: {', '.join(runs)})"
    return [cell(distinct(device_of(e) for e in envs)),
            cell(distinct(e.get("torch_version") for e in envs)),
            cell(commit),
            date_of(rec)]


def record_gpu(rec: Record) -> bool:
    return any(is_gpu(e) for e in environments(rec.data))


WHERE = ["device", "torch", "commit", "date"]


def what_text(data) -> str:
    if not isinstance(data, dict):
        return ""
    for key in ("benchmark", "what", "label", "script"):
        if isinstance(data.get(key), str):
            return data[key]
    return ""


def settings(command: str | None, verb: str = "train") -> tuple[str | None, str]:
    """(recipe, the options after it) of a `speedrun train|bench RECIPE ...` command line,
    leaving out where the data and outputs are."""
    if not isinstance(command, str):
        return None, ""
    m = re.search(rf"\b{verb}\s+(\S+)(.*)$", command)
    if not m:
        return None, ""
    recipe, rest = m.group(1), m.group(2)
    kept = []
    for part in re.split(r"\s+(?=--)", rest.strip()):
        opt = part.split(" ", 1)[0]
        if not part or opt in ("--data-dir", "--out", "--seed", "--runs", "--log-every"):
            continue
        kept.append(part[len("--set "):] if opt == "--set" else part)
    return recipe, ", ".join(kept)


def run_label(recipe, opts, cold=None) -> str:
    out = code(recipe) if recipe else DASH
    if opts:
        out += " " + opts
    if cold:
        out += "; cold caches"
    return cell(out)


# ------------------------------------------------------------------------------------------
# The page's groups and tables
# ------------------------------------------------------------------------------------------

GROUPS = [
    ("gpu", "CIFAR-10 on a GPU",
     ("speedrun's recipes (`speedrun bench`: a warm-up, then seeded runs in one process, timed over `train+eval`) "
      "and airbench's own scripts (each run timed by the script's own timer) on one GPU; the GPU smoke run of the "
      "recipe matrix; a kernel-time profile of one run.")),
    ("cifar_cpu", "CIFAR-10 on CPUs: whole runs",
     ("`speedrun train` as a user runs it (`benchmarks/train_cli.py`): seconds are the whole process, from the "
      "interpreter's start to its exit; `train_seconds` is the run's own timed region. Settings are the command's "
      "options beyond the recipe.")),
    ("peers", "speedrun beside the plain loop and Lightning (peers)",
     ("`benchmarks/peers.py`: the cifar10-94 algorithm trained by a plain PyTorch loop, a Lightning `Trainer` and "
      "`speedrun train`, one after another on the same CPU, each in a fresh process. Each peer's cell: TTA "
      "accuracy; seconds per training epoch; the final TTA evaluation; the whole process (medians over rounds "
      "where there are several). The last column divides speedrun's seconds by the fastest other peer's.")),
    ("fashion", "Fashion-MNIST demo",
     ("The `fashion-mnist` demo: whole `speedrun train` processes, `speedrun bench` (seeded runs in one process, "
      "timed over `train+eval`) and `speedrun ablate` (each trick left out in turn).")),
    ("imagenette", "Imagenette",
     ("The `imagenette` recipes (and `folder` on the same photos) on the squashed 224 px copy of imagenette2 "
      "that `benchmarks/README.md` describes: whole `speedrun train` processes, and the recipe's tuning runs.")),
    ("photo", "Photo input pipelines",
     ("Decoding a photo folder once against streaming it, the input pipelines alone, whole runs of the "
      "`folder` recipe on CIFAR-10 exported as JPEG files, and whole `speedrun train` runs on a synthetic "
      "Imagenette-shaped folder against the model step alone (`benchmarks/photo_throughput.py`).")),
    ("resnet50", "ResNet-50 training throughput",
     ("`benchmarks/imagenet_throughput.py`: one device's training step of the recipe alone on a device-resident "
      "random batch, then fed by speedrun's pipelines from a synthetic ImageNet-like JPEG folder; images/s are "
      "medians of the timed blocks; a pipeline is model-bound at 90% of the model step's images/s or more.")),
    ("ab", "A against B: alternating or paired runs",
     ("Two settings or two trees measured one after the other on the same machine: B ÷ A below 1 means B took "
      "less (seconds) or counted fewer (ops, page faults).")),
    ("step", "Training step structure and cost",
     ("One training step counted (graph breaks, compiled regions, eager ops and host syncs per step), timed, and "
      "its FLOPs; levers of the eager CPU step; inputs of the compiled graphs as CUDA graphs would see them.")),
    ("tta", "Test-time augmentation views",
     ("`benchmarks/tta_views.py`: test-time augmentation variants evaluated on finished runs' saved weights, "
      "each variant on the same model and test set.")),
    ("other_runs", "Other whole runs", "Whole `speedrun train` runs not grouped above."),
    ("other", "Other records",
     "Records whose format this page does not read, by file name and their own description."),
]

RUN_HEAD = ["record", "run", *WHERE, "runs", "accuracy: mean (min–max)", "whole process, s: mean (min–max)",
            "train_seconds: mean"]
SUMMARY_HEAD = ["record", "run", *WHERE, "accuracy (without TTA)", "epochs", "train_seconds", "whole run, s"]
BENCH_HEAD = ["record", "run", *WHERE, "runs", "accuracy: mean ± sd", "train+eval, s: mean ± sd",
              "p(mean ≥ target)"]

# (table id, group id, title, headers), in page order
TABLES = [
    ("gpu_systems", "gpu", "Systems, N timed runs each after a warm-up",
     ["record", "system", *WHERE, "runs", "accuracy: mean (min–max)", "seconds: mean ± sd (min–max)", "timed",
      "warm-up, s"]),
    ("gpu_pairs", "gpu", "Pairs (`gpu_record.py --pair A:B`)",
     ["record", *WHERE, "A", "B", "accuracy A / B", "seconds A / B", "A ÷ B"]),
    ("gpu_runs", "gpu", "Whole runs", RUN_HEAD),
    ("gpu_smoke", "gpu", "GPU smoke run (`benchmarks/gpu_smoke.py`): each entry once",
     ["record", "entry", *WHERE, "ran", "compile, s", "recompiles", "step, ms", "GPU busy"]),
    ("gpu_profile", "gpu", "Kernel time of one profiled run",
     ["record", "run", *WHERE, "kernels", "kernel time, s", "wall, s", "largest kinds (share of kernel time)"]),
    ("cifar_cpu_runs", "cifar_cpu", "Whole processes", RUN_HEAD),
    ("cifar_cpu_summary", "cifar_cpu", "Single runs kept whole (run folders)", SUMMARY_HEAD),
    ("peers", "peers", "Peers", ["record", *WHERE, "epochs × rounds", "plain loop", "Lightning", "speedrun",
                                 "speedrun ÷ fastest peer: epoch / final TTA / process"]),
    ("fashion_runs", "fashion", "Whole processes", RUN_HEAD),
    ("fashion_bench", "fashion", "`speedrun bench`", BENCH_HEAD),
    ("fashion_ablate", "fashion", "`speedrun ablate`",
     ["record", *WHERE, "runs per variant", "recipe's accuracy", "the largest losses without a trick"]),
    ("imagenette_runs", "imagenette", "Whole processes", RUN_HEAD),
    ("imagenette_sweep", "imagenette", "Variants over seeds (`benchmarks/accuracy_sweep.py`: processes side by side, "
     "so no times)",
     ["record", "variant", *WHERE, "runs", "accuracy: mean ± sd (min–max)", "p (mean > target)",
      "against the first variant of its recipe: points (Welch p)"]),
    ("imagenette_tuning", "imagenette", "Tuning runs",
     ["record", *WHERE, "run", "accuracy", "train_seconds", "overrides"]),
    ("photo_input", "photo", "Decode once against stream (`benchmarks/photo_input.py`)",
     ["record", *WHERE, "decode once, images/s", "pipeline alone, images/s: streamed / cached",
      "one training epoch: images/s, accuracy"]),
    ("photo_stream", "photo", "Streamed pipeline against a per-sample Pillow pipeline",
     ["record", *WHERE, "images", "workers", "images/s by pipeline and crop", "speed-up"]),
    ("photo_throughput", "photo", "Whole runs against the model step (`benchmarks/photo_throughput.py`)",
     ["record", "recipe, run", *WHERE, "images", "whole process, s", "train_seconds (compile before it, s)",
      "pipeline images/s", "model step images/s", "pipeline ÷ model step", "bound by"]),
    ("photo_runs", "photo", "Whole processes", RUN_HEAD),
    ("photo_summary", "photo", "Single runs kept whole (run folders)", SUMMARY_HEAD),
    ("resnet50", "resnet50", "Model step and pipelines",
     ["record", "recipe", *WHERE, "batch × px", "model step, images/s", "pipelines: images/s (÷ model step, bound by)",
      "compile, s"]),
    ("ab", "ab", "A against B", ["record", *WHERE, "A → B", "figures: A → B (× B ÷ A; ± points of accuracy)"]),
    ("step_structure", "step", "Structure of one training step (`benchmarks/step_structure.py`)",
     ["record", *WHERE, "recipe", "eager, by precision: eager ops / host syncs per step",
      "compiled (inductor), by precision: graph breaks / compiled regions / eager ops / host syncs per step"]),
    ("step_timing", "step", "CPU milliseconds per training step, eager and compiled",
     ["record", *WHERE, "recipe", "precision", "eager, ms: median", "compiled, ms: median"]),
    ("step_levers", "step", "Levers of an eager CPU step (`benchmarks/cpu_step_levers.py`): step time ratio",
     ["record", *WHERE, "recipe", "lever", "ratio by training size"]),
    ("step_cuda_graphs", "step", "Compiled graphs' inputs (`benchmarks/cuda_graph_inputs.py`)",
     ["record", *WHERE, "rows", "graphs", "mutated inputs not static", "compile, s"]),
    ("step_flops", "step", "FLOPs (`speedrun flops`)",
     ["record", "recipe", *WHERE, "precision", "FLOPs per training image", "FLOPs per run", "model FLOP/s",
      "of measured peak"]),
    ("tta", "tta", "View sets", ["record", *WHERE, "recipe", "runs", "views", "views per image",
                                 ("by share of the test images given the views: accuracy (mean, min–max over "
                                  "runs), seconds")]),
    ("other_runs", "other_runs", "Whole processes", RUN_HEAD),
    ("other_summary", "other_runs", "Single runs kept whole (run folders)", SUMMARY_HEAD),
    ("other_sweep", "other_runs", "Variants over seeds (`benchmarks/accuracy_sweep.py`)",
     ["record", "variant", *WHERE, "runs", "accuracy: mean ± sd (min–max)", "p (mean > target)",
      "against the first variant of its recipe: points (Welch p)"]),
    ("other", "other", "Not read", ["record", *WHERE, "what the record says it is", "why not read"]),
]


# ------------------------------------------------------------------------------------------
# Readers: each gives (table id, cells) rows for one record, or raises
# ------------------------------------------------------------------------------------------

def train_cli_rows(rec: Record, d: dict, table=None):
    runs = [r for r in d["runs"] if isinstance(r, dict)]
    sums = [r.get("summary") or {} for r in runs]
    if not any(is_num(s.get("test_acc")) for s in sums):
        raise ValueError("no run with a summary")
    recipe, opts = settings(d.get("command"))
    recipe = d.get("recipe") or recipe
    gpu = record_gpu(rec)
    table = table or run_table(recipe, d.get("command"), gpu)
    return [(table, [rec.name_cell(), run_label(recipe, opts, d.get("cold_cache")), *where(rec),
                     runs_cell(len(runs), [s.get("seed") for s in sums]),
                     acc_spread([s.get("test_acc") for s in sums]),
                     spread([r.get("process_wall_seconds") for r in runs]),
                     num(mean([s.get("train_seconds") for s in sums]))])]


def run_table(recipe, command, gpu: bool) -> str:
    r = str(recipe or "")
    if gpu:
        return "gpu_runs"
    if r.startswith("fashion"):
        return "fashion_runs"
    if r.startswith("imagenette") or "imagenette" in str(command or ""):
        return "imagenette_runs"
    if r.startswith("cifar10"):
        return "cifar_cpu_runs"
    if r == "folder":
        return "photo_runs"
    return "other_runs"


def combined_rows(rec: Record, d: dict):
    recipe, opts = settings(d.get("command"))
    if recipe is None:
        m = re.match(r"\s*([a-z0-9-]+)", what_text(d))
        recipe = m.group(1) if m else None
    accs = d["test_acc"]
    walls = d.get("process_wall_seconds") or []
    parts = d.get("combined_from") or d.get("parts") or []
    return [(run_table(recipe, d.get("command"), record_gpu(rec)),
             [rec.name_cell(), run_label(recipe, opts) + f"; combined from {len(parts)} records", *where(rec),
              str(len(accs)), acc_spread(accs), spread(walls), DASH])]


def wrapped_run_rows(rec: Record, d: dict):
    """A record around one train_cli record (`run`), with its own reading."""
    inner = Record(rec.rel, d["run"], companions=rec.companions, root=rec.root)
    (table, cells), = train_cli_rows(inner, d["run"])
    cells[2:6] = where(rec)
    return [(table, cells)]


def summary_rows(rec: Record, d: dict):
    recipe, opts = settings(d.get("command"))
    recipe = d.get("recipe") or recipe
    table = {"cifar_cpu_runs": "cifar_cpu_summary", "photo_runs": "photo_summary"}.get(
        run_table(recipe, d.get("command"), record_gpu(rec)), "other_summary")
    acc = pct(d.get("test_acc"))
    if d.get("test_acc_no_tta") is not None:
        acc += f" ({pct(d['test_acc_no_tta'])})"
    return [(table, [rec.name_cell(), run_label(recipe, opts), *where(rec), acc, num(d.get("epochs")),
                     num(d.get("train_seconds")), num(d.get("wall_seconds"))])]


def bench_rows(rec: Record, d: dict):
    env = d.get("environment") or {}
    recipe, opts = settings(env.get("command"), "bench")
    recipe = d.get("recipe") or recipe
    runs = d.get("runs") or []
    accs = [r.get("test_acc") for r in runs]
    secs = [(r.get("times") or {}).get("train+eval") for r in runs]
    if record_gpu(rec):
        label = cell(f"`speedrun bench {recipe}`" + (f" {opts}" if opts else ""))
        return [("gpu_systems", [rec.name_cell(), label, *where(rec), runs_cell(len(runs), [r.get("seed") for r in runs]),
                                 acc_spread(accs), mean_sd(secs), "train+eval", num(d.get("compile_seconds"))])]
    s = d.get("summary") or {}
    a = s.get("test_acc") or {}
    t = (s.get("times") or {}).get("train+eval") or {}
    acc = DASH if a.get("mean") is None else f"{pct(a['mean'])} ± {as_pct(a.get('std') or 0):.2f}"
    sec = DASH if t.get("mean") is None else f"{num(t['mean'])} ± {num(t.get('std') or 0)}"
    table = run_table(recipe, env.get("command"), False)
    table = "fashion_bench" if table == "fashion_runs" else table
    if table != "fashion_bench":                       # (a bench of another recipe: its runs as a whole-run row)
        return [(table, [rec.name_cell(), run_label(recipe, opts) + "; `speedrun bench`, train+eval", *where(rec),
                         runs_cell(len(runs), [r.get("seed") for r in runs]), acc_spread(accs), spread(secs),
                         DASH])]
    p = s.get("p_value_mean_at_least_target")
    return [(table, [rec.name_cell(), run_label(recipe, opts), *where(rec),
                     runs_cell(len(runs), [r.get("seed") for r in runs]), acc, sec,
                     sci(p) if is_num(p) and p < 0.001 else ratio(p)])]


def peer_script_rows(rec: Record, d: dict):
    runs = d.get("runs") or []
    return [("gpu_systems", [rec.name_cell(), cell(f"`{d['script']}` (airbench's script)"), *where(rec),
                             str(len(runs)), acc_spread([r.get("tta_acc") for r in runs]),
                             mean_sd([r.get("seconds") for r in runs]), "the script's own timer",
                             num(d.get("warmup_wall_seconds"))])]


def gpu_record_rows(rec: Record, d: dict):
    rows = []
    for s in d["systems"]:
        runs = s.get("runs") or []
        label = f"`speedrun bench {s.get('recipe')}`" if s.get("kind") == "speedrun" else f"`{s.get('system')}`"
        if s.get("kind") == "speedrun" and s.get("overrides"):
            label += " " + ", ".join(s["overrides"])
        if not s.get("ok", True):
            label += " (did not finish)"
        rows.append(("gpu_systems", [rec.name_cell(), cell(label), *where(rec),
                                     runs_cell(len(runs), [r.get("seed") for r in runs]),
                                     acc_spread([r.get("test_acc") for r in runs]),
                                     mean_sd([r.get("seconds") for r in runs]),
                                     "train+eval" if s.get("kind") == "speedrun" else "the script's own timer",
                                     num(s.get("warmup_seconds"))]))
    for p in d.get("pairs") or []:
        rows.append(("gpu_pairs", [rec.name_cell(), *where(rec), cell(code(p["a"])), cell(code(p["b"])),
                                   f"{pct(p.get('test_acc_a'))} / {pct(p.get('test_acc_b'))}",
                                   f"{num(p.get('seconds_a'))} / {num(p.get('seconds_b'))}",
                                   ratio(p.get("time_ratio"))]))
    return rows


def gpu_synthetic_rows(rec: Record, d: dict):
    rows = []
    for v in d["variants"]:
        runs = v.get("runs") or []
        secs = [r.get("seconds") for r in runs]
        label = f"`{d.get('recipe')}` variant {v.get('variant')}" + (
            " " + ", ".join(v["overrides"]) if v.get("overrides") else "") + "; random data"
        rows.append(("gpu_systems", [rec.name_cell(), cell(label), *where(rec), str(len(runs)), DASH,
                                     mean_sd(secs), "train+eval", num(v.get("warmup_seconds"))]))
    return rows


def gpu_smoke_rows(rec: Record, d: dict):
    rows = []
    for e in d["entries"]:
        busy = (e.get("gpu_busy") or {}).get("busy_fraction")
        ran = "yes" if e.get("ok") else "no: " + str(e.get("error", "")).split(":", 1)[0]
        if e.get("ok") and e.get("finite_losses") is False:
            ran = "yes, a loss not finite"
        rows.append(("gpu_smoke", [rec.name_cell(), code(e.get("id")), *where(rec), cell(ran),
                                   num(e.get("compile_seconds")), count(e.get("recompiles")), num(e.get("step_ms")),
                                   f"{busy:.0%}" if is_num(busy) else DASH]))
    return rows


def kernel_profile_rows(rec: Record, d: dict):
    total = d.get("kernel_seconds") or 0
    kinds = sorted(((v.get("seconds") or 0, k) for k, v in (d.get("by_kind") or {}).items()), reverse=True)[:3]
    shares = ", ".join(f"{k} {s / total:.0%}" for s, k in kinds) if total else DASH
    return [("gpu_profile", [rec.name_cell(), cell(d.get("label")), *where(rec), count(d.get("kernels")),
                             num(d.get("kernel_seconds")), num(d.get("wall_seconds")), cell(shares)])]


def peers_rows(rec: Record, d: dict):
    epochs = d.get("epochs")
    med = (d.get("summary") or {}).get("medians")
    rounds = len(d.get("rounds") or []) or 1
    figures = {}
    for name, p in (d.get("peers") or {}).items():
        if med and name in med:
            m = med[name]
            figures[name] = (m.get("test_acc"), m.get("seconds_per_epoch"), m.get("final_eval_seconds"),
                             m.get("process_seconds"))
        else:
            per_epoch = (p.get("train_seconds_without_final_eval") / epochs
                         if is_num(p.get("train_seconds_without_final_eval")) and is_num(epochs) and epochs else None)
            figures[name] = (p.get("test_acc"), per_epoch, p.get("final_eval_seconds"), p.get("process_seconds"))

    def peer_cell(name):
        f = figures.get(name)
        return DASH if f is None else f"{pct(f[0])}; {num(f[1])}; {num(f[2])}; {num(f[3])}"

    ratios = DASH
    others = [f for n, f in figures.items() if n != "speedrun"]
    if "speedrun" in figures and others:
        s = figures["speedrun"]
        parts = []
        for i in (1, 2, 3):
            best = min((f[i] for f in others if is_num(f[i])), default=None)
            parts.append(ratio(s[i] / best) if is_num(s[i]) and best else DASH)
        ratios = " / ".join(parts)
    return [("peers", [rec.name_cell(), *where(rec), f"{epochs:g} × {rounds}" if is_num(epochs) else DASH, peer_cell("plain"),
                       peer_cell("lightning"), peer_cell("speedrun"), ratios])]


def sweep_rows(rec: Record, d: dict):
    """`benchmarks/accuracy_sweep.py`: a row per variant (recipe and its settings)."""
    rows = []
    for v in d["variants"]:
        row = d["summary"][v["name"]]
        accs = [r["test_acc"] for r in d["runs"] if r["variant"] == v["name"] and "test_acc" in r]
        commit = str((d.get("environment") or {}).get("git_commit") or "")[:7]
        label = f"{v['name']}: `{v['recipe']}`" + (f" {', '.join(v['sets'])}" if v["sets"] else f" as at {commit or '?'}")
        first = row.get("against")
        vs = (f"{100 * first['diff']:+.2f} against {first['variant']} (p {num(first['p'])})" if first else DASH)
        table = "imagenette_sweep" if "imagenette" in v["recipe"] else "other_sweep"
        rows.append((table, [rec.name_cell(), cell(label), *where(rec), count(len(accs)),
                             mean_sd(accs, pct),
                             f"{num(row['p_value_mean_at_least_target'])} (target {pct(row['target'])})", cell(vs)]))
    return rows


def ablate_rows(rec: Record, d: dict):
    variants = d["variants"]
    base = next((v for v in variants if v.get("kind") == "baseline"), None)
    losses = sorted((v["test_acc"]["mean"], v.get("label", "")) for v in variants
                    if v.get("kind") != "baseline" and is_num((v.get("test_acc") or {}).get("mean")))[:4]
    worst = "; ".join(f"{label.replace('without ', '')} {pct(a)}" for a, label in losses)
    return [("fashion_ablate", [rec.name_cell(), *where(rec), count(d.get("runs_per_variant")),
                                pct((base or {}).get("test_acc", {}).get("mean")), cell(worst)])]


def ab(rec: Record, label: str, measures, envs=None):
    """One row: "measure A → B (× B÷A)" for times and counts, "(±points)" for accuracies."""
    parts = []
    for measure, a, b, fmt in measures:
        if fmt is pct:
            pa, pb = as_pct(a), as_pct(b)
            tail = f" ({pb - pa:+.2f} points)" if pa is not None and pb is not None else ""
        else:
            tail = f" (× {ratio(b / a)})" if is_num(a) and is_num(b) and a else ""
        parts.append(f"{measure} {fmt(a)} → {fmt(b)}{tail}")
    return [("ab", [rec.name_cell(), *where(rec, envs), cell(label), cell("; ".join(parts))])]


def referenced_envs(d: dict, results: Path) -> list[dict]:
    """The environments of the bench records a `speedrun compare` record names (it has none)."""
    envs = []
    for side in ("a", "b"):
        path = str((d.get(side) or {}).get("path", ""))
        rel = path.split("benchmarks/results/", 1)[-1]
        f = results / rel
        if rel and f.is_file():
            try:
                envs += environments(json.loads(f.read_text(encoding="utf-8")))
            except ValueError:
                pass
    return envs


def compare_rows(rec: Record, d: dict):
    a, b = d["a"], d["b"]
    label = f"{Path(a.get('path', 'A')).parent.name} → {Path(b.get('path', 'B')).parent.name} (`speedrun compare`)"
    region = d.get("region", "time")
    return ab(rec, label, [(f"{region}, s: mean", a["time"]["mean"], b["time"]["mean"], num),
                           ("accuracy: mean", a["test_acc"]["mean"], b["test_acc"]["mean"], pct)],
              envs=referenced_envs(d, rec.root))


def before_after_rows(rec: Record, d: dict):
    s = d["summary"]
    sides = {}
    for side in ("before", "after"):
        envs = [e for pr in d.get("pairs", []) for e in environments(pr.get(side))]
        sides[side] = commits(envs)
    label = f"before ({sides['before']}) → after ({sides['after']}), {len(d.get('pairs', []))} pairs"
    return ab(rec, label, [("whole process, s: mean", mean(s["before_process_seconds"]),
                            mean(s["after_process_seconds"]), num),
                           ("accuracy: mean", mean(s["before_test_acc"]), mean(s["after_test_acc"]), pct)])


def before_after_lists_rows(rec: Record, d: dict):
    def side(name):
        runs = [r for x in d[name] for r in x.get("runs", [])]
        envs = [e for x in d[name] for e in environments(x)]
        return runs, commits(envs)
    (ra, ca), (rb, cb) = side("before"), side("after")
    label = f"before ({ca}) → after ({cb}), {len(ra)} + {len(rb)} processes"
    return ab(rec, label, [("whole process, s: mean", mean([r.get("process_wall_seconds") for r in ra]),
                            mean([r.get("process_wall_seconds") for r in rb]), num),
                           ("accuracy: mean", mean([(r.get("summary") or {}).get("test_acc") for r in ra]),
                            mean([(r.get("summary") or {}).get("test_acc") for r in rb]), pct)])


def seconds_in(text):
    if is_num(text):
        return text
    m = re.match(r"\s*([0-9.]+)\s*s\b", str(text))
    return float(m.group(1)) if m else None


def setting_ab_rows(rec: Record, d: dict):
    """Runs that alternate one setting (each run names it): the first value seen is A."""
    runs = d["runs"]
    key = next(k for k in runs[0] if k not in ("order", "summary", "process_wall", "process_wall_seconds"))
    values = []
    for r in runs:
        if r[key] not in values:
            values.append(r[key])
    a, b = values[:2]
    ra, rb = [r for r in runs if r[key] == a], [r for r in runs if r[key] == b]

    def wall(r):
        return seconds_in(r.get("process_wall_seconds", r.get("process_wall")))

    def summ(rs, k):
        return mean([(r.get("summary") or {}).get(k) for r in rs])

    return ab(rec, f"{key}={a} → {key}={b}, {len(ra)} + {len(rb)} processes",
              [("whole process, s: mean", mean([wall(r) for r in ra]), mean([wall(r) for r in rb]), num),
               ("train_seconds: mean", summ(ra, "train_seconds"), summ(rb, "train_seconds"), num),
               ("accuracy: mean", summ(ra, "test_acc"), summ(rb, "test_acc"), pct)])


def train_vs_rows(rec: Record, d: dict):
    m = d["medians"]
    this = distinct(str(s.get("git_commit", ""))[:7] for s in (d.get("samples") or {}).get("this", []))
    label = (f"tree {d['other_tree_commit']} → this tree ({this}), `{d.get('recipe')}`, "
             f"{d.get('rounds')} rounds")
    return ab(rec, label, [("whole process, s: median", m["other"]["process_wall_seconds"],
                            m["this"]["process_wall_seconds"], num),
                           ("train_seconds: median", m["other"]["train_seconds"], m["this"]["train_seconds"], num)])


def hold_memory_rows(rec: Record, d: dict):
    m = d["medians"]
    off, on = m["off"], m["auto"]
    measures = [("whole process, s: median", off["process_seconds"], on["process_seconds"], num),
                ("minor page faults: median", off["minor_page_faults"], on["minor_page_faults"], count),
                ("peak resident, MiB: median", off["max_rss_mib"], on["max_rss_mib"], num)]
    for key, measure in (("model_seconds_per_step", "model step, s: median"),
                         ("train_seconds", "train_seconds: median")):
        if key in off:
            measures.append((measure, off[key], on[key], num))
    return ab(rec, f"runtime.hold_memory off → auto: `{d.get('command')}`, {d.get('rounds')} rounds", measures)


def variant_pair_rows(rec: Record, d: dict):
    res = d["result"]
    a, b = list(res)[:2]
    return ab(rec, f"{a} → {b}", [("whole process, s", res[a]["process_wall_seconds"],
                                   res[b]["process_wall_seconds"], num),
                                  ("accuracy", res[a]["test_acc"], res[b]["test_acc"], pct)])


def fork_server_rows(rec: Record, d: dict):
    s = d["summary"]
    a, b = list(s)[:2]
    n = {k: sum(1 for r in d.get("runs", []) if r.get("workers_started_by") == k) for k in (a, b)}
    return ab(rec, f"workers started by {a} → by {b}, {n[a]} + {n[b]} records",
              [("streamed training epoch, s: mean", s[a]["epoch_seconds_mean"], s[b]["epoch_seconds_mean"], num),
               ("whole process, s: mean", s[a]["process_wall_seconds_mean"], s[b]["process_wall_seconds_mean"],
                num)])


def step_time_vs_rows(rec: Record, d: dict):
    measures = []
    for recipe, r in sorted(d["recipes"].items()):
        med = r["median_model_seconds_per_step"]
        measures.append((f"`{recipe}` model step, s: median", med["base"], med["this"], num))
    return ab(rec, f"tree {d.get('base_commit')} → this tree", measures)


def engine_vs_plain_rows(rec: Record, d: dict):
    m = d["median_seconds_per_step"]
    label = f"peers.py's plain loop → speedrun's engine, `{d.get('recipe')}` {d.get('precision', '')}"
    return ab(rec, label, [("training step, s: median", m["plain"], m["speedrun"], num)])


def step_ops_rows(rec: Record, d: dict):
    sides = [k for k, v in d.items() if isinstance(v, dict) and "ops_per_step" in v]
    a, b = sides[:2]
    return ab(rec, f"{a} → {b}", [("ATen ops per eager step", d[a]["ops_per_step"], d[b]["ops_per_step"], count)])


def structure_rows(rec: Record, d: dict):
    """One row per recipe: eager ops / host syncs per step, and compiled breaks / regions / eager ops /
    host syncs per step, for each precision (and each further setting the record counted)."""
    by_recipe: dict[str, dict[str, list[str]]] = {}
    for r in (d.get("rows") or []) + (d.get("ddp") or []):
        extra = [o for o in (r.get("overrides") or [])
                 if not o.startswith(("model.widths=", "model.width=", "data.batch_size=", "eval."))]
        label = " ".join([str(r.get("precision")), *extra])
        if r.get("processes"):
            label += f", {r['processes']} processes"
        mode = "compiled" if r.get("compiled") else "eager"
        if mode == "eager":
            text = f"{label} {count(r.get('eager_ops_per_step'))} / {count(r.get('host_syncs_per_step'))}"
        else:
            text = (f"{label} {count(r.get('graph_breaks'))} / {count(r.get('compiled_regions_per_step'))} / "
                    f"{count(r.get('eager_ops_per_step'))} / {count(r.get('host_syncs_per_step'))}")
        by_recipe.setdefault(str(r.get("recipe")), {"eager": [], "compiled": []})[mode].append(text)
    rows = []
    for recipe, modes in by_recipe.items():
        rows.append(("step_structure", [rec.name_cell(), *where(rec), code(recipe),
                                        cell("; ".join(modes["eager"]) or DASH),
                                        cell("; ".join(modes["compiled"]) or DASH)]))
    timing: dict[tuple, dict] = {}
    for t in d.get("timing") or []:
        key = (t.get("recipe"), t.get("precision"))
        timing.setdefault(key, {})["compiled" if t.get("compiled") else "eager"] = median(t.get("ms_per_step") or [])
    for (recipe, precision), ms in timing.items():
        rows.append(("step_timing", [rec.name_cell(), *where(rec), code(recipe), cell(precision),
                                     num(ms.get("eager")), num(ms.get("compiled"))]))
    return rows


def levers_rows(rec: Record, d: dict):
    by_lever = {}
    for lv in d["levers"]:
        by_lever.setdefault(lv["lever"], []).append((lv["size"], lv["ratio"]))
    rows = []
    for lever, sizes in by_lever.items():
        rows.append(("step_levers", [rec.name_cell(), *where(rec), code(d.get("recipe")), code(lever),
                                     ", ".join(f"{s} px {ratio(r)}" for s, r in sorted(sizes))]))
    return rows


def cuda_graph_rows(rec: Record, d: dict):
    rows_ = d["rows"]
    graphs = sum(len(r.get("graphs") or []) for r in rows_)
    bad = sum(r.get("mutated_not_static_total") or 0 for r in rows_)
    return [("step_cuda_graphs", [rec.name_cell(), *where(rec), str(len(rows_)), str(graphs), count(bad),
                                  num(sum(r.get("seconds") or 0 for r in rows_))])]


def flops_rows(rec: Record, d: dict):
    util = d.get("model_utilisation")
    return [("step_flops", [rec.name_cell(), code(d.get("recipe")), *where(rec), cell(d.get("precision")),
                            sci(d.get("flops_per_train_image")), sci(d.get("total_flops")),
                            sci(d.get("model_flops_per_s")), f"{util:.0%}" if is_num(util) else DASH])]


def tta_rows(rec: Record, d: dict):
    """One row per recipe and view set: accuracy and seconds at each fraction of the test images."""
    rows = []
    by_recipe: dict = {}
    for r in d["runs"]:
        by_recipe.setdefault(str(r.get("recipe")), []).append(r)
    for recipe, runs in sorted(by_recipe.items()):
        views: dict = {}
        for r in runs:
            for v in r.get("variants") or []:
                entry = views.setdefault(v.get("tta"), {"views": v.get("views"), "fractions": {}})
                f = entry["fractions"].setdefault(v.get("fraction"), {"acc": [], "sec": []})
                f["acc"].append(v.get("test_acc"))
                f["sec"].append(v.get("seconds"))
        for tta, v in views.items():
            parts = []
            for fraction, f in v["fractions"].items():
                share = f"{fraction:.0%}" if is_num(fraction) else str(fraction)
                parts.append(f"{share}: {acc_spread(f['acc'])}, {num(mean(f['sec']))} s")
            rows.append(("tta", [rec.name_cell(), *where(rec), code(recipe),
                                 runs_cell(len(runs), [r.get("seed") for r in runs]), code(tta), count(v["views"]),
                                 cell("; ".join(parts))]))
    return rows


def tuning_rows(rec: Record, d: dict):
    rows = []
    for r in d["runs"]:
        rows.append(("imagenette_tuning", [rec.name_cell(), *where(rec), cell(r.get("run")), pct(r.get("test_acc")),
                                           num(r.get("train_seconds")),
                                           cell(", ".join(r.get("overrides") or []) or "the recipe then")]))
    return rows


def photo_input_rows(rec: Record, d: dict):
    p = d.get("pipeline_images_per_s") or {}
    epochs = "; ".join(f"cache {t.get('cache')}: {num(t.get('images_per_s'))}, {pct(t.get('test_acc'))}"
                       for t in d.get("training") or [])
    return [("photo_input", [rec.name_cell(), *where(rec), num((d.get("decode") or {}).get("images_per_s")),
                             f"{num(p.get('streamed'))} / {num(p.get('cached'))}", cell(epochs)])]


def stream_rows(rec: Record, d: dict):
    res = "; ".join(f"{r.get('pipeline')}, {r.get('crop')}: {count(r.get('images_per_second'))}"
                    for r in d["results"])
    speed = ", ".join(f"{k} {ratio(v)}" for k, v in (d.get("speedup") or {}).items())
    return [("photo_stream", [rec.name_cell(), *where(rec), count(d.get("images")), count(d.get("workers")),
                              cell(res), cell(speed)])]


def photo_throughput_rows(rec: Record, d: dict):
    rows = []
    for r in d["runs"]:
        s = r.get("summary") or {}
        rows.append(("photo_throughput", [
            rec.name_cell(), cell(f"`{r.get('recipe')}` run {r.get('run')}"), *where(rec), count(r.get("images")),
            num(r.get("process_wall_seconds")), f"{num(s.get('train_seconds'))} ({num(s.get('compile_seconds'))})",
            count(r.get("pipeline_images_per_second")), count(r.get("model_step_images_per_second")),
            ratio(r.get("pipeline_over_model")), cell(r.get("bound_by"))]))
    return rows


def resnet50_rows(rec: Record, d: dict):
    m = d["model_step"]
    fed = []
    for p in d.get("pipelines") or []:
        if p.get("available") is False:
            fed.append(f"{p.get('pipeline')}: not available")
            continue
        fed.append(f"{p.get('pipeline')}, {p.get('decoding')}: {count(p.get('images_per_second_median'))} "
                   f"({ratio(p.get('pipeline_over_model'))}, {p.get('bound_by')})")
    return [("resnet50", [rec.name_cell(), code(d.get("recipe")), *where(rec), f"{d.get('batch')} × {d.get('image_size')}",
                          count(m.get("images_per_second_median")), cell("; ".join(fed)),
                          num(d.get("compile_seconds"))])]


def same_weights_rows(rec: Record, d: dict):
    rows = []
    for st in d["settings"]:
        a, b = st["runs"]["base"], st["runs"]["this"]
        verdict = "weights identical to the bit" if st.get("identical") else "weights DIFFER"
        label = (f"tree {d.get('base_commit')} → this tree, `{d.get('recipe')}` {st.get('setting')} "
                 f"({', '.join(st.get('sets') or []) or 'as shipped'}; {' '.join(d.get('extra') or [])}): {verdict}")
        rows += ab(rec, label, [("accuracy", a.get("test_acc"), b.get("test_acc"), pct),
                                ("steps", a.get("steps"), b.get("steps"), count)])
    return rows


def has(d, *keys) -> bool:
    return all(k in d for k in keys)


def reader_for(d):
    """The reader of a record's format, or None."""
    if not isinstance(d, dict):
        return None
    bench = str(d.get("benchmark", ""))
    runs = d.get("runs")
    checks = [
        (has(d, "entries", "what") and "gpu_smoke" in str(d.get("script", "")), gpu_smoke_rows),
        (d.get("mode") == "real" and has(d, "systems"), gpu_record_rows),
        (d.get("mode") == "synthetic" and has(d, "variants"), gpu_synthetic_rows),
        (has(d, "regions", "runs", "summary"), bench_rows),
        (has(d, "variants", "runs_per_variant"), ablate_rows),
        (has(d, "variants", "runs", "summary") and "accuracy_sweep" in str(d.get("command", "")), sweep_rows),
        (has(d, "verdict", "a", "b"), compare_rows),
        (has(d, "script", "mean_tta_acc", "runs"), peer_script_rows),
        (has(d, "by_kind", "kernels"), kernel_profile_rows),
        (has(d, "test_acc", "train_seconds", "recipe") and "runs" not in d, summary_rows),
        (bench == "speedrun train, whole process", train_cli_rows),
        (isinstance(d.get("test_acc"), list) and ("combined_from" in d or "parts" in d), combined_rows),
        (has(d, "peers", "definitions"), peers_rows),
        (has(d, "median_seconds_per_step", "speedrun_over_plain"), engine_vs_plain_rows),
        (has(d, "pairs", "summary") and "after_process_seconds" in (d.get("summary") or {}), before_after_rows),
        (isinstance(d.get("after"), list) and isinstance(d.get("before"), list), before_after_lists_rows),
        (has(d, "other_tree_commit", "medians"), train_vs_rows),
        (has(d, "medians") and has(d["medians"], "off", "auto"), hold_memory_rows),
        (has(d, "result", "run") and isinstance(d.get("run"), dict), wrapped_run_rows),
        (isinstance(d.get("result"), dict) and len(d["result"]) == 2
         and all(isinstance(v, dict) and "test_acc" in v for v in d["result"].values()), variant_pair_rows),
        (has(d, "model_step_seconds", "runs"), tuning_rows),
        (has(d, "pipeline_images_per_s", "decode"), photo_input_rows),
        (has(d, "runs", "model_step", "photos") and "photo_throughput" in str(d.get("script", "")),
         photo_throughput_rows),
        (has(d, "model_step", "pipelines", "scale_input"), resnet50_rows),
        (has(d, "settings", "base_commit") and "same_weights" in str(d.get("script", "")), same_weights_rows),
        (isinstance(runs, list) and bool(runs) and isinstance(runs[0], dict) and "workers_started_by" in runs[0]
         and "summary" in d, fork_server_rows),
        (isinstance(runs, list) and bool(runs) and isinstance(runs[0], dict) and "summary" in runs[0]
         and "order" in runs[0] and len(runs[0]) >= 3, setting_ab_rows),
        (has(d, "results", "speedup"), stream_rows),
        (has(d, "levers"), levers_rows),
        (isinstance(d.get("rows"), list) and bool(d["rows"]) and "mutated_not_static_total" in d["rows"][0],
         cuda_graph_rows),
        (has(d, "rows", "timing"), structure_rows),
        (has(d, "base_commit", "recipes"), step_time_vs_rows),
        (sum(1 for v in d.values() if isinstance(v, dict) and "ops_per_step" in v) == 2, step_ops_rows),
        (bench == "tta_views" and isinstance(runs, list), tta_rows),
        (has(d, "flops_per_train_image", "total_flops") and "runs" not in d, flops_rows),
    ]
    return next((reader for ok, reader in checks if ok), None)


# ------------------------------------------------------------------------------------------
# Records whose script left the tree (one-off comparisons whose answer is settled)
# ------------------------------------------------------------------------------------------

LAST_HELD = "90a0884"
"""The last commit that holds every script below but those of HELD_AT: ``git show 90a0884:benchmarks/NAME``."""

HELD_AT = {"stop_check.py": "0a5f7b6"}
"""Scripts that left later, each with a commit that holds it as it was when it left."""

REMOVED = ("cpu_step_levers.py", "cuda_graph_inputs.py", "engine_vs_plain.py", "gpu_smoke.py",
           "hold_memory.py", "imagenette_step.py", "photo_input.py", "step_ops_vs.py", "step_time_vs.py",
           "stop_check.py", "stream_pipeline.py", "train_vs.py", "tta_views.py")

READER_SCRIPT = {gpu_smoke_rows: "gpu_smoke.py", engine_vs_plain_rows: "engine_vs_plain.py",
                 train_vs_rows: "train_vs.py", hold_memory_rows: "hold_memory.py", tuning_rows: "imagenette_step.py",
                 photo_input_rows: "photo_input.py", fork_server_rows: "photo_input.py",
                 stream_rows: "stream_pipeline.py", levers_rows: "cpu_step_levers.py",
                 cuda_graph_rows: "cuda_graph_inputs.py", step_time_vs_rows: "step_time_vs.py",
                 step_ops_rows: "step_ops_vs.py", tta_rows: "tta_views.py"}
"""Which script writes the records each reader reads, where that script has left the tree."""


def removed_script(rec: Record, reader) -> str | None:
    """The removed script that made ``rec``: the one its command names, else its reader's."""
    env = rec.data.get("environment") if isinstance(rec.data, dict) else None
    for text in (rec.data.get("command"), rec.data.get("script"), (env or {}).get("command")) \
            if isinstance(rec.data, dict) else ():
        for name in re.findall(r"[a-z_]+\.(?:py|sh)\b", str(text or "")):
            if name in REMOVED:
                return name
    return READER_SCRIPT.get(reader)


def removed_section(made: dict[str, list[str]]) -> str:
    rows = [[code(name), code(f"git show {HELD_AT.get(name, LAST_HELD)}:benchmarks/{name}"),
             cell("; ".join(made[name]))] for name in sorted(made)]
    return ("\n## Records whose script left the tree\n\nOne-off comparisons whose answer is settled: their "
            "scripts are no longer in `benchmarks/`, their records stay above. Each script comes back, as it was "
            "when it left, with the command beside it; as a record ran it, with "
            "`git show COMMIT:benchmarks/NAME` for the commit the record names (beside each record below).\n\n"
            + table_md(["script", "get it back", "its records (the commit each ran from)"], rows))


# ------------------------------------------------------------------------------------------
# The page
# ------------------------------------------------------------------------------------------

INTRO = (
    "# Measured results\n\n"
    "Every measurement kept in `benchmarks/results/` (speedrun's, and those of the peers set beside it), one "
    "table row per record (a few records give a row per setting, entry or view set), grouped by what was "
    "measured. Each row names its record file (relative to `benchmarks/results/`, where the full measurement "
    "is); the device (the GPU, or the CPU model with its family/model numbers), the torch "
    "version, the commit the record names (\"dirty\": the tree had uncommitted changes; \"runs:\" other "
    "commits that the runs inside the record name, where a commit landed while it ran) and the date where the "
    "record gives one. Accuracies are test accuracies with the recipe's test-time augmentation unless a column "
    f"says otherwise. This page is generated from the records by `{COMMAND}`; do not edit it by hand, but run "
    "the script after adding a record. `benchmarks/README.md` says which script writes each kind of record; the "
    "last section names the records whose script has left the tree, and how to get that script back.\n"
)


def table_md(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    out += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(out) + "\n"


def render(results: Path = RESULTS) -> str:
    records = load_records(results)
    rows: dict[str, list] = {t[0]: [] for t in TABLES}
    made: dict[str, list[str]] = {}
    headers = {t[0]: t[3] for t in TABLES}
    for rec in records:
        reader = None if rec.error else reader_for(rec.data)
        script = removed_script(rec, reader)
        if script:
            made.setdefault(script, []).append(f"`{rec.rel}` ({where(rec)[2]})")
        why = rec.error or ("a format this page does not read" if reader is None else None)
        if reader is not None:
            try:
                got = reader(rec, rec.data)
                if not got:
                    why = "no figures in the format this page reads"
                for i, (table, cells) in enumerate(got):
                    if len(cells) != len(headers[table]):
                        raise ValueError(f"{table}: {len(cells)} cells for {len(headers[table])} columns")
                    rows[table].append(((rec.rel, i), cells))
            except (KeyError, IndexError, TypeError, ValueError, AttributeError, StopIteration,
                    ZeroDivisionError, statistics.StatisticsError) as err:
                for table, kept in rows.items():
                    rows[table] = [r for r in kept if r[0][0] != rec.rel]
                why = f"its figures could not be read ({type(err).__name__})"
        if why:
            text = what_text(rec.data)
            text = text if len(text) <= 200 else text[:199] + "…"
            env = where(rec) if isinstance(rec.data, dict) else [DASH, DASH, DASH, date_of(rec)]
            rows["other"].append(((rec.rel, 0), [rec.name_cell(), *env, cell(text), cell(why)]))
    parts = [INTRO]
    for gid, title, intro in GROUPS:
        tables = [t for t in TABLES if t[1] == gid and rows[t[0]]]
        if not tables:
            continue
        n = len({key[0] for t in tables for key, _ in rows[t[0]]})
        parts.append(f"\n## {title}\n\n{intro} {n} record{'s' if n != 1 else ''}.\n")
        for tid, _, ttitle, head in tables:
            body = [cells for _, cells in sorted(rows[tid], key=lambda r: r[0])]
            parts.append((f"\n### {ttitle}\n" if len(tables) > 1 else "") + "\n" + table_md(head, body))
    if made:
        parts.append(removed_section(made))
    return "".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 when docs/results.md differs from what this script would write")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.is_file() else None
        if current != text:
            print(f"docs/results.md is not current with benchmarks/results/: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
