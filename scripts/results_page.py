#!/usr/bin/env python3
"""Write docs/results.md: every record under benchmarks/results/, in tables by what it measured.

    python scripts/results_page.py            # (re)write docs/results.md
    python scripts/results_page.py --check    # exit 1 when docs/results.md is not what it would write

Every figure on the page is read from a record (or computed from a record's figures: means,
minima, maxima, ratios); nothing is typed in by hand. Each kind of record has one reader that
turns it into rows, and one writer renders every table. A record whose kind this script does not
know, or cannot read, is listed under "Other records" by its file name and its own
"benchmark"/"what" text, never left out. The output depends only on the records and on which
scripts benchmarks/ holds: files are read in sorted order and numbers written in fixed formats,
so that writing it twice gives the same bytes.

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
# Cell formats (fixed, so that the page is the same bytes every time)
# ------------------------------------------------------------------------------------------

def is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def as_pct(x):
    """An accuracy as a percentage: records hold fractions (0.9389), a few percentages (93.89)."""
    return (x * 100 if x <= 1.0 else float(x)) if is_num(x) else None


def pct(x) -> str:
    return DASH if as_pct(x) is None else f"{as_pct(x):.2f}%"


def num(x) -> str:
    """Seconds and other magnitudes: one decimal from 10 up, three below."""
    return DASH if not is_num(x) else f"{x:,.1f}" if abs(x) >= 10 else f"{x:.3f}"


def ratio(x) -> str:
    return f"{x:.3f}" if is_num(x) else DASH


def share(x) -> str:
    return f"{x:.0%}" if is_num(x) else DASH


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


def spread(values, fmt=num, sd=False, unit="") -> str:
    """'mean (min–max)' of several values ('mean ± sd (min–max)' with ``sd``), the value alone for one."""
    vals = [v for v in values if is_num(v)]
    if len(vals) < 2:
        return fmt(vals[0]) + unit if vals else DASH
    mid = f" ± {fmt(statistics.stdev(vals))}" if sd else ""
    return f"{fmt(sum(vals) / len(vals))}{unit}{mid} ({fmt(min(vals))}–{fmt(max(vals))})"


def acc_spread(values, sd=False) -> str:
    """Accuracies as percentages: '93.99% (93.72–94.11)'."""
    return spread([as_pct(v) for v in values], "{:.2f}".format, sd, "%")


def runs_cell(n, seeds=()) -> str:
    """A count of runs and the seeds they name: '10 (seeds 0–9)'."""
    s = sorted({x for x in seeds if isinstance(x, int) and not isinstance(x, bool)})
    if not s:
        return str(n)
    if len(s) == 1:
        return f"{n} (seed {s[0]})"
    return f"{n} (seeds {s[0]}–{s[-1]})" if s == list(range(s[0], s[-1] + 1)) else \
        f"{n} (seeds {', '.join(str(x) for x in s)})"


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
    """One record file: its path under the results folder, its data (or why there is none)."""

    def __init__(self, rel: str, root: Path = RESULTS):
        self.rel, self.root, self.data, self.error, self.companions = rel, root, None, None, []

    def name_cell(self) -> str:
        return f"`{self.rel}`" + "".join(f" (+ `{c}`)" for c in self.companions)


def load_records(results: Path) -> list[Record]:
    top = sorted(p for p in results.iterdir() if p.is_file())
    json_stems = {p.stem for p in top if p.suffix == ".json"}
    paths = [p for p in top if p.suffix == ".json" or p.stem not in json_stems]
    paths += [p for d in sorted(q for q in results.iterdir() if q.is_dir()) for p in sorted(d.rglob("*.json"))]
    records = []
    for p in sorted(paths, key=lambda q: q.relative_to(results).as_posix()):
        rec = Record(p.relative_to(results).as_posix(), root=results)
        if p.parent == results:
            rec.companions = [q.name for q in top if q.stem == p.stem and q.suffix != ".json" and p.suffix == ".json"]
        if p.suffix != ".json":
            rec.error = "not a JSON record"
            records.append(rec)
            continue
        try:
            rec.data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            rec.error = f"not readable as JSON ({type(err).__name__})"
        records.append(rec)
    return records


def nested_dicts(node, skip=lambda d: False):
    """Every dict inside ``node``, breadth first; a dict for which ``skip`` holds is not entered."""
    queue = [node]
    while queue:
        node = queue.pop(0)
        if isinstance(node, dict):
            yield node
            queue.extend([] if skip(node) else node.values())
        elif isinstance(node, list):
            queue.extend(node)


def environments(data) -> list[dict]:
    """The environment dicts a record holds: its own "environment", else every nested dict
    that names a torch version or a commit (the sides of an A/B record, a run's summary), where a
    record inside the record stands for itself by its own "environment"."""
    if not isinstance(data, dict):
        return []
    if isinstance(data.get("environment"), dict):
        return [data["environment"]]
    own = lambda n: isinstance(n.get("environment"), dict)     # noqa: E731
    found = [n["environment"] if own(n) else n for n in nested_dicts(data, own)
             if own(n) or "torch_version" in n or "git_commit" in n]
    if not found and ("torch" in data or "gpu" in data):                 # a peer script's own result
        found.append({"torch_version": data.get("torch"), "gpu_name": data.get("gpu")})
    if not found and isinstance(data.get("device_name"), str):           # only the device's name
        found.append({"device_name": data["device_name"]})
    return found


def device_of(env: dict) -> str | None:
    """The GPU's name, or the CPU model (without trademarks) and its family/model numbers."""
    if env.get("gpu_name") or env.get("device") == "cuda" and env.get("device_name"):
        return str(env.get("gpu_name") or env["device_name"])
    model = env.get("cpu_model") or env.get("device_name")
    if not model:
        return None
    model = re.sub(r"\((R|TM|r|tm)\)", "", str(model))
    model = re.sub(r"\((\d+) threads?\)", "", re.sub(r"\b(Processor|CPU)\b", "", model))
    fm = env.get("cpu_family_model")
    return " ".join(model.split()) + (f" {fm}" if fm else "")


def on_gpu(data) -> bool:
    return any(e.get("gpu_name") or e.get("device") == "cuda" for e in environments(data))


def distinct(values) -> str:
    return ", ".join(dict.fromkeys(v for v in values if v)) or DASH


def commits(envs, given=None) -> str:
    """The distinct commits of some environments, "(dirty)" where any of them was dirty."""
    out: dict[str, bool] = {}
    for e in envs:
        c = str(given if isinstance(given, str) and given else e.get("git_commit") or "")[:7]
        if c:                                   # ("dirty" belongs to the environment's own commit)
            out[c] = out.get(c, False) or bool(e.get("git_dirty")) and str(e.get("git_commit", ""))[:7] == c
    return ", ".join(c + (" (dirty)" if dirty else "") for c, dirty in out.items()) or DASH


def date_of(rec: Record) -> str:
    """A date the record gives: a date field, else the one date its note names, else the one
    date in its folder's name."""
    d = rec.data if isinstance(rec.data, dict) else {}
    env = d.get("environment") if isinstance(d.get("environment"), dict) else {}
    for m in (DATE.search(str(src.get(k, ""))) for k in ("date", "started", "timestamp", "when") for src in (d, env)):
        if m:
            return m.group(1)
    for text in (d["note"] if isinstance(d.get("note"), str) else "", rec.rel):
        found = sorted(set(DATE.findall(text)))
        if len(found) == 1:
            return found[0]
    return DASH


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
        inside = nested_dicts([v for k, v in d.items() if k != "environment"])
        runs = list(dict.fromkeys(n["git_commit"][:7] for n in inside if isinstance(n.get("git_commit"), str)))
        if runs and set(runs) != {str(e.get("git_commit"))[:7] for e in envs}:
            commit += f" (runs: {', '.join(runs)})"
    return [cell(distinct(device_of(e) for e in envs)), cell(distinct(e.get("torch_version") for e in envs)),
            cell(commit), date_of(rec)]


def what_text(data) -> str:
    data = data if isinstance(data, dict) else {}
    return next((data[k] for k in ("benchmark", "what", "label", "script") if isinstance(data.get(k), str)), "")


def settings(command, verb: str = "train") -> tuple[str | None, str]:
    """(recipe, the options after it) of a `speedrun train|bench RECIPE ...` command line,
    leaving out where the data and outputs are."""
    m = re.search(rf"\b{verb}\s+(\S+)(.*)$", command) if isinstance(command, str) else None
    if not m:
        return None, ""
    parts = [p for p in re.split(r"\s+(?=--)", m.group(2).strip())
             if p and p.split(" ", 1)[0] not in ("--data-dir", "--out", "--seed", "--runs", "--log-every")]
    return m.group(1), ", ".join(p[len("--set "):] if p.startswith("--set ") else p for p in parts)


def run_label(recipe, opts, cold=None) -> str:
    return cell((code(recipe) if recipe else DASH) + (" " + opts if opts else "") + ("; cold caches" if cold else ""))


def topic(recipe, command, gpu: bool) -> str:
    """The section a whole run belongs in, by its device and recipe."""
    r = str(recipe or "")
    if gpu or r.startswith("fashion"):
        return "gpu" if gpu else "fashion"
    if r.startswith("imagenette") or "imagenette" in str(command or ""):
        return "imagenette"
    return "cifar_cpu" if r.startswith("cifar10") else "photo" if r == "folder" else "other"


# ------------------------------------------------------------------------------------------
# The page's sections and tables. The writer fills "record" and the WHERE columns; a reader
# gives the other cells, in order.
# ------------------------------------------------------------------------------------------

WHERE = ["device", "torch", "commit", "date"]
RUNS = ["record", "run", *WHERE, "runs", "accuracy: mean (min–max)", "whole process, s: mean (min–max)",
        "train_seconds: mean"]
SUMMARY = ["record", "run", *WHERE, "accuracy (without TTA)", "epochs", "train_seconds", "whole run, s"]
SWEEP = ["record", "variant", *WHERE, "runs", "accuracy: mean ± sd (min–max)", "p (mean > target)",
         "against the first variant of its recipe: points (Welch p)"]

SECTIONS = [  # (title, what its records measured, [(table id, title, headers)]), in page order
    ("CIFAR-10 on a GPU",
     "speedrun's recipes (`speedrun bench`: a warm-up, then seeded runs in one process, timed over `train+eval`) "
     "and airbench's own scripts (each run timed by the script's own timer) on one GPU; the GPU smoke run of the "
     "recipe matrix; a kernel-time profile of one run.",
     [("gpu_systems", "Systems, N timed runs each after a warm-up",
       ["record", "system", *WHERE, "runs", "accuracy: mean (min–max)", "seconds: mean ± sd (min–max)", "timed",
        "warm-up, s"]),
      ("gpu_pairs", "Pairs (`gpu_record.py --pair A:B`)",
       ["record", *WHERE, "A", "B", "accuracy A / B", "seconds A / B", "A ÷ B"]),
      ("gpu_runs", "Whole runs", RUNS),
      ("gpu_smoke", "GPU smoke run (`benchmarks/gpu_smoke.py`): each entry once",
       ["record", "entry", *WHERE, "ran", "compile, s", "recompiles", "step, ms", "GPU busy"]),
      ("gpu_profile", "Kernel time of one profiled run",
       ["record", "run", *WHERE, "kernels", "kernel time, s", "wall, s", "largest kinds (share of kernel time)"])]),
    ("CIFAR-10 on CPUs: whole runs",
     "`speedrun train` as a user runs it (`benchmarks/train_cli.py`): seconds are the whole process, from the "
     "interpreter's start to its exit; `train_seconds` is the run's own timed region. Settings are the command's "
     "options beyond the recipe.",
     [("cifar_cpu_runs", "Whole processes", RUNS), ("cifar_cpu_summary", "Single runs kept whole (run folders)",
                                                   SUMMARY)]),
    ("speedrun beside the plain loop and Lightning (peers)",
     "`benchmarks/peers.py`: the cifar10-94 algorithm trained by a plain PyTorch loop, a Lightning `Trainer` and "
     "`speedrun train`, one after another on the same CPU, each in a fresh process. Each peer's cell: TTA "
     "accuracy; seconds per training epoch; the final TTA evaluation; the whole process (medians over rounds "
     "where there are several). The last column divides speedrun's seconds by the fastest other peer's.",
     [("peers", "Peers", ["record", *WHERE, "epochs × rounds", "plain loop", "Lightning", "speedrun",
                          "speedrun ÷ fastest peer: epoch / final TTA / process"])]),
    ("speedrun on networks it did not design",
     "`benchmarks/any_network.py`: timm's networks and a factory's plain conv net from random weights on a slice "
     "of CIFAR-10 at 32 px, trained by `speedrun train` and by a plain PyTorch loop (torch.optim.AdamW, a "
     "DataLoader, bf16 autocast where native, channels_last), each in a fresh process, the same threads, batch, "
     "epochs, schedule and augmentation. Each system's cell: seconds per epoch (its own epoch timing; median "
     "over rounds); accuracy; the median share of a core each process got (below 1: the machine was shared). "
     "The last column divides speedrun's seconds per epoch by the plain loop's (below 1: speedrun faster), "
     "with each round's ratio.",
     [("any_network", "Networks", ["record", "network", *WHERE, "images × epochs × rounds", "plain loop",
                                   "speedrun", "speedrun ÷ plain loop: epoch (rounds)"])]),
    ("Fashion-MNIST demo",
     "The `fashion-mnist` demo: whole `speedrun train` processes, `speedrun bench` (seeded runs in one process, "
     "timed over `train+eval`) and `speedrun ablate` (each trick left out in turn).",
     [("fashion_runs", "Whole processes", RUNS),
      ("fashion_bench", "`speedrun bench`",
       ["record", "run", *WHERE, "runs", "accuracy: mean ± sd", "train+eval, s: mean ± sd", "p(mean ≥ target)"]),
      ("fashion_ablate", "`speedrun ablate`",
       ["record", *WHERE, "runs per variant", "recipe's accuracy", "the largest losses without a trick"]),
      ("fashion_crowded", "Alone and beside busy processes (`train_cli.py --busy K`): whole processes",
       ["record", "system", *WHERE, "runs", "alone, s: median", "beside K busy processes, s: median",
        "busy ÷ alone"])]),
    ("Imagenette",
     "The `imagenette` recipes (and `folder` on the same photos) on the squashed 224 px copy of imagenette2 "
     "that `benchmarks/README.md` describes: whole `speedrun train` processes, and the recipe's tuning runs.",
     [("imagenette_runs", "Whole processes", RUNS),
      ("imagenette_sweep", "Variants over seeds (`benchmarks/accuracy_sweep.py`: processes side by side, so no times)",
       SWEEP),
      ("imagenette_tuning", "Tuning runs", ["record", *WHERE, "run", "accuracy", "train_seconds", "overrides"])]),
    ("Photo input pipelines",
     "Decoding a photo folder once against streaming it, the input pipelines alone, whole runs of the "
     "`folder` recipe on CIFAR-10 exported as JPEG files, and whole `speedrun train` runs on a synthetic "
     "Imagenette-shaped folder against the model step alone (`benchmarks/throughput.py runs`, earlier "
     "`photo_throughput.py`).",
     [("photo_input", "Decode once against stream (`benchmarks/photo_input.py`)",
       ["record", *WHERE, "decode once, images/s", "pipeline alone, images/s: streamed / cached",
        "one training epoch: images/s, accuracy"]),
      ("photo_stream", "Streamed pipeline against a per-sample Pillow pipeline",
       ["record", *WHERE, "images", "workers", "images/s by pipeline and crop", "speed-up"]),
      ("photo_throughput", "Whole runs against the model step (`benchmarks/throughput.py runs`)",
       ["record", "recipe, run", *WHERE, "images", "whole process, s", "train_seconds (compile before it, s)",
        "pipeline images/s", "model step images/s", "pipeline ÷ model step", "bound by"]),
      ("photo_runs", "Whole processes", RUNS), ("photo_summary", "Single runs kept whole (run folders)", SUMMARY)]),
    ("ResNet-50 training throughput",
     "`benchmarks/throughput.py pipelines` (earlier `imagenet_throughput.py`): one device's training step of the "
     "recipe alone on a device-resident random batch, then fed by speedrun's pipelines from a synthetic "
     "ImageNet-like JPEG folder; images/s are medians of the timed blocks; a pipeline is model-bound at 90% of the model step's images/s or more.",
     [("resnet50", "Model step and pipelines", ["record", "recipe", *WHERE, "batch × px", "model step, images/s",
                                                "pipelines: images/s (÷ model step, bound by)", "compile, s"])]),
    ("A against B: alternating or paired runs",
     "Two settings or two trees measured one after the other on the same machine: B ÷ A below 1 means B took "
     "less (seconds) or counted fewer (ops, page faults).",
     [("ab", "A against B", ["record", *WHERE, "A → B", "figures: A → B (× B ÷ A; ± points of accuracy)"])]),
    ("Training step structure and cost",
     "One training step counted (graph breaks, compiled regions, eager ops and host syncs per step), timed, and "
     "its FLOPs; levers of the eager CPU step; inputs of the compiled graphs as CUDA graphs would see them.",
     [("step_structure", "Structure of one training step (`benchmarks/step_structure.py`)",
       ["record", *WHERE, "recipe", "eager, by precision: eager ops / host syncs per step",
        "compiled (inductor), by precision: graph breaks / compiled regions / eager ops / host syncs per step"]),
      ("step_timing", "CPU milliseconds per training step, eager and compiled",
       ["record", *WHERE, "recipe", "precision", "eager, ms: median", "compiled, ms: median"]),
      ("stop_check", "The stop check after every step (`benchmarks/step_structure.py --stop-check`)",
       ["record", *WHERE, "calls per round", "one process, µs: median of rounds", "two processes (gloo), µs: median"]),
      ("step_levers", "Levers of an eager CPU step (`benchmarks/cpu_step_levers.py`): step time ratio",
       ["record", *WHERE, "recipe", "lever", "ratio by training size"]),
      ("step_cuda_graphs", "Compiled graphs' inputs (`benchmarks/cuda_graph_inputs.py`)",
       ["record", *WHERE, "rows", "graphs", "mutated inputs not static", "compile, s"]),
      ("step_flops", "FLOPs (`speedrun flops`)", ["record", "recipe", *WHERE, "precision", "FLOPs per training image",
                                                  "FLOPs per run", "model FLOP/s", "of measured peak"])]),
    ("Test-time augmentation views",
     "`benchmarks/tta_views.py`: test-time augmentation variants evaluated on finished runs' saved weights, "
     "each variant on the same model and test set.",
     [("tta", "View sets", ["record", *WHERE, "recipe", "runs", "views", "views per image", "by share of the test "
                            "images given the views: accuracy (mean, min–max over runs), seconds"])]),
    ("Other whole runs", "Whole `speedrun train` runs not grouped above.",
     [("other_runs", "Whole processes", RUNS), ("other_summary", "Single runs kept whole (run folders)", SUMMARY),
      ("other_sweep", "Variants over seeds (`benchmarks/accuracy_sweep.py`)", SWEEP)]),
    ("Other records", "Records whose format this page does not read, by file name and their own description.",
     [("other", "Not read", ["record", *WHERE, "what the record says it is", "why not read"])]),
]


# ------------------------------------------------------------------------------------------
# Readers: each turns one kind of record into (table id, cells[, environments]) rows, or raises.
# Simple kinds are specs: the table, the items that give a row each, and a row's cells.
# ------------------------------------------------------------------------------------------

def rows(table: str, cells, items=lambda d: [d]):
    """The reader of a kind with a row per item of ``items(d)`` (one for the record by default)."""
    return lambda d, rec: [(table, cells(x)) for x in items(d)]


def two_sides(sides, label, spec):
    """The reader of an A-against-B kind: ``sides(d)`` gives the two sides' figures, ``label(d)``
    what they are, ``spec`` the measures as [(name, key, format)]; a key neither side holds is left out."""
    def read(d, rec):
        a, b = sides(d)
        return [ab(label(d), [(name, a.get(key), b.get(key), fmt) for name, key, fmt in spec if key in a or key in b])]
    return read


def ab(label: str, measures, envs=None):
    """One A-against-B row: "measure A → B (× B÷A)" for times and counts, "(±points)" for accuracies."""
    parts = []
    for measure, a, b, fmt in measures:
        if fmt is pct:
            tail = f" ({as_pct(b) - as_pct(a):+.2f} points)" if is_num(a) and is_num(b) else ""
        else:
            tail = f" (× {ratio(b / a)})" if is_num(a) and is_num(b) and a else ""
        parts.append(f"{measure} {fmt(a)} → {fmt(b)}{tail}")
    return ("ab", [cell(label), cell("; ".join(parts))], envs)


def whole_runs(d: dict, rec: Record):
    """`benchmarks/train_cli.py`'s processes (also inside a record that adds its own reading, or
    several records' accuracies and seconds combined): one row."""
    d = d["run"] if isinstance(d.get("run"), dict) else d
    recipe, opts = settings(d.get("command"))
    if "runs" not in d:                                      # combined: lists of accuracies and seconds
        recipe = recipe or (re.findall(r"^\s*([a-z0-9-]+)", what_text(d)) or [None])[0]
        parts = d.get("combined_from") or d.get("parts") or []
        return [(topic(recipe, d.get("command"), on_gpu(d)) + "_runs",
                 [run_label(recipe, opts) + f"; combined from {len(parts)} records", str(len(d["test_acc"])),
                  acc_spread(d["test_acc"]), spread(d.get("process_wall_seconds") or []), DASH])]
    runs = [r for r in d["runs"] if isinstance(r, dict)]
    sums = [r.get("summary") or {} for r in runs]
    if not any(is_num(s.get("test_acc")) for s in sums):
        raise ValueError("no run with a summary")
    recipe = d.get("recipe") or recipe
    return [(topic(recipe, d.get("command"), on_gpu(d)) + "_runs",
             [run_label(recipe, opts, d.get("cold_cache")), runs_cell(len(runs), [s.get("seed") for s in sums]),
              acc_spread([s.get("test_acc") for s in sums]), spread([r.get("process_wall_seconds") for r in runs]),
              num(mean([s.get("train_seconds") for s in sums]))])]


def crowded(d: dict, rec: Record):
    """`benchmarks/train_cli.py --busy K`: each system's processes alone and beside K busy ones."""
    rows = []
    for name, row in d["summary"]["systems"].items():
        label = ("a plain PyTorch loop" if name == "plain" else
                 f"speedrun {name} ({str(row.get('commit') or '')[:7]}), `{d.get('command')}`")
        rows.append(("fashion_crowded", [cell(f"{label}; K = {d['busy_processes']}"), str(len(row["alone"]["runs_s"])),
                                         num(row["alone"]["median_s"]), num(row["busy"]["median_s"]),
                                         ratio(row["slowdown_busy_over_alone"])]))
    return rows


def run_folder(d: dict, rec: Record):
    """A run folder's summary (`speedrun train --out`): one row."""
    recipe, opts = settings(d.get("command"))
    t = topic(d.get("recipe") or recipe, d.get("command"), on_gpu(d))
    acc = pct(d.get("test_acc")) + (f" ({pct(d['test_acc_no_tta'])})" if d.get("test_acc_no_tta") is not None else "")
    return [(t + "_summary" if t in ("cifar_cpu", "photo") else "other_summary",
             [run_label(d.get("recipe") or recipe, opts), acc, num(d.get("epochs")), num(d.get("train_seconds")),
              num(d.get("wall_seconds"))])]


def bench(d: dict, rec: Record):
    """`speedrun bench`: on a GPU a system row, for fashion-mnist a bench row, else a whole-run row."""
    command = (d.get("environment") or {}).get("command")
    recipe, opts = settings(command, "bench")
    recipe, runs = d.get("recipe") or recipe, d.get("runs") or []
    n = runs_cell(len(runs), [r.get("seed") for r in runs])
    accs, secs = [r.get("test_acc") for r in runs], [(r.get("times") or {}).get("train+eval") for r in runs]
    if on_gpu(d):
        return [("gpu_systems", [cell(f"`speedrun bench {recipe}`" + (f" {opts}" if opts else "")), n,
                                 acc_spread(accs), spread(secs, sd=True), "train+eval", num(d.get("compile_seconds"))])]
    if topic(recipe, command, False) != "fashion":
        return [(topic(recipe, command, False) + "_runs", [run_label(recipe, opts) + "; `speedrun bench`, train+eval",
                                                         n, acc_spread(accs), spread(secs), DASH])]
    s = d.get("summary") or {}
    a, t = s.get("test_acc") or {}, (s.get("times") or {}).get("train+eval") or {}
    p = s.get("p_value_mean_at_least_target")
    acc = f"{pct(a['mean'])} ± {as_pct(a.get('std') or 0):.2f}" if is_num(a.get("mean")) else DASH
    return [("fashion_bench", [run_label(recipe, opts), n, acc,
                               DASH if t.get("mean") is None else f"{num(t['mean'])} ± {num(t.get('std') or 0)}",
                               sci(p) if is_num(p) and p < 0.001 else ratio(p)])]


def gpu_record(d: dict, rec: Record):
    """`benchmarks/gpu_record.py`: a row per system (real data) or variant (random data), and per pair."""
    out, synthetic = [], d.get("mode") == "synthetic"
    jobs = d.get("jobs") if is_num(d.get("jobs")) else 1
    # a warm-up call (--jobs K): K processes shared the machine's CPU, so its times are not comparable
    side_by_side = (f", {jobs} processes side by side: a compile warm-up, its times not comparable with "
                    "a process run alone" if synthetic and jobs > 1 else "")
    for s in d["variants"] if synthetic else d["systems"]:
        runs, speedrun = s.get("runs") or [], synthetic or s.get("kind") == "speedrun"
        label = (f"`{d.get('recipe')}` variant {s.get('variant')}" if synthetic
                 else f"`speedrun bench {s.get('recipe')}`" if speedrun else f"`{s.get('system')}`")
        label += (" " + ", ".join(s["overrides"]) if speedrun and s.get("overrides") else "") + \
            ("; random data" + side_by_side if synthetic else "") + ("" if s.get("ok", True) else " (did not finish)")
        out.append(("gpu_systems", [cell(label), runs_cell(len(runs), [r.get("seed") for r in runs]),
                                    DASH if synthetic else acc_spread([r.get("test_acc") for r in runs]),
                                    spread([r.get("seconds") for r in runs], sd=True),
                                    "train+eval" if speedrun else "the script's own timer",
                                    num(s.get("warmup_seconds"))]))
    return out + [("gpu_pairs", [cell(code(p["a"])), cell(code(p["b"])),
                                 f"{pct(p.get('test_acc_a'))} / {pct(p.get('test_acc_b'))}",
                                 f"{num(p.get('seconds_a'))} / {num(p.get('seconds_b'))}", ratio(p.get("time_ratio"))])
                  for p in d.get("pairs") or []]


def peers(d: dict, rec: Record):
    """`benchmarks/peers.py`: each peer's accuracy and seconds (medians over rounds), speedrun's ratios."""
    epochs, med, figures = d.get("epochs"), (d.get("summary") or {}).get("medians") or {}, {}
    for name, p in (d.get("peers") or {}).items():
        m, train = med.get(name), p.get("train_seconds_without_final_eval")
        per_epoch = train / epochs if is_num(train) and is_num(epochs) and epochs else None
        figures[name] = ((m["test_acc"], m["seconds_per_epoch"], m["final_eval_seconds"], m["process_seconds"]) if m
                         else (p.get("test_acc"), per_epoch, p.get("final_eval_seconds"), p.get("process_seconds")))
    ratios, others = DASH, [f for n, f in figures.items() if n != "speedrun"]
    if "speedrun" in figures and others:
        s = figures["speedrun"]
        best = [min((f[i] for f in others if is_num(f[i])), default=None) for i in (1, 2, 3)]
        ratios = " / ".join(ratio(s[i] / b) if is_num(s[i]) and b else DASH for i, b in zip((1, 2, 3), best))
    cells = ["; ".join([pct(figures[n][0]), *map(num, figures[n][1:])]) if n in figures else DASH
             for n in ("plain", "lightning", "speedrun")]
    return [("peers", [f"{epochs:g} × {len(d.get('rounds') or []) or 1}" if is_num(epochs) else DASH, *cells, ratios])]


def any_network(d: dict, rec: Record):
    """`benchmarks/any_network.py`: a row per network, each system's medians and speedrun's ratio."""
    size = f"{count(d['train_images'])} × {d['epochs']} × {len(d['rounds'])}"
    out = []
    for net in d["networks"]:
        row = d["summary"][net]
        label = f"{net} (narrow)" if d.get("narrow") else net
        cells = ["; ".join([num(row[s]["seconds_per_epoch"]) + " s", pct(row[s]["test_acc"]),
                            "core " + share(row[s].get("core_share"))]) if s in row else DASH
                 for s in ("plain", "speedrun")]
        ratios = (f"{ratio(row['speedrun_over_plain'])} ({', '.join(ratio(r) for r in row['per_round'])})"
                  if is_num(row.get("speedrun_over_plain")) else DASH)
        out.append(("any_network", [label, size, *cells, ratios]))
    return out


def sweep(d: dict, rec: Record):
    """`benchmarks/accuracy_sweep.py`: a row per variant (recipe and its settings)."""
    out, commit = [], str((d.get("environment") or {}).get("git_commit") or "")[:7]
    for v in d["variants"]:
        row, first = d["summary"][v["name"]], d["summary"][v["name"]].get("against")
        accs = [r["test_acc"] for r in d["runs"] if r["variant"] == v["name"] and "test_acc" in r]
        label = f"{v['name']}: `{v['recipe']}` " + (", ".join(v["sets"]) if v["sets"] else f"as at {commit or '?'}")
        vs = f"{100 * first['diff']:+.2f} against {first['variant']} (p {num(first['p'])})" if first else DASH
        out.append(("imagenette_sweep" if "imagenette" in v["recipe"] else "other_sweep",
                    [cell(label), count(len(accs)), acc_spread(accs, sd=True),
                     f"{num(row['p_value_mean_at_least_target'])} (target {pct(row['target'])})", cell(vs)]))
    return out


def compare(d: dict, rec: Record):
    """`speedrun compare A B`, with the where and when of the bench records it names (it has none)."""
    envs = []
    for side in ("a", "b"):
        rel = str((d.get(side) or {}).get("path", "")).split("benchmarks/results/", 1)[-1]
        try:
            envs += environments(json.loads((rec.root / rel).read_text(encoding="utf-8"))) if rel else []
        except (OSError, ValueError):
            pass
    a, b = d["a"], d["b"]
    label = f"{Path(a.get('path', 'A')).parent.name} → {Path(b.get('path', 'B')).parent.name} (`speedrun compare`)"
    return [ab(label, [(f"{d.get('region', 'time')}, s: mean", a["time"]["mean"], b["time"]["mean"], num),
                       ("accuracy: mean", a["test_acc"]["mean"], b["test_acc"]["mean"], pct)], envs)]


def before_after(d: dict, rec: Record):
    """Processes of an earlier and a later commit: in pairs, or as two lists of train_cli records."""
    sides, counts = [], []
    for k in ("before", "after"):
        if "pairs" in d:
            envs = [e for pr in d["pairs"] for e in environments(pr.get(k))]
            process, acc = mean(d["summary"][f"{k}_process_seconds"]), mean(d["summary"][f"{k}_test_acc"])
        else:
            runs, envs = [r for x in d[k] for r in x.get("runs", [])], [e for x in d[k] for e in environments(x)]
            process = mean([r.get("process_wall_seconds") for r in runs])
            acc, counts = mean([(r.get("summary") or {}).get("test_acc") for r in runs]), counts + [len(runs)]
        sides.append((commits(envs), process, acc))
    (ca, pa, aa), (cb, pb, ab_) = sides
    n = f"{len(d['pairs'])} pairs" if "pairs" in d else f"{counts[0]} + {counts[1]} processes"
    return [ab(f"before ({ca}) → after ({cb}), {n}", [("whole process, s: mean", pa, pb, num),
                                                      ("accuracy: mean", aa, ab_, pct)])]


def alternating(d: dict, rec: Record):
    """Runs that alternate one setting (each run names it): the first value seen is A."""
    runs = d["runs"]
    key = next(k for k in runs[0] if k not in ("order", "summary", "process_wall", "process_wall_seconds"))

    def wall(r):                                            # a number, or a text such as "412.3 s"
        w = r.get("process_wall_seconds", r.get("process_wall"))
        m = re.match(r"\s*([0-9.]+)\s*s\b", str(w))
        return w if is_num(w) else float(m.group(1)) if m else None

    def side(rs):
        return [mean(map(wall, rs))] + [mean([(r.get("summary") or {}).get(k) for r in rs])
                                        for k in ("train_seconds", "test_acc")]

    a, b = [[r for r in runs if r[key] == v] for v in list(dict.fromkeys(r[key] for r in runs))[:2]]
    names = ("whole process, s: mean", "train_seconds: mean", "accuracy: mean")
    measures = zip(names, side(a), side(b), (num, num, pct))
    return [ab(f"{key}={a[0][key]} → {key}={b[0][key]}, {len(a)} + {len(b)} processes", list(measures))]


def workers_label(d) -> str:
    a, b = list(d["summary"])[:2]
    n = [sum(1 for r in d.get("runs", []) if r.get("workers_started_by") == k) for k in (a, b)]
    return f"workers started by {a} → by {b}, {n[0]} + {n[1]} records"


def ops_sides(d) -> list[str]:
    return [k for k, v in d.items() if isinstance(v, dict) and "ops_per_step" in v][:2]


# A-against-B kinds as specs: their two sides, what they are, their measures
train_vs = two_sides(  # `train_vs.py`: whole processes from another tree and from this one
    lambda d: (d["medians"]["other"], d["medians"]["this"]),
    lambda d: (f"tree {d['other_tree_commit']} → this tree ("
               + distinct(str(s.get("git_commit", ""))[:7] for s in (d.get("samples") or {}).get("this", []))
               + f"), `{d.get('recipe')}`, {d.get('rounds')} rounds"),
    [("whole process, s: median", "process_wall_seconds", num), ("train_seconds: median", "train_seconds", num)])
hold_memory = two_sides(  # `hold_memory.py`: runtime.hold_memory off against auto
    lambda d: (d["medians"]["off"], d["medians"]["auto"]),
    lambda d: f"runtime.hold_memory off → auto: `{d.get('command')}`, {d.get('rounds')} rounds",
    [("whole process, s: median", "process_seconds", num), ("minor page faults: median", "minor_page_faults", count),
     ("peak resident, MiB: median", "max_rss_mib", num), ("model step, s: median", "model_seconds_per_step", num),
     ("train_seconds: median", "train_seconds", num)])
variant_pair = two_sides(  # two named variants' whole processes
    lambda d: list(d["result"].values())[:2], lambda d: " → ".join(list(d["result"])[:2]),
    [("whole process, s", "process_wall_seconds", num), ("accuracy", "test_acc", pct)])
fork_workers = two_sides(  # `photo_input.py`: the streamed pipeline's workers started two ways
    lambda d: list(d["summary"].values())[:2], workers_label,
    [("streamed training epoch, s: mean", "epoch_seconds_mean", num),
     ("whole process, s: mean", "process_wall_seconds_mean", num)])
engine_vs_plain = two_sides(  # `engine_vs_plain.py`: the plain loop's step against speedrun's
    lambda d: [{"step": d["median_seconds_per_step"][k]} for k in ("plain", "speedrun")],
    lambda d: f"peers.py's plain loop → speedrun's engine, `{d.get('recipe')}` {d.get('precision', '')}",
    [("training step, s: median", "step", num)])
step_ops = two_sides(  # `step_ops_vs.py`: eager ATen ops per step of two trees
    lambda d: [d[k] for k in ops_sides(d)], lambda d: " → ".join(ops_sides(d)),
    [("ATen ops per eager step", "ops_per_step", count)])


def step_time_vs(d: dict, rec: Record):
    """`step_time_vs.py`: the model step's median seconds per recipe, another tree against this one."""
    return [ab(f"tree {d.get('base_commit')} → this tree",
               [(f"`{r}` model step, s: median", v["median_model_seconds_per_step"]["base"],
                 v["median_model_seconds_per_step"]["this"], num) for r, v in sorted(d["recipes"].items())])]


def step_levers(d: dict, rec: Record):
    """`cpu_step_levers.py`: each lever's step time ratio at each training size."""
    levers: dict[str, list] = {}
    for lv in d["levers"]:
        levers.setdefault(lv["lever"], []).append((lv["size"], lv["ratio"]))
    return [("step_levers", [code(d.get("recipe")), code(k), ", ".join(f"{s} px {ratio(r)}" for s, r in sorted(v))])
            for k, v in levers.items()]


def same_weights(d: dict, rec: Record):
    """`benchmarks/same_weights.py`: per setting, another tree's trained weights against this tree's."""
    return [ab(f"tree {d.get('base_commit')} → this tree, `{d.get('recipe')}` {st.get('setting')} "
               f"({', '.join(st.get('sets') or []) or 'as shipped'}; {' '.join(d.get('extra') or [])}): "
               + ("weights identical to the bit" if st.get("identical") else "weights DIFFER"),
               [(name, st["runs"]["base"].get(key), st["runs"]["this"].get(key), fmt)
                for name, key, fmt in (("accuracy", "test_acc", pct), ("steps", "steps", count))])
            for st in d["settings"]]


def step_structure(d: dict, rec: Record):
    """`benchmarks/step_structure.py`: per recipe, eager ops / host syncs per step and compiled breaks /
    regions / eager ops / host syncs per step for each precision (and setting); then ms per step."""
    by_recipe: dict[str, dict[bool, list[str]]] = {}
    for r in (d.get("rows") or []) + (d.get("ddp") or []):
        extra = [o for o in (r.get("overrides") or [])
                 if not o.startswith(("model.widths=", "model.width=", "data.batch_size=", "eval."))]
        keys = ["graph_breaks", "compiled_regions_per_step"] if r.get("compiled") else []
        text = " ".join([str(r.get("precision")), *extra]) + (f", {r['processes']} processes"
                                                              if r.get("processes") else "")
        text += " " + " / ".join(count(r.get(k)) for k in [*keys, "eager_ops_per_step", "host_syncs_per_step"])
        by_recipe.setdefault(str(r.get("recipe")), {True: [], False: []})[bool(r.get("compiled"))].append(text)
    timing: dict[tuple, dict] = {}
    for t in d.get("timing") or []:
        ms = [v for v in t.get("ms_per_step") or [] if is_num(v)]
        timing.setdefault((t.get("recipe"), t.get("precision")), {})[bool(t.get("compiled"))] = \
            statistics.median(ms) if ms else None
    return ([("step_structure", [code(recipe), cell("; ".join(m[False]) or DASH), cell("; ".join(m[True]) or DASH)])
             for recipe, m in by_recipe.items()]
            + [("step_timing", [code(recipe), cell(precision), num(ms.get(False)), num(ms.get(True))])
               for (recipe, precision), ms in timing.items()])


def stop_check(d: dict, rec: Record):
    """`step_structure.py --stop-check`: microseconds per call of the loop's stop check."""
    m = d["median_us"]
    return [("stop_check", [str(d["calls_per_round"]), num(m["one_process_us"]), num(m["two_processes_gloo_us"])])]


def tta_views(d: dict, rec: Record):
    """`tta_views.py`: per recipe and view set, accuracy and seconds at each share of the test images."""
    out, by_recipe = [], {}
    for r in d["runs"]:
        by_recipe.setdefault(str(r.get("recipe")), []).append(r)
    for recipe, runs in sorted(by_recipe.items()):
        views: dict = {}
        for v in (v for r in runs for v in r.get("variants") or []):
            entry = views.setdefault(v.get("tta"), {"views": v.get("views"), "fractions": {}})
            entry["fractions"].setdefault(v.get("fraction"), []).append((v.get("test_acc"), v.get("seconds")))
        for tta, v in views.items():
            parts = [f"{share(fr) if is_num(fr) else fr}: {acc_spread([a for a, _ in got])}, "
                     f"{num(mean([s for _, s in got]))} s" for fr, got in v["fractions"].items()]
            out.append(("tta", [code(recipe), runs_cell(len(runs), [r.get("seed") for r in runs]), code(tta),
                                count(v["views"]), cell("; ".join(parts))]))
    return out


def kernel_profile(d: dict, rec: Record):
    """Kernel time of one profiled run, and the shares of its three largest kinds of kernel."""
    total = d.get("kernel_seconds") or 0
    kinds = sorted(((v.get("seconds") or 0, k) for k, v in (d.get("by_kind") or {}).items()), reverse=True)[:3]
    return [("gpu_profile", [cell(d.get("label")), count(d.get("kernels")), num(d.get("kernel_seconds")),
                             num(d.get("wall_seconds")),
                             cell(", ".join(f"{k} {s / total:.0%}" for s, k in kinds) if total else DASH)])]


def ablate(d: dict, rec: Record):
    """`speedrun ablate`: the recipe's accuracy, and the four largest losses without a trick."""
    base = next((v.get("test_acc") or {} for v in d["variants"] if v.get("kind") == "baseline"), {})
    losses = sorted((v["test_acc"]["mean"], v.get("label", "")) for v in d["variants"]
                    if v.get("kind") != "baseline" and is_num((v.get("test_acc") or {}).get("mean")))[:4]
    return [("fashion_ablate", [count(d.get("runs_per_variant")), pct(base.get("mean")),
                                cell("; ".join(f"{label.replace('without ', '')} {pct(a)}" for a, label in losses))])]


airbench_script = rows("gpu_systems", lambda d: [  # airbench's own script, run by itself
    cell(f"`{d['script']}` (airbench's script)"), str(len(d.get("runs") or [])),
    acc_spread([r.get("tta_acc") for r in d.get("runs") or []]),
    spread([r.get("seconds") for r in d.get("runs") or []], sd=True), "the script's own timer",
    num(d.get("warmup_wall_seconds"))])
gpu_smoke = rows("gpu_smoke", lambda e: [  # the GPU smoke run of the recipe matrix: a row per entry
    code(e.get("id")), cell("no: " + str(e.get("error", "")).split(":", 1)[0] if not e.get("ok") else
                            "yes, a loss not finite" if e.get("finite_losses") is False else "yes"),
    num(e.get("compile_seconds")), count(e.get("recompiles")), num(e.get("step_ms")),
    share((e.get("gpu_busy") or {}).get("busy_fraction"))], lambda d: d["entries"])
tuning = rows("imagenette_tuning", lambda r: [  # `imagenette_step.py`'s tuning runs
    cell(r.get("run")), pct(r.get("test_acc")), num(r.get("train_seconds")),
    cell(", ".join(r.get("overrides") or []) or "the recipe then")], lambda d: d["runs"])
photo_input = rows("photo_input", lambda d: [  # `photo_input.py`: decode once, the pipelines alone, an epoch of each
    num((d.get("decode") or {}).get("images_per_s")),
    " / ".join(num((d.get("pipeline_images_per_s") or {}).get(k)) for k in ("streamed", "cached")),
    cell("; ".join(f"cache {t.get('cache')}: {num(t.get('images_per_s'))}, {pct(t.get('test_acc'))}"
                   for t in d.get("training") or []))])
stream_pipeline = rows("photo_stream", lambda d: [  # `stream_pipeline.py`: streamed against per-sample Pillow
    count(d.get("images")), count(d.get("workers")),
    cell("; ".join(f"{r.get('pipeline')}, {r.get('crop')}: {count(r.get('images_per_second'))}" for r in d["results"])),
    cell(", ".join(f"{k} {ratio(v)}" for k, v in (d.get("speedup") or {}).items()))])
photo_throughput = rows("photo_throughput", lambda r: [  # a whole run against the model step alone
    cell(f"`{r.get('recipe')}` run {r.get('run')}"), count(r.get("images")), num(r.get("process_wall_seconds")),
    f"{num((r.get('summary') or {}).get('train_seconds'))} ({num((r.get('summary') or {}).get('compile_seconds'))})",
    count(r.get("pipeline_images_per_second")), count(r.get("model_step_images_per_second")),
    ratio(r.get("pipeline_over_model")), cell(r.get("bound_by"))], lambda d: d["runs"])
resnet50 = rows("resnet50", lambda d: [  # the ResNet-50 step alone, and each pipeline feeding it
    code(d.get("recipe")), f"{d.get('batch')} × {d.get('image_size')}",
    count(d["model_step"].get("images_per_second_median")),
    cell("; ".join(f"{p.get('pipeline')}: not available" if p.get("available") is False else
                   f"{p.get('pipeline')}, {p.get('decoding')}: {count(p.get('images_per_second_median'))} "
                   f"({ratio(p.get('pipeline_over_model'))}, {p.get('bound_by')})" for p in d.get("pipelines") or [])),
    num(d.get("compile_seconds"))])
cuda_graph_inputs = rows("step_cuda_graphs", lambda d: [  # compiled graphs, their mutated inputs not static
    str(len(d["rows"])), str(sum(len(r.get("graphs") or []) for r in d["rows"])),
    count(sum(r.get("mutated_not_static_total") or 0 for r in d["rows"])),
    num(sum(r.get("seconds") or 0 for r in d["rows"]))])
flops = rows("step_flops", lambda d: [  # `speedrun flops`: per image and run, the model's FLOP/s, share of the peak
    code(d.get("recipe")), cell(d.get("precision")), sci(d.get("flops_per_train_image")), sci(d.get("total_flops")),
    sci(d.get("model_flops_per_s")), share(d.get("model_utilisation"))])


# ------------------------------------------------------------------------------------------
# Which kind a record is: the first predicate that holds names its reader, and the script
# that writes such records (None: the package's own commands, or no one script)
# ------------------------------------------------------------------------------------------

def has(d, *keys) -> bool:
    return all(k in d for k in keys)


def first_run(d) -> dict:
    runs = d.get("runs")
    return runs[0] if isinstance(runs, list) and runs and isinstance(runs[0], dict) else {}


KINDS = [
    (lambda d: has(d, "entries", "what") and "gpu_smoke" in str(d.get("script", "")), gpu_smoke, "gpu_smoke.py"),
    (lambda d: d.get("mode") == "real" and "systems" in d or d.get("mode") == "synthetic" and "variants" in d,
     gpu_record, "gpu_record.py"),
    (lambda d: has(d, "regions", "runs", "summary"), bench, None),
    (lambda d: has(d, "variants", "runs_per_variant"), ablate, None),
    (lambda d: has(d, "variants", "runs", "summary") and "accuracy_sweep" in str(d.get("command", "")), sweep,
     "accuracy_sweep.py"),
    (lambda d: has(d, "verdict", "a", "b"), compare, None),
    (lambda d: has(d, "script", "mean_tta_acc", "runs"), airbench_script, None),
    (lambda d: has(d, "by_kind", "kernels"), kernel_profile, None),
    (lambda d: has(d, "test_acc", "train_seconds", "recipe") and "runs" not in d, run_folder, None),
    (lambda d: bool(d.get("busy_processes")) and has(d, "systems", "summary"), crowded, "train_cli.py"),
    (lambda d: d.get("benchmark") == "speedrun train, whole process" or isinstance(d.get("test_acc"), list)
     and ("combined_from" in d or "parts" in d), whole_runs, "train_cli.py"),
    (lambda d: has(d, "peers", "definitions"), peers, "peers.py"),
    (lambda d: has(d, "networks", "rounds", "summary") and "did not design" in str(d.get("benchmark")), any_network,
     "any_network.py"),
    (lambda d: has(d, "median_seconds_per_step", "speedrun_over_plain"), engine_vs_plain, "engine_vs_plain.py"),
    (lambda d: has(d, "pairs", "summary") and "after_process_seconds" in (d.get("summary") or {})
     or isinstance(d.get("after"), list) and isinstance(d.get("before"), list), before_after, None),
    (lambda d: has(d, "other_tree_commit", "medians"), train_vs, "train_vs.py"),
    (lambda d: has(d, "medians") and has(d["medians"], "off", "auto"), hold_memory, "hold_memory.py"),
    (lambda d: has(d, "result", "run") and isinstance(d.get("run"), dict), whole_runs, "train_cli.py"),
    (lambda d: isinstance(d.get("result"), dict) and len(d["result"]) == 2
     and all(isinstance(v, dict) and "test_acc" in v for v in d["result"].values()), variant_pair, None),
    (lambda d: has(d, "model_step_seconds", "runs"), tuning, "imagenette_step.py"),
    (lambda d: has(d, "pipeline_images_per_s", "decode"), photo_input, "photo_input.py"),
    (lambda d: has(d, "runs", "model_step", "photos") and "throughput" in str(d.get("script", "")),
     photo_throughput, "throughput.py"),
    (lambda d: has(d, "model_step", "pipelines", "scale_input"), resnet50, "throughput.py"),
    (lambda d: has(d, "settings", "base_commit") and "same_weights" in str(d.get("script", "")), same_weights,
     "same_weights.py"),
    (lambda d: "workers_started_by" in first_run(d) and "summary" in d, fork_workers, "photo_input.py"),
    (lambda d: "summary" in first_run(d) and "order" in first_run(d) and len(first_run(d)) >= 3, alternating, None),
    (lambda d: has(d, "results", "speedup"), stream_pipeline, "stream_pipeline.py"),
    (lambda d: has(d, "levers"), step_levers, "cpu_step_levers.py"),
    (lambda d: "mutated_not_static_total" in ((d.get("rows") or [{}])[0] or {}), cuda_graph_inputs,
     "cuda_graph_inputs.py"),
    (lambda d: has(d, "rows", "timing"), step_structure, "step_structure.py"),
    (lambda d: has(d, "one_process_us", "median_us"), stop_check, "stop_check.py"),     # (since: "script" names it)
    (lambda d: has(d, "base_commit", "recipes"), step_time_vs, "step_time_vs.py"),
    (lambda d: sum(1 for v in d.values() if isinstance(v, dict) and "ops_per_step" in v) == 2, step_ops,
     "step_ops_vs.py"),
    (lambda d: d.get("benchmark") == "tta_views" and isinstance(d.get("runs"), list), tta_views, "tta_views.py"),
    (lambda d: has(d, "flops_per_train_image", "total_flops") and "runs" not in d, flops, None),
]


def kind_of(d) -> tuple:
    """(reader, script) of a record's kind, or (None, None)."""
    return next(((reader, script) for holds, reader, script in KINDS if isinstance(d, dict) and holds(d)),
                (None, None))


# ------------------------------------------------------------------------------------------
# The page: every table, then the records whose script left benchmarks/
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
GONE = ("\n## Records whose script left the tree\n\nTheir scripts are no longer in `benchmarks/`: one-off "
        "comparisons whose answer is settled, and scripts merged into another (the two throughput scripts are the "
        "two modes of `benchmarks/throughput.py`); their records stay above. Each script comes back as it was when it left with "
        "the command beside it (the script at the commit before the one that removed it); as a record ran it, with "
        "`git show COMMIT:benchmarks/NAME` for the commit the record names (beside each record below).\n\n")


def gone_scripts(rec: Record, reader, script: str | None) -> list[str]:
    """The scripts that made ``rec`` and are no longer in benchmarks/: its kind's script (the one
    the record names, where it names one: a kind's script may have had another name), or, for a
    record no kind reads, every script its command lines name."""
    d = rec.data if isinstance(rec.data, dict) else {}
    env = d.get("environment") if isinstance(d.get("environment"), dict) else {}
    commands = (d.get("command"), env.get("command"))
    named = str(d.get("script") or "")
    if script and named.endswith(".py"):
        script = Path(named).name
    names = [script] if reader else [n for c in commands for n in re.findall(r"[a-z_]+\.(?:py|sh)\b", str(c or ""))]
    return [n for n in dict.fromkeys(names) if n and not (ROOT / "benchmarks" / n).exists()]


def table_md(headers, rows) -> str:
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [headers, ["---"] * len(headers), *rows]) + "\n"


def full_row(headers, rec: Record, cells, envs=None) -> list[str]:
    """A reader's cells with the record's name and its where/when cells in their columns."""
    if len(cells) != len(headers) - 1 - len(WHERE):
        raise ValueError(f"{len(cells)} cells for {len(headers)} columns")
    given, place = iter(cells), iter(where(rec, envs))
    return [rec.name_cell() if h == "record" else next(place) if h in WHERE else next(given) for h in headers]


def record_rows(rec: Record, reader, headers: dict) -> list:
    """The record's (table id, full row) rows; a row under "Other records" where it has none."""
    why = rec.error or ("a format this page does not read" if reader is None else None)
    if not why:
        try:
            got = [(t, full_row(headers[t], rec, cells, *envs)) for t, cells, *envs in reader(rec.data, rec)]
            why = None if got else "no figures in the format this page reads"
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, StopIteration,
                ZeroDivisionError, statistics.StatisticsError) as err:
            why = f"its figures could not be read ({type(err).__name__})"
    if not why:
        return got
    text = what_text(rec.data)
    return [("other", full_row(headers["other"], rec, [cell(text if len(text) <= 200 else text[:199] + "…"),
                                                       cell(why)]))]


def render(results: Path = RESULTS) -> str:
    headers = {tid: head for _, _, tables in SECTIONS for tid, _, head in tables}
    table_rows: dict[str, list] = {tid: [] for tid in headers}
    gone: dict[str, list[str]] = {}
    for rec in load_records(results):
        reader, script = (None, None) if rec.error else kind_of(rec.data)
        for i, (table, cells) in enumerate(record_rows(rec, reader, headers)):
            table_rows[table].append(((rec.rel, i), cells))
        for name in gone_scripts(rec, reader, script):
            gone.setdefault(name, []).append(f"`{rec.rel}` ({where(rec)[2]})")
    parts = [INTRO]
    for title, intro, tables in SECTIONS:
        tables = [t for t in tables if table_rows[t[0]]]
        if tables:
            n = len({key[0] for tid, _, _ in tables for key, _ in table_rows[tid]})
            parts.append(f"\n## {title}\n\n{intro} {n} record{'s' if n != 1 else ''}.\n")
        for tid, table_title, head in tables:
            parts.append((f"\n### {table_title}\n" if len(tables) > 1 else "") + "\n"
                         + table_md(head, [cells for _, cells in sorted(table_rows[tid], key=lambda r: r[0])]))
    if gone:
        back = "git show $(git rev-list -1 HEAD -- benchmarks/{0})^:benchmarks/{0}"
        parts.append(GONE + table_md(["script", "get it back", "its records (the commit each ran from)"],
                                     [[code(n), code(back.format(n)), cell("; ".join(gone[n]))] for n in sorted(gone)]))
    return "".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 when docs/results.md differs from what this script would write")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if (PAGE.read_text(encoding="utf-8") if PAGE.is_file() else None) != text:
            print(f"docs/results.md is not current with benchmarks/results/: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    from speedrun.files import atomic_write_text            # (the package's one way of writing a file whole)
    atomic_write_text(PAGE, text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
