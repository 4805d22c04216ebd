"""speedrun's CIFAR-10 recipes against peers' own public scripts, one after another on one
machine, each system in its own fresh process, as one JSON record; or K variants of a recipe
on random CIFAR-shaped data (``--synthetic``), timed and optionally profiled by kernel kind.

Real mode (the record for a GPU, e.g. against Keller Jordan's airbench):

    python benchmarks/gpu_record.py --runs 10 --data-dir DIR --commit SHA [--out FILE.json] \\
        --system peer:/path/to/airbench94_muon.py#210 --system speedrun:cifar10-94-fast#75 \\
        --system 'speedrun:cifar10-94-fast@runtime.cuda_graphs=on#75' \\
        --system speedrun:cifar10-94 --system peer:/path/to/legacy/airbench94.py \\
        [--pair cifar10-94-fast:airbench94_muon.py ...] [--device cuda|cpu] [--set KEY=VALUE ...] \\
        [--work DIR] [--budget SECONDS] [--limit SECONDS]

On a lent GPU machine, which returns only the files under ``$OUT``, leave ``--out`` out: the
record is written to ``$OUT/gpu-record.json`` (``$OUT/gpu-record-synthetic.json`` with
``--synthetic``); without $OUT, ``--out`` is required. Arguments can also come from a file,
``@FILE`` (one or more a line, ``#`` comment lines): ``benchmarks/lending/`` holds the two calls
of a lending.

- ``speedrun:RECIPE[@KEY=VALUE...]``: ``python -m speedrun bench RECIPE --runs N`` in its own
  process (its warm-up, then N seeded runs in that process); ``--set`` applies to every
  speedrun system, before the system's own ``@`` overrides.
- ``peer:SCRIPT``: a peer's own script, unmodified, run from the path given (never copied) by
  ``peer_runner.py`` in its own process, in a work folder where ``cifar10/train.pt`` and
  ``test.pt`` have been written from DIR/cifar-10-batches-py: the script's warm-up as its
  ``__main__`` does it, then N runs, each read from its own logging (timer and TTA accuracy).
- ``--pair A:B`` (system names: a speedrun system as written after ``speedrun:``, a peer by
  its file name): A's mean and median time over B's, both accuracies, and the per-seed
  accuracy difference where both ran the same seeds.
- ``SPEC#SECONDS`` (or ``--limit SECONDS`` for all): the system's time limit. Its whole process
  group is stopped there; the runs it finished stay in the record, the entry marked ``cut``.
  With ``--budget SECONDS`` (the call's time) a system starts only if its limit fits in what is
  left (one without a limit starts while any is left and is stopped at the end), else it is
  listed in ``left_out`` with the reason. Systems compiling with ``max-autotune``
  (airbench94_muon.py: about 140 s of warm-up) run first, the rest in the order given.

Synthetic mode (timing variants without data on the machine):

    python benchmarks/gpu_record.py --synthetic --recipe cifar10-94-fast --variant base \\
        --variant 'ro:runtime.cuda_graphs=on' --runs 5 [--profile] \\
        [--n-train 50000 --n-test 10000] [--set KEY=VALUE ...] --out benchmarks/results/NAME.json

Random uint8 images of CIFAR's shapes (3 x 32 x 32, 10 classes) as an ``.npz`` in a temporary
folder (deleted afterwards); each variant (``NAME`` or ``NAME:KEY=VALUE@KEY=VALUE``, a limit
after ``#`` as for systems) in its own
process: build and warm up (compile), N timed runs, and with ``--profile`` one more run under
torch.profiler: kernel time by kind (CUDA kernels on a GPU, CPU ops' own time on a CPU), total
kernel time against the run's seconds, and kernels per training step. Accuracies on random
labels mean nothing: only the times do.

Every timed run records its recompiles (graphs compiled during it: 0 when the warm-up covered
everything); each summary holds means, medians, sd and 95% intervals of the seconds and the TTA
accuracy; each entry its warm-up (compile) seconds and ``nvidia-smi``'s clocks after it.
What each timed figure holds is in the record's ``definitions``. The record is written
(atomically) after every system or variant, so a command cut short keeps what finished; the
commit is read when the script starts (``--commit``, else $SPEEDRUN_COMMIT, else
``git rev-parse HEAD``; a GPU machine without .git needs ``--commit``). A missing peer script,
missing data or a bad system spec stops before anything runs: one line, exit code 2.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path[:0] = [str(ROOT / "src"), str(BENCH)]

from peer_runner import CIFAR_FILES, PeerError, check_script, long_warmup, write_cifar10_pt  # noqa: E402
from record_figures import pair_figures, print_table, summarize  # noqa: E402
from time_limits import Budget, ChildRun, Slot, run_limited, split_limit  # noqa: E402
from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.files import atomic_write_json, check_output_file  # noqa: E402
from speedrun.recipe import load_recipe  # noqa: E402
from speedrun.report.environment import machine, read_commit  # noqa: E402

CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

DEFINITIONS = {
    "speedrun.seconds": "speedrun bench's train+eval region of each run: from the first touch of the training data "
                        "on the device (its channel statistics, the whitening fit) through training to the final "
                        "TTA accuracy, the device synchronised at both ends; per-epoch monitoring evaluations "
                        "(eval.every) are paused out of it, as airbench's timer leaves its own out; the dataset is "
                        "re-read from disk and moved to the device before each run, outside this region (its "
                        "end_to_end region holds both), as the peers load theirs before their timers",
    "speedrun.warmup_seconds": "speedrun bench's compile_seconds: the Session's warm-up after the model is built "
                               "(compilation, cuDNN autotuning, every shape of the training step and evaluation run "
                               "once on random data), before the first timed run",
    "peer.seconds": "the peer script's own timer (airbench: time_seconds / total_time_seconds, CUDA events "
                    "around the whitening fit, each epoch's training and the final TTA evaluation; not its "
                    "per-epoch evaluations, not the loading of cifar10/*.pt onto the device)",
    "peer.wall_seconds": "the whole main(run, ...) call of the peer, synchronised: loading the data onto the "
                         "device, per-epoch evaluations and printing included",
    "peer.warmup_seconds": "wall time of the set-up statements of the peer's __main__ block (models built and "
                           "compiled as it does) plus its main('warmup', ...) run, synchronised at the end",
    "process_wall_seconds": "the system's whole subprocess, from before its interpreter starts to its exit",
    "runs.recompiles": "graphs dynamo compiled during the timed run (speedrun: its loop's count; peers: dynamo's "
                       "count around the main(run, ...) call); 0 when the warm-up compiled everything",
    "cut": "the system's process group was stopped at limit_seconds (limit_from: its own limit, or the end of "
           "--budget); its runs are those it finished before, and its summary is over them",
    "pairs.time_ratio": "mean seconds of A over mean seconds of B (each system's own timed region, above)",
    "synthetic.seconds": "as speedrun.seconds, on the random data",
    "synthetic.warmup_seconds": "as speedrun.warmup_seconds; build_and_warmup_seconds adds building the model",
    "synthetic.profile": "one more run under torch.profiler after the timed ones (its seconds are inflated by the "
                         "profiler): on CUDA every device event (kernels, copies, fills) by kind, on a CPU every "
                         "CPU event's own time (self time, so nested ops count once) by kind; kernels_per_step "
                         "counts device events (CPU: leaf ops) that start between the first and the last training "
                         "step's end, divided by the steps between them",
}


def refuse(message: str) -> None:
    """One line on stderr, exit code 2, nothing written."""
    print(f"gpu_record: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


# ------------------------------------------------------------------------------------------
# Systems and variants
# ------------------------------------------------------------------------------------------

@dataclass
class System:
    kind: str                       # "speedrun" or "peer"
    name: str                       # how the record, the table and --pair name it
    spec: str
    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)
    path: Path | None = None
    aliases: tuple[str, ...] = ()
    limit: float | None = None      # seconds its process may run (None: no limit)
    long_warmup: bool = False       # compiles with max-autotune: run first


SYSTEM_FORMS = "speedrun:RECIPE[@KEY=VALUE...][#SECONDS] or peer:PATH/TO/SCRIPT.py[#SECONDS]"


def parse_overrides(text: str, where: str) -> list[str]:
    over = [o for o in text.split("@")] if text else []
    bad = [o for o in over if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        refuse(f"{where}: {bad[0]!r} is not KEY=VALUE")
    return over


def with_limit(spec: str, default: float | None, where: str) -> tuple[str, float | None]:
    """The spec without its ``#SECONDS`` suffix, and its limit (else ``default``)."""
    try:
        body, limit = split_limit(spec)
    except ValueError as err:
        refuse(f"{where} {err}")
    return body, default if limit is None else limit


def parse_system(given: str, sets: list[str], default_limit: float | None) -> System:
    spec, limit = with_limit(given, default_limit, "--system")
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in ("speedrun", "peer") or not rest:
        refuse(f"--system {spec!r}: expected {SYSTEM_FORMS}")
    if kind == "peer":
        path = Path(rest).expanduser()
        if not path.is_file():
            refuse(f"--system {spec}: no peer script at {path}" + (" (a folder)" if path.is_dir() else ""))
        try:
            plan = check_script(path)
        except PeerError as err:
            refuse(f"--system {spec}: {err}")
        return System("peer", path.name, spec, path=path.resolve(), aliases=(rest,), limit=limit,
                      long_warmup=long_warmup(plan))
    recipe, _, tail = rest.partition("@")
    if not recipe:
        refuse(f"--system {spec!r}: no recipe before '@'; expected {SYSTEM_FORMS}")
    over = parse_overrides(tail, f"--system {spec}")
    try:
        settled = load_recipe(recipe, [*sets, *over])
    except SpeedrunError as err:
        refuse(f"--system {spec}: {err}")
    autotune = str(getattr(settled.runtime, "compile_mode", "")).startswith("max-autotune")
    return System("speedrun", rest, spec, recipe=recipe, overrides=over, limit=limit, long_warmup=autotune)


def run_order(systems: list[System]) -> list[System]:
    """The systems as given, except that those compiling with max-autotune (airbench94_muon.py:
    about 140 s of warm-up) come first: late in a call their limit would no longer fit the budget."""
    return [s for s in systems if s.long_warmup] + [s for s in systems if not s.long_warmup]


def parse_pair(spec: str, systems: list[System]) -> tuple[str, str]:
    names = {}
    for s in systems:
        for alias in (s.name, *s.aliases):
            names.setdefault(alias, s.name)
    for at in [i for i, c in enumerate(spec) if c == ":"]:
        a, b = spec[:at], spec[at + 1:]
        if a in names and b in names and names[a] != names[b]:
            return names[a], names[b]
    refuse(f"--pair {spec!r}: expected A:B naming two of the systems ({', '.join(s.name for s in systems)})")


def check_data(data_dir: str | None, why: str) -> Path:
    if not data_dir:
        refuse(f"--data-dir is needed: {why} read CIFAR-10's official python batches from DIR/cifar-10-batches-py")
    batches = Path(data_dir).expanduser() / "cifar-10-batches-py"
    missing = [n for n in CIFAR_FILES if not (batches / n).is_file()]
    if missing:
        refuse(f"--data-dir {data_dir}: no CIFAR-10 python batches at {batches} (missing {', '.join(missing)}); "
               f"{why} need the official files")
    return batches


# ------------------------------------------------------------------------------------------
# The machine
# ------------------------------------------------------------------------------------------

GPU_FIELDS = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu"


def gpu_state() -> list[dict] | None:
    """The GPUs' name, clocks, power draw and temperature as found (nvidia-smi; None without it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_FIELDS}", "--format=csv"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    lines = [line for line in out.stdout.strip().splitlines() if line.strip()]
    head = [h.strip() for h in lines[0].split(",")] if lines else []
    return [dict(zip(head, (v.strip() for v in line.split(",")))) for line in lines[1:]]


# ------------------------------------------------------------------------------------------
# Children
# ------------------------------------------------------------------------------------------

def child_env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def slug(i: int, name: str) -> str:
    return f"{i:02d}-" + re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:80]


def run_child(cmd: list[str], log: Path, slot: Slot, entry: dict, cwd: Path | None = None) -> ChildRun:
    """Run one system's or variant's process under its slot's time limit; the entry gets its
    command, limit and whole-process seconds."""
    entry.update(command=" ".join(["python", *cmd[1:]]), limit_seconds=slot.stop_after, limit_from=slot.stopped_by)
    child = run_limited(cmd, log, child_env(), slot.stop_after, cwd)
    entry["process_wall_seconds"] = child.wall
    return child


def settle(entry: dict, child: ChildRun, runs: int, slot: Slot, missing: str) -> dict:
    """Whether the entry is complete; a process stopped at its limit is marked cut, and the runs
    it finished stay in the entry."""
    done = len(entry.get("runs", []))
    if child.cut:
        entry["cut"] = {"by": slot.stopped_by, "at_seconds": slot.stop_after, "runs_finished": done,
                        "runs_asked": runs}
    entry["ok"] = child.rc == 0 and not child.cut and done == runs
    if not entry["ok"]:
        why = (f"stopped by {slot.stopped_by} ({slot.stop_after:.0f} s) after {done} of {runs} runs" if child.cut
               else f"exit code {child.rc}" if child.rc else missing)
        entry.update(error=why, output_tail=child.tail)
    entry["summary"] = summarize(entry.get("runs", []))
    entry["gpu_after"] = gpu_state()
    return entry


def run_speedrun(i: int, s: System, args, work: Path, slot: Slot) -> dict:
    folder = work / slug(i, s.name)
    sets = [*args.sets, *s.overrides]
    cmd = [sys.executable, "-m", "speedrun", "bench", s.recipe, "--runs", str(args.runs), "--out", str(folder),
           *(["--data-dir", str(Path(args.data_dir).resolve())] if args.data_dir else []),
           *(["--device", args.device] if args.device else []), *[a for o in sets for a in ("--set", o)]]
    entry = {"system": s.name, "kind": "speedrun", "spec": s.spec, "recipe": s.recipe, "overrides": sets}
    shutil.rmtree(folder, ignore_errors=True)                 # (a --work folder used before)
    child = run_child(cmd, work / f"{slug(i, s.name)}.log", slot, entry)
    path = folder / "bench.json"
    bench = json.loads(path.read_text()) if path.is_file() else None
    if bench:
        entry.update(warmup_seconds=bench["compile_seconds"], first_load_seconds=bench["first_load_seconds"],
                     runs=[{"seed": r["seed"], "test_acc": r["test_acc"], "test_acc_no_tta": r["test_acc_no_tta"],
                            "seconds": r["times"]["train+eval"], "times": r["times"], "steps": r["steps"],
                            "epochs": r["epochs"], "recompiles": r.get("recompiles")} for r in bench["runs"]],
                     recipe_hash=bench["recipe_hash"], recipe_config=bench["recipe_config"],
                     flops=bench.get("flops"), environment=bench["environment"])
    return settle(entry, child, args.runs, slot, "bench.json incomplete")


def run_peer(i: int, s: System, args, work: Path, data: Path, slot: Slot) -> dict:
    result_path = work / f"{slug(i, s.name)}.json"
    cmd = [sys.executable, str(BENCH / "peer_runner.py"), str(s.path), "--runs", str(args.runs),
           "--result", str(result_path)]
    entry = {"system": s.name, "kind": "peer", "spec": s.spec, "script": str(s.path),
             "script_sha256": hashlib.sha256(s.path.read_bytes()).hexdigest(), "cwd": str(data)}
    result_path.unlink(missing_ok=True)
    child = run_child(cmd, work / f"{slug(i, s.name)}.log", slot, entry, cwd=data)
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    if result:
        entry.update(warmup_seconds=result["warmup_seconds"], warmup_own_seconds=result["warmup_own_seconds"],
                     import_seconds=result["import_seconds"], main_block=result["main_block"],
                     runs=[{k: r[k] for k in ("run", "test_acc", "test_acc_no_tta", "seconds", "timer",
                                              "wall_seconds", "recompiles")} for r in result["runs"]],
                     environment={k: result[k] for k in ("torch_version", "cuda_version", "triton_version",
                                                         "cudnn_version", "gpu_name", "python_version",
                                                         "torch_threads")})
        if "note" in result:
            entry["note"] = result["note"]
    return settle(entry, child, args.runs, slot, "its result is incomplete")


# ------------------------------------------------------------------------------------------
# Real mode
# ------------------------------------------------------------------------------------------

def left_out(record: dict, name: str, slot: Slot) -> None:
    record["left_out"].append({"name": name, "reason": slot.reason})
    print(f"== {name}: not started ({slot.reason})", flush=True)


def real_mode(args, commit, commit_source, started) -> int:
    if not args.system:
        refuse("give at least one --system (" + SYSTEM_FORMS + "), or --synthetic")
    if args.recipe or args.variant or args.profile:
        refuse("--recipe, --variant and --profile belong to --synthetic")
    given = [parse_system(spec, args.sets, args.limit) for spec in args.system]
    names = [s.name for s in given]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        refuse(f"--system: two systems are named {dup!r}; each must appear once")
    systems = run_order(given)
    if systems != given:
        print("== max-autotune warm-ups first: " + ", ".join(s.name for s in systems if s.long_warmup), flush=True)
    pairs = [parse_pair(p, systems) for p in args.pair]
    peers = [s for s in systems if s.kind == "peer"]
    cifar = [s for s in systems if s.kind == "speedrun"
             and load_recipe(s.recipe, [*args.sets, *s.overrides]).data.dataset == "cifar10"]
    batches = check_data(args.data_dir, "the peer scripts and cifar10 recipes") if peers or cifar else None
    out = record_path(args.out, "gpu-record.json")

    work, keep = work_folder(args.work)
    budget = Budget(args.budget, started)
    record = {"benchmark": "speedrun's recipes against peers' own scripts, one after another, each system in its "
                           "own fresh process", "mode": "real", "script": "benchmarks/gpu_record.py",
              "command": command(), "commit": commit, "runs_per_system": args.runs, "device": args.device,
              "sets": args.sets, "data_dir": str(Path(args.data_dir).resolve()) if args.data_dir else None,
              "budget_seconds": args.budget, "limits": {s.name: s.limit for s in systems},
              "order_given": names, "order": [s.name for s in systems],
              "pairs_asked": [f"{a}:{b}" for a, b in pairs], "definitions": DEFINITIONS,
              "environment": machine(commit, commit_source), "gpu_before": gpu_state(), "systems": [],
              "pairs": [], "left_out": []}
    try:
        data = None
        entries = {}
        for i, s in enumerate(systems):
            slot = budget.slot(s.limit)
            if not slot.start:
                left_out(record, s.name, slot)
                atomic_write_json(out, record)
                continue
            limit = f", stopped at {slot.stop_after:.0f} s" if slot.stop_after is not None else ""
            print(f"== {s.kind} {s.name} ({args.runs} runs{limit}) {time.strftime('%H:%M:%S')}", flush=True)
            if s.kind == "peer" and data is None:
                t0 = time.perf_counter()
                data = work / "airbench"
                written = write_cifar10_pt(batches, data)
                record["airbench_data"] = {"from": str(batches.resolve()), "written": written,
                                           "seconds": time.perf_counter() - t0,
                                           "format": "dict: images uint8 N x 32 x 32 x 3 (NHWC), labels int64 N, "
                                                     "classes list of 10 names"}
                slot = budget.slot(s.limit)             # (the writing took some of the budget)
                if not slot.start:
                    left_out(record, s.name, slot)
                    continue
            entry = (run_speedrun(i, s, args, work, slot) if s.kind == "speedrun"
                     else run_peer(i, s, args, work, data, slot))
            entries[s.name] = entry
            record["systems"].append(entry)
            record["pairs"] = pair_figures(pairs, entries)
            record["gpu_after"] = entry["gpu_after"]
            record["total_seconds"] = time.perf_counter() - started
            atomic_write_json(out, record)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    record["total_seconds"] = time.perf_counter() - started
    atomic_write_json(out, record)
    print_table(record["systems"], f"{len(record['systems'])} systems, {args.runs} runs each (record: {out})")
    for p in record["pairs"]:
        print(f"{p['a']} / {p['b']}: time {p['time_ratio']:.3f} (median {p['time_ratio_median']:.3f}; "
              f"{p['seconds_a']:.3f} s / {p['seconds_b']:.3f} s), accuracy {p['test_acc_a']:.2%} vs "
              f"{p['test_acc_b']:.2%}")
    for left in record["left_out"]:
        print(f"not started: {left['name']} ({left['reason']})")
    return 0 if all(e["ok"] for e in record["systems"]) and not record["left_out"] else 1


# ------------------------------------------------------------------------------------------
# Synthetic mode
# ------------------------------------------------------------------------------------------

def parse_variant(given: str, default_limit: float | None) -> tuple[str, list[str], float | None]:
    spec, limit = with_limit(given, default_limit, "--variant")
    name, _, tail = spec.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", name or ""):
        refuse(f"--variant {spec!r}: expected NAME or NAME:KEY=VALUE@KEY=VALUE (a name of letters, digits, '.', "
               "'_', '+', '-')")
    return name, parse_overrides(tail, f"--variant {spec}"), limit


SYNTHETIC_SETS = ["eval.every=0", "data.dataset=npz"]


def write_synthetic(path: Path, n_train: int, n_test: int) -> None:
    import numpy as np
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 256, (n_train, 3, 32, 32), dtype=np.uint8),
             y_train=rng.integers(0, 10, n_train, dtype=np.int64),
             x_test=rng.integers(0, 256, (n_test, 3, 32, 32), dtype=np.uint8),
             y_test=rng.integers(0, 10, n_test, dtype=np.int64), classes=np.array(CIFAR_CLASSES))


def synthetic_mode(args, commit, commit_source, started) -> int:
    if args.system or args.pair:
        refuse("--system and --pair belong to the real mode (without --synthetic)")
    if not args.recipe:
        refuse("--synthetic needs --recipe RECIPE")
    if args.n_train < 1 or args.n_test < 1:
        refuse("--n-train and --n-test must be at least 1")
    variants = [parse_variant(v, args.limit) for v in (args.variant or ["base"])]
    names = [n for n, _, _ in variants]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        refuse(f"--variant: two variants are named {dup!r}")
    for name, over, _ in variants:
        try:
            recipe = load_recipe(args.recipe, [*SYNTHETIC_SETS, *args.sets, *over])
        except SpeedrunError as err:
            refuse(f"--variant {name}: {err}")
        if recipe.data.batch_size and recipe.data.batch_size > args.n_train:
            refuse(f"--variant {name}: data.batch_size={recipe.data.batch_size} is larger than --n-train "
                   f"{args.n_train}")
    out = record_path(args.out, "gpu-record-synthetic.json")

    work, keep = work_folder(args.work)
    budget = Budget(args.budget, started)
    record = {"benchmark": "variants of a recipe on random CIFAR-shaped data, each in its own fresh process",
              "mode": "synthetic", "script": "benchmarks/gpu_record.py", "command": command(), "commit": commit,
              "recipe": args.recipe, "runs_per_variant": args.runs, "device": args.device, "sets": args.sets,
              "data": {"images": "random uint8, 3 x 32 x 32", "classes": 10, "labels": "random",
                       "n_train": args.n_train, "n_test": args.n_test,
                       "note": "accuracies on random labels mean nothing; only the times do"},
              "profile": args.profile, "order": names, "budget_seconds": args.budget,
              "limits": {name: limit for name, _, limit in variants}, "definitions": DEFINITIONS,
              "environment": machine(commit, commit_source), "gpu_before": gpu_state(), "variants": [],
              "ratios": {}, "left_out": []}
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-record-data-") as tmp:
            npz = Path(tmp) / "synthetic-cifar.npz"
            t0 = time.perf_counter()
            write_synthetic(npz, args.n_train, args.n_test)
            record["data"]["write_seconds"] = time.perf_counter() - t0
            for i, (name, over, limit) in enumerate(variants):
                slot = budget.slot(limit)
                if not slot.start:
                    left_out(record, name, slot)
                    continue
                stop = f", stopped at {slot.stop_after:.0f} s" if slot.stop_after is not None else ""
                print(f"== variant {name} ({args.runs} runs{', profiled' if args.profile else ''}{stop}) "
                      f"{time.strftime('%H:%M:%S')}", flush=True)
                result_path = work / f"{slug(i, name)}.json"
                sets = [*args.sets, *over]
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child-variant", name, "--recipe", args.recipe,
                       "--npz", str(npz), "--runs", str(args.runs), "--result", str(result_path),
                       *(["--profile"] if args.profile else []), *(["--device", args.device] if args.device else []),
                       *[a for o in sets for a in ("--set", o)]]
                result_path.unlink(missing_ok=True)
                entry = {"variant": name, "kind": "variant", "overrides": over}
                child = run_child(cmd, work / f"{slug(i, name)}.log", slot, entry)
                if result_path.is_file():
                    entry.update(json.loads(result_path.read_text()))
                settle(entry, child, args.runs, slot, "its result is incomplete")
                if entry["ok"] and args.profile and "profile" not in entry:
                    entry.update(ok=False, error="its profile is missing", output_tail=child.tail)
                record["variants"].append(entry)
                first = record["variants"][0]["summary"]
                record["ratios"] = {v["variant"]: v["summary"]["seconds"]["mean"] / first["seconds"]["mean"]
                                    for v in record["variants"] if v["summary"]["runs"] and first["runs"]}
                record["gpu_after"] = entry["gpu_after"]
                record["total_seconds"] = time.perf_counter() - started
                atomic_write_json(out, record)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    record["total_seconds"] = time.perf_counter() - started
    atomic_write_json(out, record)
    print_table(record["variants"], f"{args.recipe}: {len(record['variants'])} variants on random data, "
                                    f"{args.runs} runs each (record: {out})")
    for name, ratio in record["ratios"].items():
        print(f"{name} / {names[0]}: time {ratio:.3f}")
    for v in record["variants"]:
        prof = v.get("profile")
        if prof:
            kinds = ", ".join(f"{k} {d['seconds'] / prof['total_seconds']:.0%}" for k, d in prof["by_kind"].items()
                              if d["seconds"] and prof["total_seconds"])
            print(f"profile {v['variant']}: {prof['total_seconds']:.3f} s of {prof['unit']} time in a "
                  f"{prof['run_seconds']:.3f} s run, {prof['per_step']} per step: {kinds}")
    for left in record["left_out"]:
        print(f"not started: {left['name']} ({left['reason']})")
    return 0 if all(v["ok"] for v in record["variants"]) and not record["left_out"] else 1


# ---- the child: one variant in its own process -----------------------------------------

STEP_MARK = "gpu_record.step_end"


class StepMarks:
    """The loop's progress protocol: an empty profiler range after every training step, so
    that a profile can tell the training steps' events from the rest of the run."""

    def start(self, total_steps, epochs, batch_size, eval_images=0):
        pass

    def step(self):
        from torch.profiler import record_function
        with record_function(STEP_MARK):
            pass

    def epoch(self, record):
        pass

    def final_evaluation(self, images, tta):
        pass

    def final_evaluation_done(self, seconds):
        pass


KINDS = ("convolution", "matmul", "fused", "batch norm", "copy/fill", "optimizer", "reduction", "elementwise",
         "other")
ELEMENTWISE = {"add", "sub", "rsub", "mul", "div", "neg", "exp", "log", "sqrt", "rsqrt", "pow", "clamp", "lerp",
               "addcmul", "addcdiv", "sigmoid", "tanh", "relu", "gelu", "silu", "threshold", "where", "abs",
               "sign", "eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum", "flip", "reciprocal",
               "masked_fill", "log_softmax", "softmax", "hardtanh"}
COPIES = {"copy", "fill", "zero", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "to", "_to_copy",
          "clone", "cat", "stack", "contiguous", "constant_pad_nd", "reflection_pad2d", "index", "index_select",
          "gather", "scatter"}
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "norm", "linalg_vector_norm",
              "var", "var_mean", "std", "any", "all", "prod", "cumsum", "topk", "sort", "nll_loss",
              "cross_entropy_loss"}


def kind_of(name: str, cuda: bool) -> str:
    """The kind of a CUDA kernel (``cuda``) or of a CPU op, from its name."""
    n = name.lower()
    if cuda:
        if "triton_tem" in n:                       # inductor's templates: autotuned conv / matmul kernels
            return "convolution" if "conv" in n else "matmul"
        if "triton_" in n:
            return "fused"
        if any(s in n for s in ("bn_fw", "bn_bw", "batch_norm", "batchnorm")):
            return "batch norm"
        if any(s in n for s in ("conv", "cudnn", "implicit_gemm", "wgrad", "dgrad", "fprop", "winograd")):
            return "convolution"
        if any(s in n for s in ("gemm", "nvjet", "cublas", "matmul")):
            return "matmul"
        if any(s in n for s in ("xmma", "cutlass")):
            return "convolution"
        if any(s in n for s in ("multi_tensor", "foreach")):
            return "optimizer"
        if any(s in n for s in ("memcpy", "memset", "copy", "fill", "cat_", "catarray")):
            return "copy/fill"
        if "reduce" in n or "reduction" in n:
            return "reduction"
        if any(s in n for s in ("elementwise", "vectorized", "unrolled")):
            return "elementwise"
        return "other"
    if any(s in n for s in ("compiledfxgraph", "torch-compiled region", "compiledfunction", "cpp_fused",
                            "inductor", "## call")):
        return "fused"
    if n.startswith("optimizer.") or "_foreach_" in n or "fused_sgd" in n or "fused_adam" in n:
        return "optimizer"
    if "conv" in n:
        return "convolution"
    if any(s in n for s in ("addmm", "aten::mm", "bmm", "matmul", "aten::linear", "mmbackward", "aten::addmv")):
        return "matmul"
    if "batch_norm" in n or "batchnorm" in n:
        return "batch norm"
    base = n.removeprefix("aten::").rstrip("_")
    base = base.removesuffix("_backward").removesuffix("_out")
    if base in COPIES or n.startswith("memcpy") or n.startswith("memset"):
        return "copy/fill"
    if base in REDUCTIONS:
        return "reduction"
    if base in ELEMENTWISE:
        return "elementwise"
    return "other"


def breakdown(events, cuda: bool, steps: int, run_seconds: float, wall_seconds: float) -> dict:
    """Kernel (CUDA) or op (CPU) time of one profiled run by kind; its total against the run's
    seconds; kernels per training step (between the first and the last step mark)."""
    from torch.autograd import DeviceType
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    marks = sorted(e.time_range.start for e in cpu if e.name == STEP_MARK)
    annotations = {e.name for e in cpu if getattr(e, "is_user_annotation", False)}
    if cuda:
        items = [(e.name, e.time_range.start, e.time_range.elapsed_us(), True) for e in events
                 if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                 and e.name not in annotations and e.name != STEP_MARK]
    else:                                           # own time: nested ops count once
        items = [(e.name, e.time_range.start, e.self_cpu_time_total, not e.cpu_children) for e in cpu
                 if e.name != STEP_MARK and not e.is_async]
    by_kind = {k: {"count": 0, "seconds": 0.0} for k in KINDS}
    by_name: dict[str, list] = {}
    total_us = 0.0
    for name, _, us, _ in items:
        k = kind_of(name, cuda)
        by_kind[k]["count"] += 1
        by_kind[k]["seconds"] += us / 1e6
        total_us += us
        d = by_name.setdefault(name, [k, 0, 0.0])
        d[1] += 1
        d[2] += us / 1e6
    counted = [start for _, start, _, leaf in items if leaf]
    window = [s for s in counted if marks and marks[0] <= s <= marks[-1]]
    per_step = len(window) / (len(marks) - 1) if len(marks) >= 2 else None
    top = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:30]
    total = total_us / 1e6
    return {"unit": "CUDA kernel" if cuda else "CPU op (self)", "per_step": "kernels" if cuda else "leaf ops",
            "total_seconds": total, "run_seconds": run_seconds, "wall_seconds": wall_seconds,
            "share_of_run": total / run_seconds if run_seconds else None,
            "events": len(items), "steps": steps, "steps_marked": len(marks),
            "kernels_per_step": per_step, "kernels_per_step_whole_run": len(counted) / steps if steps else None,
            "by_kind": by_kind,
            "top": [{"name": n[:200], "kind": k, "count": c, "seconds": s} for n, (k, c, s) in top]}


def child_variant(args) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from speedrun.data.pipeline.dataset import open_source
    from speedrun.engine.loop import Session
    from speedrun.engine.plan import plan_run
    from speedrun.engine.runtime import pick_device

    t_start = time.perf_counter()
    recipe = load_recipe(args.recipe, [*SYNTHETIC_SETS, *args.sets])
    plan = plan_run(recipe, args.npz, pick_device(args.device))
    recipe, source, runtime = plan.recipe, plan.source, plan.runtime
    t0 = time.perf_counter()
    session = Session(recipe, source, runtime, warm_up=True)
    rt = session.runtime
    out = {"recipe": recipe.name, "recipe_hash": recipe.digest(), "recipe_config": recipe.to_dict(),
           "warmup_seconds": session.compile_seconds, "build_and_warmup_seconds": time.perf_counter() - t0,
           "seconds_before_first_run": time.perf_counter() - t_start, "runtime": rt.describe(),
           "torch_threads": torch.get_num_threads(), "runs": []}
    seed0 = recipe.train.seed
    for i in range(args.runs):
        seed = seed0 + i
        rt.synchronize()
        session.reset(seed)
        session.source = open_source(recipe, args.npz)[1]
        r = session.run(seed)
        out["runs"].append({"seed": seed, "seconds": r.train_seconds, "final_eval_seconds": r.final_eval_seconds,
                            "test_acc": r.test_acc, "test_acc_no_tta": r.test_acc_no_tta, "steps": r.steps,
                            "recompiles": r.recompiles})
        print(f"run {i + 1}/{args.runs}: train+eval {r.train_seconds:.3f} s, {r.steps} steps", flush=True)
        atomic_write_json(args.result, out)
    if args.profile:
        seed = seed0 + args.runs
        session.reset(seed)
        session.source = open_source(recipe, args.npz)[1]
        cuda = rt.device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        rt.synchronize()
        with profile(activities=acts) as prof:
            t = time.perf_counter()
            r = session.run(seed, progress=StepMarks())
            rt.synchronize()
            wall = time.perf_counter() - t
        out["profile"] = breakdown(prof.events(), cuda, r.steps, r.train_seconds, wall)
        p = out["profile"]
        print(f"profiled run: {p['total_seconds']:.3f} s of {p['unit']} time, run {r.train_seconds:.3f} s, "
              f"{p['kernels_per_step']} {p['per_step']} per step", flush=True)
    atomic_write_json(args.result, out)
    return 0


# ------------------------------------------------------------------------------------------

def command() -> str:
    return " ".join(["benchmarks/gpu_record.py", *sys.argv[1:]])


def record_path(given: Path | None, name: str) -> Path:
    """Where the record goes: ``--out``, else ``$OUT/NAME`` where $OUT is set (a lent GPU machine
    returns only $OUT's files); a record outside a set $OUT is written where asked, with a warning."""
    home = os.environ.get("OUT")
    if given is None:
        if not home:
            refuse("--out FILE.json is required (or set $OUT: the record is then written to $OUT/" + name + ")")
        given = Path(home) / name
    try:
        check_output_file(given, "--out", overwrite=True)
    except SpeedrunError as err:
        refuse(str(err))
    if home and not given.resolve().is_relative_to(Path(home).resolve()):
        print(f"gpu_record: warning: --out {given} is outside $OUT ({home}): a lent GPU machine returns only "
              "$OUT's files", file=sys.stderr, flush=True)
    return given


def work_folder(given: Path | None) -> tuple[Path, bool]:
    if given is None:
        return Path(tempfile.mkdtemp(prefix="gpu-record-")), False
    given.mkdir(parents=True, exist_ok=True)
    return given.resolve(), True


class Parser(argparse.ArgumentParser):
    """Arguments from ``@FILE`` too: one or more per line, as a shell splits them (quotes
    kept together); lines starting with ``#`` are comments."""

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        line = arg_line.strip()
        return [] if not line or line.startswith("#") else shlex.split(line)


def parse(argv=None):
    p = Parser(description=__doc__.splitlines()[0], fromfile_prefix_chars="@")
    p.add_argument("--synthetic", action="store_true", help="time variants of --recipe on random CIFAR-shaped data")
    p.add_argument("--system", action="append", default=[], metavar="SPEC", help=SYSTEM_FORMS + " (repeatable)")
    p.add_argument("--pair", action="append", default=[], metavar="A:B", help="A's mean time over B's (repeatable)")
    p.add_argument("--recipe", help="--synthetic: the recipe whose variants are timed")
    p.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE@...]",
                   help="--synthetic: a variant (repeatable; default: base)")
    p.add_argument("--runs", type=int, default=10, help="timed runs per system or variant, after its warm-up")
    p.add_argument("--profile", action="store_true", help="--synthetic: one more run per variant under the profiler")
    p.add_argument("--n-train", type=int, default=50000, help="--synthetic: training images")
    p.add_argument("--n-test", type=int, default=10000, help="--synthetic: test images")
    p.add_argument("--data-dir", help="the folder holding cifar-10-batches-py/ (real mode)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="speedrun's device (default: cuda when available)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every speedrun system or variant (before its own)")
    p.add_argument("--commit", help="the commit the record names (default: $SPEEDRUN_COMMIT, else git rev-parse HEAD)")
    p.add_argument("--out", type=Path, help="the JSON record (default: $OUT/gpu-record.json, or "
                                            "$OUT/gpu-record-synthetic.json, where $OUT is set)")
    p.add_argument("--work", type=Path, help="keep the work folder here (logs, bench folders, cifar10/*.pt); "
                                            "default: a temporary folder, deleted at the end")
    p.add_argument("--budget", type=float, help="the call's seconds: a system or variant starts only if its limit "
                                                "fits in what is left; one without a limit is stopped at the end")
    p.add_argument("--limit", type=float, help="each system's or variant's time limit in seconds (its whole "
                                               "process, stopped there with what finished kept); SPEC#SECONDS "
                                               "gives one its own")
    p.add_argument("--child-variant", help=argparse.SUPPRESS)
    p.add_argument("--npz", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    started = time.perf_counter()
    args = parse(argv)
    if args.child_variant:
        return child_variant(args)
    commit, commit_source = read_commit(args.commit)         # (the commit that runs, read before it runs)
    if args.runs < 1:
        refuse("--runs must be at least 1")
    if (args.limit is not None and args.limit <= 0) or (args.budget is not None and args.budget <= 0):
        refuse("--limit and --budget are seconds above 0")
    if args.synthetic:
        return synthetic_mode(args, commit, commit_source, started)
    return real_mode(args, commit, commit_source, started)


if __name__ == "__main__":
    sys.exit(main())
