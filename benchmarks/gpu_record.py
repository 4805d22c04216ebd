"""speedrun's CIFAR-10 recipes against peers' own scripts, or variants of a recipe (and peers' warm-ups)
on random CIFAR-shaped data, each in its own fresh process: its warm-up, then N timed runs, in one JSON
record whose ``definitions`` say what each figure holds. Usage and options: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

from peer_runner import PeerError, check_script  # noqa: E402
from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.files import atomic_torch_save, atomic_write_json, check_output_file  # noqa: E402
from speedrun.recipe import load_recipe  # noqa: E402

DEFINITIONS = {
    "speedrun.seconds": "speedrun bench's train+eval: from the first touch of the data already on the device (as the "
                        "peers') to the final TTA accuracy, synchronised, monitoring evaluations paused out",
    "speedrun.warmup_seconds": "speedrun bench's compile_seconds: compiling and running every shape once",
    "peer.seconds": "the peer script's own timer (airbench: time_seconds / total_time_seconds: whitening, training "
                    "epochs and the final TTA evaluation; not its per-epoch evaluations, not data loading)",
    "peer.wall_seconds": "the whole main(run, ...) call, synchronised: data loading, evaluations and printing included",
    "peer.warmup_seconds": "the __main__ block's set-up (models built and compiled as it does) and main('warmup', ...)",
    "process_wall_seconds": "the whole subprocess, from before its interpreter starts to its exit",
    "runs.recompiles": "graphs dynamo compiled during the timed run; 0 when the warm-up compiled everything",
    "cut": "stopped at limit_seconds (limit_from: its own limit or --budget); summarised over the runs it finished",
    "shortened": "started with what was left of --budget (given_seconds) rather than its own limit (limit_seconds), "
                 "since that was at least the least it may start with (least_seconds: its warm-up and a few runs)",
    "compile_cache": "the folder every process kept inductor's and Triton's caches in (--cache-dir, the same in both "
                     "calls of a lending): its files before and after the process (with --jobs, files the processes "
                     "beside it wrote count too)",
    "inductor_cache": "inductor's own counters in the process (peers: after the warm-up and after the runs; variants: "
                      "the warm-up's): FX-graph cache hits found compiled by an earlier process, misses compiled anew",
    "jobs": "--synthetic --jobs K: up to K processes side by side (compiling is CPU work), so their times are not "
            "comparable; such a call warms caches",
    "pairs.time_ratio": "mean seconds of A over mean seconds of B (each system's own timed region)",
    "synthetic.seconds": "as speedrun.seconds, on the random data; build_and_warmup_seconds adds building the model",
    "synthetic.profile": "one more run under torch.profiler (slowed by it): kernel (CPU: op self) time by kind, "
                         "kernels (CPU: leaf ops) per step between step marks",
}
SYSTEM_FORMS = "speedrun:RECIPE[@KEY=VALUE...][#SECONDS[/LEAST]] or peer:PATH/TO/SCRIPT.py[#SECONDS[/LEAST]]"
SYNTHETIC_SETS = ["eval.every=0", "data.dataset=npz"]
CIFAR_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
KILL_GRACE_SECONDS = 5.0
"""From a system's stop time until its process group is gone: SIGTERM, up to 3 s, SIGKILL, reaped."""
WRITE_SECONDS = 5.0
"""After the budget: the last entry's clocks (nvidia-smi), the record written, the table printed."""


def refuse(message: str):
    """One line on stderr, exit code 2, nothing written."""
    print(f"gpu_record: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


# ---- what runs: systems, variants, pairs ---------------------------------------------------

@dataclass
class System:
    """A speedrun recipe, a peer's script, or (--synthetic) a variant of --recipe."""
    kind: str                       # "speedrun", "peer" or "variant"
    name: str                       # how the record, the table and --pair name it
    spec: str                       # as given, without its limit
    limit: float | None             # seconds its process may run (None: no limit)
    least: float | None = None      # the fewest seconds it may be started with (None: half its limit)
    overrides: list[str] = field(default_factory=list)
    recipe: str | None = None
    long_warmup: bool = False       # compiles with max-autotune: run first
    dataset: str | None = None
    path: Path | None = None

    def least_seconds(self) -> float:
        """The fewest seconds worth starting it with when its limit no longer fits: SPEC#LIMIT/LEAST,
        else half its limit (each lending's limits are about 1.5 times what the system took before)."""
        return self.least if self.least is not None else (self.limit or 0.0) / 2


def split_limit(spec: str, default: float | None, where: str) -> tuple[str, float | None, float | None]:
    """The spec without its ``#SECONDS[/LEAST]`` suffix, its limit (else ``default``) and the least
    seconds it may be started with (None where not given)."""
    body, mark, tail = spec.rpartition("#")
    if not mark:
        return spec, default, None
    number = r"([0-9]+(?:\.[0-9]*)?)"
    m = re.fullmatch(number + "(?:/" + number + ")?", tail)
    if not m or float(m[1]) <= 0 or (m[2] is not None and float(m[2]) > float(m[1])):
        refuse(f"{where} {spec!r}: a time limit is written SPEC#SECONDS with SECONDS above 0, or SPEC#SECONDS/LEAST "
               f"with LEAST, the fewest seconds it may be started with, at most SECONDS (e.g. {body}#60/30)")
    return body, float(m[1]), None if m[2] is None else float(m[2])


def own_limit(given: str, args, where: str) -> tuple[str, float | None, float | None]:
    """split_limit of a system's or variant's spec, its own SECONDS and LEAST times --time-scale (--limit,
    the default, is scaled already)."""
    spec, limit, least = split_limit(given, None, where)
    k = args.time_scale
    return spec, args.limit if limit is None else limit * k, None if least is None else least * k


def settle(recipe: str, text: str, sets: list[str], where: str):
    """The overrides written KEY=VALUE@KEY=VALUE..., and the recipe they settle after ``sets``."""
    over = text.split("@") if text else []
    bad = next((o for o in over if "=" not in o or not o.split("=", 1)[0].strip()), None)
    if bad is not None:
        refuse(f"{where}: {bad!r} is not KEY=VALUE")
    try:
        return over, load_recipe(recipe, [*sets, *over])
    except SpeedrunError as err:
        refuse(f"{where}: {err}")


def parse_system(given: str, args) -> System:
    spec, limit, least = own_limit(given, args, "--system")
    kind, _, rest = spec.partition(":")
    if kind not in ("speedrun", "peer") or not rest:
        refuse(f"--system {spec!r}: expected {SYSTEM_FORMS}")
    if kind == "speedrun" and args.synthetic:
        refuse(f"--system {spec}: with --synthetic, speedrun's recipes are --variant NAME[:KEY=VALUE@...] of --recipe; "
               "only peers are --system")
    if kind == "peer":
        path = Path(rest).expanduser()
        if not path.is_file():
            refuse(f"--system {spec}: no peer script at {path}" + (" (a folder)" if path.is_dir() else ""))
        try:
            plan = check_script(path)
        except PeerError as err:
            refuse(f"--system {spec}: {err}")
        return System("peer", path.name, spec, limit, least, path=path.resolve(),
                      long_warmup=any("max-autotune" in line for line in plan["setup_source"]))
    recipe, _, tail = rest.partition("@")
    if not recipe:
        refuse(f"--system {spec!r}: no recipe before '@'; expected {SYSTEM_FORMS}")
    over, settled = settle(recipe, tail, args.sets, f"--system {spec}")
    return System("speedrun", rest, spec, limit, least, over, recipe, dataset=settled.data.dataset,
                  long_warmup=str(settled.runtime.compile_mode).startswith("max-autotune"))


def parse_variant(given: str, args) -> System:
    spec, limit, least = own_limit(given, args, "--variant")
    name, _, tail = spec.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9._+-]+", name):
        refuse(f"--variant {spec!r}: expected NAME[:KEY=VALUE@...], the NAME of letters, digits and . _ + -")
    over, settled = settle(args.recipe, tail, [*SYNTHETIC_SETS, *args.sets], f"--variant {name}")
    if (settled.data.batch_size or 0) > args.n_train:
        refuse(f"--variant {name}: data.batch_size={settled.data.batch_size} is larger than --n-train {args.n_train}")
    return System("variant", name, spec, limit, least, over, args.recipe)


def parse_pair(spec: str, systems: list[System]) -> tuple[str, str]:
    """A:B, each a system's name (or a peer's path as given), split at the ':' between two names."""
    names = {alias: s.name for s in systems for alias in (s.name, s.spec.partition(":")[2])}
    for at in [i for i, c in enumerate(spec) if c == ":"]:
        a, b = spec[:at], spec[at + 1:]
        if a in names and b in names and names[a] != names[b]:
            return names[a], names[b]
    refuse(f"--pair {spec!r}: expected A:B naming two of the systems ({', '.join(s.name for s in systems)})")


# ---- children: each in its own process group, stopped at its limit within the budget -------

def slot(args, s: System) -> tuple[float | None, str | None, dict | None] | str:
    """(seconds after which the child is stopped, by what, how it was shortened), or why it may not
    start. With --budget, a limit that fits in what is left stands; one that does not is cut to what
    is left where that is at least the least the system may start with (the record says so), else
    the system is left out. Without a limit, a child starts while any budget is left."""
    if args.budget is None:
        return s.limit, "its limit" if s.limit else None, None
    left = args.budget - (time.perf_counter() - args.started)
    if s.limit is None:
        return (left, "the budget", None) if left > 0 else f"--budget {args.budget:.0f} s is spent"
    if s.limit <= left:
        return s.limit, "its limit", None
    least = s.least_seconds()
    if left > 0 and left >= least:
        return left, "the budget", {"limit_seconds": s.limit, "given_seconds": left, "least_seconds": least}
    return (f"its limit of {s.limit:.0f} s is more than the {max(left, 0):.0f} s left of --budget {args.budget:.0f}, "
            f"under the {least:.0f} s it may least start with")


def stop_groups(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each child's process group (compile workers included), SIGKILL to those whose
    leader is still there 3 s later (all stopped together: --jobs stops several at the budget's end)."""
    live = []
    for proc in procs:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
            live.append(proc)
    end = time.perf_counter() + 3
    for proc in live:
        try:
            proc.wait(timeout=max(end - time.perf_counter(), 0.01))
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def count_files(folder: Path | None) -> int | None:
    return None if folder is None else sum(len(files) for _, _, files in os.walk(folder))


def child_env(args) -> dict:
    """The children's environment: speedrun's source first on the path, output unbuffered, and with
    --cache-dir every process's inductor and Triton caches in that one folder."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    if args.cache_dir is not None:
        env.update(TORCHINDUCTOR_CACHE_DIR=str(args.cache_dir), TRITON_CACHE_DIR=str(args.cache_dir / "triton"))
    return env


def from_bench(bench: dict) -> dict:
    """A ``speedrun bench`` record as an entry: each run's train+eval its seconds, compiling its warm-up
    (and inductor's cache hits and misses in the warm-up, where the bench record holds them)."""
    runs = [{"seconds": r["times"]["train+eval"], **{k: r.get(k) for k in (
        "seed", "test_acc", "test_acc_no_tta", "times", "steps", "epochs", "recompiles")}} for r in bench["runs"]]
    return {"warmup_seconds": bench["compile_seconds"], "runs": runs, **{k: bench.get(k) for k in (
        "first_load_seconds", "recipe_hash", "recipe_config", "flops", "environment")},
        **({"inductor_cache": bench["compile_cache"]} if isinstance(bench.get("compile_cache"), dict) else {})}


@dataclass
class Child:
    """A system's process while it runs: its entry so far, where its result is read from, when it stops."""
    index: int
    system: System
    entry: dict
    result: Path
    read: object                    # the result file's JSON -> the entry's fields
    log: Path
    stop_after: float | None
    stopped_by: str | None
    proc: subprocess.Popen | None = None
    started: float = 0.0
    cut: bool = False

    def deadline(self) -> float | None:
        return None if self.stop_after is None else self.started + self.stop_after


def start_system(args, index: int, s: System, limit: tuple) -> Child:
    """One system or variant started in its own process group (in the call's session, so that a call
    killed at its timeout takes it along), its output in the work folder's ``NN-NAME.log``."""
    stop_after, stopped_by, shortened = limit
    work, sets = args.work_dir, [*args.sets, *s.overrides]
    base = f"{index:02d}-" + re.sub(r"[^A-Za-z0-9._-]+", "_", s.name).strip("_")[:80]
    result, cwd, read = work / f"{base}.json", None, dict
    options = [a for o in sets for a in ("--set", o)] + (["--device", args.device] if args.device else [])
    if s.kind == "speedrun":
        entry = {"system": s.name, "kind": "speedrun", "spec": s.spec, "recipe": s.recipe, "overrides": sets}
        shutil.rmtree(work / base, ignore_errors=True)         # (a --work folder used before)
        result, read = work / base / "bench.json", from_bench
        cmd = ["-m", "speedrun", "bench", s.recipe, "--runs", str(args.runs), "--out", str(work / base), *options,
               *(["--data-dir", str(Path(args.data_dir).resolve())] if args.data_dir else [])]
    elif s.kind == "peer":
        cwd = work / "airbench"
        entry = {"system": s.name, "kind": "peer", "spec": s.spec,
                 "script_sha256": hashlib.sha256(s.path.read_bytes()).hexdigest()}
        cmd = [str(ROOT / "benchmarks" / "peer_runner.py"), str(s.path), "--runs", str(args.runs), "--result",
               str(result)]
    else:
        entry = {"variant": s.name, "kind": "variant", "overrides": s.overrides}
        cmd = [str(Path(__file__).resolve()), "--child-variant", str(result), "--recipe", s.recipe, "--runs",
               str(args.runs), *options, *(["--profile"] if args.profile else [])]
    entry.update(command=" ".join(["python", *cmd]), limit_seconds=stop_after, limit_from=stopped_by)
    if shortened:
        entry["shortened"] = shortened
    if args.cache_dir is not None:
        entry["compile_cache"] = {"dir": str(args.cache_dir), "files_before": count_files(args.cache_dir)}
    result.unlink(missing_ok=True)
    child = Child(index, s, entry, result, read, work / f"{base}.log", stop_after, stopped_by)
    behind = args.jobs > 1 and not s.long_warmup          # (side by side, the long warm-ups keep the CPU first)
    with open(child.log, "w") as out:
        child.started = time.perf_counter()
        child.proc = subprocess.Popen([sys.executable, *cmd], stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                      process_group=0, env=child_env(args),
                                      preexec_fn=(lambda: os.nice(10)) if behind else None)
    return child


def wait_any(running: list[Child]) -> list[tuple[Child, int]]:
    """Until some children end or reach their stop time (those are stopped, marked cut): (child, exit code)."""
    while True:
        now = time.perf_counter()
        ended = [c for c in running if c.proc.poll() is not None]
        late = [c for c in running if c not in ended and c.deadline() is not None and now >= c.deadline()]
        if late:
            stop_groups([c.proc for c in late])
            for c in late:
                c.cut = True
        if ended or late:
            return [(c, c.proc.wait()) for c in ended + late]
        soonest = min((c.deadline() for c in running if c.deadline() is not None), default=now + 0.2)
        time.sleep(min(0.2, max(soonest - now, 0.01)))


def end_system(args, c: Child, rc: int) -> dict:
    """The entry of a child that ended or was stopped: as the child wrote it, marked cut where it was
    stopped, its finished runs kept; its last lines printed."""
    from speedrun.report.environment import gpu_clocks
    entry, s = c.entry, c.system
    entry["process_wall_seconds"] = time.perf_counter() - c.started
    tail = c.log.read_text(errors="replace").splitlines()[-40:]
    tail += [f"stopped at {c.stop_after:.0f} s (its process group killed)"] if c.cut else []
    if args.jobs > 1:
        print(f"-- {s.kind} {s.name}: {'stopped' if c.cut else f'exit code {rc}'} after "
              f"{entry['process_wall_seconds']:.0f} s {time.strftime('%H:%M:%S')}", flush=True)
    print("\n".join("    " + line for line in tail), flush=True)
    if c.result.is_file():
        entry.update(c.read(json.loads(c.result.read_text())))
    done = len(entry.get("runs", []))
    if c.cut:
        entry["cut"] = {"by": c.stopped_by, "at_seconds": c.stop_after, "runs_finished": done, "runs_asked": args.runs}
    entry["ok"] = rc == 0 and not c.cut and done == args.runs and (s.kind != "variant" or not args.profile
                                                                   or "profile" in entry)
    if not entry["ok"]:
        why = (f"stopped by {c.stopped_by} ({c.stop_after:.0f} s) after {done} of {args.runs} runs" if c.cut
               else f"exit code {rc}" if rc else "its runs or its profile are incomplete")
        entry.update(error=why, output_tail="\n".join(tail))
    if "compile_cache" in entry:
        entry["compile_cache"]["files_after"] = count_files(args.cache_dir)
    entry.update(summary=summarize(entry.get("runs", [])), gpu_after=gpu_clocks())
    return entry


def list_of(args, s: System) -> str:
    """The record's list a system's entry goes to: peers warmed beside --synthetic's variants have their own."""
    return ("peers" if s.kind == "peer" else "variants") if args.synthetic else "systems"


def run_each(args, record: dict, systems: list[System]) -> None:
    """Each system in turn (with --jobs K, up to K at once), started only if the budget left allows
    (else listed in ``left_out``); the record is written after each, so a call cut short keeps what
    finished. Entries keep the order of ``systems`` whatever order they end in."""
    pending, running, done = list(enumerate(systems)), [], {}
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                i, s = pending.pop(0)
                limit = slot(args, s)
                if isinstance(limit, str):
                    record["left_out"].append({"name": s.name, "reason": limit})
                    print(f"== {s.name}: not started ({limit})", flush=True)
                    continue
                stop = "" if limit[0] is None else f", stopped at {limit[0]:.0f} s"
                if limit[2]:
                    stop += f": shortened from its limit of {s.limit:.0f} s to what is left of --budget"
                print(f"== {s.kind} {s.name} ({args.runs} runs{stop}) {time.strftime('%H:%M:%S')}", flush=True)
                running.append(start_system(args, i, s, limit))
            if running:
                for child, rc in wait_any(running):
                    running.remove(child)
                    done[child.index] = (child.system, end_system(args, child, rc))
            for key in {list_of(args, s) for s in systems}:
                record[key] = [e for i, (s, e) in sorted(done.items()) if list_of(args, s) == key]
            if args.synthetic and record["variants"]:            # (each variant's mean time over the first's)
                first = record["variants"][0]["summary"]
                record["ratios"] = {v["variant"]: v["summary"]["seconds"]["mean"] / first["seconds"]["mean"]
                                    for v in record["variants"] if v["summary"]["runs"] and first["runs"]}
            elif not args.synthetic:
                record["pairs"] = pair_figures(args.pairs, {e["system"]: e for e in record["systems"]})
            record["total_seconds"] = time.perf_counter() - args.started
            atomic_write_json(args.out, record)
    finally:                                          # (interrupted: the running groups go with us)
        stop_groups([c.proc for c in running])


# ---- figures -------------------------------------------------------------------------------

def summarize(runs: list[dict]) -> dict:
    """Mean, sd, 95% interval, median, min and max of the seconds and accuracy; the runs' recompiles."""
    from speedrun.bench.stats import describe, describe_times      # (scipy: once something ran)
    out = {"runs": len(runs)}
    for key, stats in (("seconds", describe_times), ("test_acc", describe)):
        values = [r[key] for r in runs]
        out[key] = stats(values)
        if values:
            out[key].update(median=statistics.median(values), min=min(values), max=max(values))
    counts = [r.get("recompiles") for r in runs]
    out["recompiles"] = sum(counts) if counts and None not in counts else None
    return out


def pair_figures(pairs: list[tuple[str, str]], entries: dict) -> list[dict]:
    """A over B where both ran: time ratios, accuracies, Welch's tests, a paired t-test over shared seeds."""
    from scipy import stats

    from speedrun.bench.stats import welch
    out = []
    for a, b in pairs:
        ea, eb = entries.get(a), entries.get(b)
        if not (ea and eb and ea.get("runs") and eb.get("runs")):
            continue
        (ta, aa), (tb, ab) = [(e["summary"]["seconds"], e["summary"]["test_acc"]) for e in (ea, eb)]
        secs, accs = ([[r[k] for r in e["runs"]] for e in (ea, eb)] for k in ("seconds", "test_acc"))
        fig = {"a": a, "b": b, "time_ratio": ta["mean"] / tb["mean"] if tb["mean"] else None,
               "time_ratio_median": ta["median"] / tb["median"] if tb["median"] else None,
               "seconds_a": ta["mean"], "seconds_b": tb["mean"], "test_acc_a": aa["mean"], "test_acc_b": ab["mean"],
               "test_acc_diff": aa["mean"] - ab["mean"], "runs_a": ta["n"], "runs_b": tb["n"],
               "time_welch_p": welch(secs[1], secs[0])["p"], "test_acc_welch_p": welch(accs[1], accs[0])["p"]}
        sa, sb = ({r["seed"]: r["test_acc"] for r in e["runs"] if r.get("seed") is not None} for e in (ea, eb))
        seeds = sorted(set(sa) & set(sb))
        if seeds:
            diffs = [sa[k] - sb[k] for k in seeds]
            p = (float(stats.ttest_rel([sa[k] for k in seeds], [sb[k] for k in seeds]).pvalue)
                 if len(seeds) >= 2 and statistics.pstdev(diffs) > 0 else float("nan"))
            fig["paired"] = {"seeds": seeds, "test_acc_diff_mean": statistics.fmean(diffs), "test_acc_diff_p": p}
        out.append(fig)
    return out


def finish(args, record: dict) -> int:
    """A table of what the record holds (written after the last system); exit 0 when everything ran whole."""
    key = "variants" if args.synthetic else "systems"
    entries = record.get("peers", []) + record[key]
    print(f"\n{len(entries)} {'peers and variants' if record.get('peers') else key}, {args.runs} runs each (record: "
          f"{args.out})\n{'':50s} runs acc mean  acc med  seconds mean ± sd  median recomp warm-up  process  cache")
    for e in entries:
        s, t, a = e["summary"], e["summary"]["seconds"], e["summary"]["test_acc"]
        figures = (f"{a['mean']:8.2%} {a['median']:8.2%} {t['mean']:9.3f} ± {t['std']:<6.3f} {t['median']:7.3f}"
                   if s["runs"] else f"{'-':>47s}")
        status = "" if e["ok"] else f"  {'CUT' if e.get('cut') else 'FAILED'}: {e['error']}"
        if e.get("shortened"):
            given, limit = e["shortened"]["given_seconds"], e["shortened"]["limit_seconds"]
            status += f"  (shortened: {given:.0f} s of its {limit:.0f})"
        warm = "-" if e.get("warmup_seconds") is None else f"{e['warmup_seconds']:.1f} s"
        print(f"{e['kind'] + ' ' + e.get('system', e.get('variant', '')):50.50s} {s['runs']:4d} {figures} "
              f"{'-' if s['recompiles'] is None else s['recompiles']:>6} {warm:>8s} {e['process_wall_seconds']:6.1f} s"
              f" {cache_cell(e):>6s}{status}")
    for p in record.get("pairs", []):
        print(f"{p['a']} / {p['b']}: time {p['time_ratio']:.3f} (median {p['time_ratio_median']:.3f}), accuracy "
              f"{p['test_acc_a']:.2%} vs {p['test_acc_b']:.2%}")
    for name, ratio in record.get("ratios", {}).items():
        print(f"{name} / {record['variants'][0]['variant']}: time {ratio:.3f}")
    for left in record["left_out"]:
        print(f"not started: {left['name']} ({left['reason']})")
    return 0 if all(e["ok"] for e in entries) and not record["left_out"] else 1


def cache_cell(e: dict) -> str:
    """inductor's FX-graph cache hits/misses where the process counted them, else the files it added."""
    counted, files = e.get("inductor_cache") or {}, e.get("compile_cache") or {}
    if counted.get("hits") is not None:
        return f"{counted['hits']}h/{counted['misses']}m"
    if files.get("files_after") is not None:
        return f"+{files['files_after'] - files['files_before']}f"
    return "-"


# ---- the two modes: what runs, and the data it reads ---------------------------------------

def real_systems(args) -> tuple[list[System], dict]:
    """The systems in the order they run (max-autotune warm-ups first) and the record's part for them."""
    if not args.system:
        refuse(f"give at least one --system ({SYSTEM_FORMS}), or --synthetic")
    if args.recipe or args.variant or args.profile:
        refuse("--recipe, --variant and --profile belong to --synthetic")
    if args.jobs != 1:
        refuse("--jobs belongs to --synthetic: systems timed side by side slow each other, so the real mode times "
               "one at a time")
    given = [parse_system(spec, args) for spec in args.system]
    systems = [s for s in given if s.long_warmup] + [s for s in given if not s.long_warmup]
    args.pairs = [parse_pair(p, systems) for p in args.pair]
    args.batches = None
    if any(s.kind == "peer" or s.dataset == "cifar10" for s in systems):
        why = "the peer scripts and cifar10 recipes read CIFAR-10's official python batches"
        if not args.data_dir:
            refuse(f"--data-dir is needed: {why} from DIR/cifar-10-batches-py")
        args.batches = Path(args.data_dir).expanduser() / "cifar-10-batches-py"
        if missing := [n for n in CIFAR_FILES if not (args.batches / n).is_file()]:
            refuse(f"--data-dir {args.data_dir}: no CIFAR-10 python batches at {args.batches} (missing "
                   f"{', '.join(missing)}); {why}")
    return systems, {"benchmark": "speedrun's recipes against peers' own scripts, one after another, each system in "
                                  "its own fresh process", "runs_per_system": args.runs,
                     "data_dir": str(Path(args.data_dir).resolve()) if args.data_dir else None,
                     "order_given": [s.name for s in given], "pairs_asked": [f"{a}:{b}" for a, b in args.pairs],
                     "systems": [], "pairs": []}


def synthetic_variants(args) -> tuple[list[System], dict]:
    """The variants of --recipe, and any peers warmed up beside them on the same random data (their
    max-autotune warm-ups first), and the record's part for them and their random data."""
    if args.pair:
        refuse("--pair belongs to the real mode (without --synthetic)")
    if not args.recipe:
        refuse("--synthetic needs --recipe RECIPE")
    if args.n_train < 1 or args.n_test < 1:
        refuse("--n-train and --n-test must be at least 1")
    if args.jobs < 1:
        refuse("--jobs must be at least 1")
    peers = [parse_system(spec, args) for spec in args.system]
    variants = [parse_variant(v, args) for v in (args.variant or ["base"])]
    given = peers + variants
    systems = [s for s in given if s.long_warmup] + [s for s in given if not s.long_warmup]
    note = "accuracies on random labels mean nothing; only the times do"
    if args.jobs > 1:
        note = f"{args.jobs} processes side by side: neither the accuracies nor the times mean anything; a warm-up call"
    return systems, {"benchmark": "variants of a recipe on random CIFAR-shaped data, each in its own fresh process"
                                  + (", and peers' scripts warmed up on the same data" if peers else ""),
                     "recipe": args.recipe, "runs_per_variant": args.runs, "profile": args.profile,
                     "data": {"images": "random uint8, 3 x 32 x 32", "classes": 10, "labels": "random",
                              "n_train": args.n_train, "n_test": args.n_test, "note": note},
                     "variants": [], "ratios": {}, **({"peers": []} if peers else {})}


def write_data(args, record: dict, systems: list[System]) -> None:
    """The random data of --synthetic, else the peers' cifar10/*.pt, in the work folder (in the budget)."""
    t0, work = time.perf_counter(), args.work_dir
    if args.synthetic:
        import numpy as np
        rng, arrays = np.random.default_rng(0), {"classes": np.array([f"class {i}" for i in range(10)])}
        for split, n in (("train", args.n_train), ("test", args.n_test)):
            arrays.update({f"x_{split}": rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8),
                           f"y_{split}": rng.integers(0, 10, n, dtype=np.int64)})
        np.savez(work / "synthetic-cifar.npz", **arrays)
        if any(s.kind == "peer" for s in systems):      # (the same images and labels, as the peers read them)
            import torch
            folder = work / "airbench" / "cifar10"
            folder.mkdir(parents=True, exist_ok=True)
            for split in ("train", "test"):
                images = torch.from_numpy(arrays[f"x_{split}"]).permute(0, 2, 3, 1).contiguous()
                atomic_torch_save(folder / f"{split}.pt", {"images": images, "classes": list(CIFAR10_CLASSES),
                                                           "labels": torch.from_numpy(arrays[f"y_{split}"])})
            record["airbench_data"] = {"from": "the random data above", "folder": str(folder),
                                       "images": "uint8, N x 32 x 32 x 3", "labels": "int64"}
        record["data"]["write_seconds"] = time.perf_counter() - t0
    elif any(s.kind == "peer" for s in systems):
        from speedrun.data import load_dataset
        try:
            data, folder = load_dataset("cifar10", args.batches, fetch=False), work / "airbench" / "cifar10"
        except SpeedrunError as err:                    # (a damaged file: before any system ran)
            refuse(str(err))
        folder.mkdir(parents=True, exist_ok=True)
        for split, x, y in (("train", data.train_x, data.train_y), ("test", data.test_x, data.test_y)):
            atomic_torch_save(folder / f"{split}.pt", {"images": x.permute(0, 2, 3, 1).contiguous(), "labels": y,
                                                       "classes": data.classes})
        record["airbench_data"] = {"from": data.source, "folder": str(folder), "seconds": time.perf_counter() - t0}


# ---- the child: one variant in its own process, optionally profiled ------------------------

STEP_MARK = "gpu_record.step_end"
CUDA_KINDS = (("convolution", "triton_tem.*conv"), ("matmul", "triton_tem"), ("fused", "triton_"),
              ("batch norm", "bn_[fb]w|batch_?norm"), ("convolution", "conv|cudnn|implicit_gemm|[wd]grad|fprop"),
              ("convolution", "winograd"), ("matmul", "gemm|nvjet|cublas|matmul"), ("convolution", "xmma|cutlass"),
              ("optimizer", "multi_tensor|foreach"), ("copy/fill", "memcpy|memset|copy|fill|cat_|catarray"),
              ("reduction", "reduce|reduction"), ("elementwise", "elementwise|vectorized|unrolled"))
"""CUDA kernels by a pattern in their (lower-case) name, the first match counting: inductor's templates
(``triton_tem``) are convolutions or matmuls, its other ``triton_`` kernels fused."""
ATEN = r"^aten::({})(_backward|_out|_)*$"
CPU_KINDS = (("fused", "compiledfxgraph|torch-compiled region|compiledfunction|cpp_fused|inductor|## call"),
             ("optimizer", r"optimizer\.|_foreach_|fused_sgd|fused_adam"), ("convolution", "conv"),
             ("matmul", "addmm|aten::mm|bmm|matmul|aten::linear|mmbackward|aten::addmv"), ("batch norm", "batch_?norm"),
             ("copy/fill", "memcpy|memset|" + ATEN.format("copy|fill|zeros?(_like)?|ones(_like)?|full(_like)?|to"
                                                          "|_to_copy|clone|cat|stack|contiguous|constant_pad_nd"
                                                          "|reflection_pad2d|index|index_select|gather|scatter")),
             ("reduction", ATEN.format("sum|mean|amax|amin|max|min|argmax|argmin|norm|linalg_vector_norm|var|var_mean"
                                       "|std|any|all|prod|cumsum|topk|sort|nll_loss|cross_entropy_loss")),
             ("elementwise", ATEN.format("r?sub|add|mul|div|neg|exp|log|r?sqrt|pow|clamp|lerp|addc(mul|div)|sigmoid"
                                         "|tanh|relu|gelu|silu|threshold|where|abs|sign|eq|ne|lt|le|gt|ge|maximum"
                                         "|minimum|flip|reciprocal|masked_fill|(log_)?softmax|hardtanh")))
"""CPU ops: compiled regions, then by name; the plain ones by their ATen name (``_``, ``_backward``, ``_out`` aside)."""


def breakdown(events, cuda: bool, steps: int, run_seconds: float, wall_seconds: float) -> dict:
    """Kernel (CUDA) or op (CPU: own time, so nested ops count once) time of one profiled run by
    kind (the first of the kinds' patterns its name matches); its total against the run's seconds;
    kernels per training step between the step marks."""
    from torch.autograd import DeviceType
    cpu, kinds = [e for e in events if e.device_type == DeviceType.CPU], CUDA_KINDS if cuda else CPU_KINDS
    marks = sorted(e.time_range.start for e in cpu if e.name == STEP_MARK)
    if cuda:
        annotations = {e.name for e in cpu if getattr(e, "is_user_annotation", False)}
        items = [(e.name, e.time_range.start, e.time_range.elapsed_us(), True) for e in events
                 if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                 and e.name not in annotations and e.name != STEP_MARK]
    else:
        items = [(e.name, e.time_range.start, e.self_cpu_time_total, not e.cpu_children) for e in cpu
                 if e.name != STEP_MARK and not e.is_async]
    by_kind = {k: {"count": 0, "seconds": 0.0} for k in (*dict.fromkeys(k for k, _ in CUDA_KINDS), "other")}
    by_name = {}
    for name, _, us, _ in items:
        kind = next((k for k, pattern in kinds if re.search(pattern, name.lower())), "other")
        same = by_name.setdefault(name, {"name": name[:200], "kind": kind, "count": 0, "seconds": 0.0})
        for d in (by_kind[kind], same):
            d["count"] += 1
            d["seconds"] += us / 1e6
    window = [s for _, s, _, leaf in items if leaf and marks and marks[0] <= s <= marks[-1]]
    total = sum(us for _, _, us, _ in items) / 1e6
    return {"unit": "CUDA kernel" if cuda else "CPU op (self)", "per_step": "kernels" if cuda else "leaf ops",
            "total_seconds": total, "run_seconds": run_seconds, "wall_seconds": wall_seconds,
            "share_of_run": total / run_seconds if run_seconds else None, "events": len(items), "steps": steps,
            "steps_marked": len(marks), "kernels_per_step": len(window) / (len(marks) - 1) if len(marks) >= 2 else None,
            "by_kind": by_kind, "top": sorted(by_name.values(), key=lambda d: -d["seconds"])[:30]}


def child_variant(args) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from speedrun.data.pipeline.dataset import open_source
    from speedrun.engine.loop import NullProgress, Session
    from speedrun.engine.plan import plan_run
    from speedrun.engine.runtime import pick_device

    class StepMarks(NullProgress):
        """An empty profiler range after every training step: the profile tells the steps' events apart."""
        def step(self):
            with record_function(STEP_MARK):
                pass

    npz = args.child_variant.parent / "synthetic-cifar.npz"           # (the work folder's, beside the result)
    plan = plan_run(load_recipe(args.recipe, [*SYNTHETIC_SETS, *args.sets]), npz, pick_device(args.device))
    recipe, t0 = plan.recipe, time.perf_counter()
    session = Session(recipe, plan.source, plan.runtime, warm_up=True)
    rt = session.runtime
    out = {"recipe": recipe.name, "recipe_hash": recipe.digest(), "recipe_config": recipe.to_dict(),
           "warmup_seconds": session.compile_seconds, "build_and_warmup_seconds": time.perf_counter() - t0,
           "inductor_cache": {**session.compile_cache, "dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")},
           "runtime": rt.describe(), "torch_threads": torch.get_num_threads(), "runs": []}
    for i in range(args.runs + (1 if args.profile else 0)):
        seed = recipe.train.seed + i
        rt.synchronize()
        session.reset(seed)
        session.source = open_source(recipe, npz)[1]          # (re-read before each run, as speedrun bench does)
        if i < args.runs:
            r = session.run(seed)
            out["runs"].append({"seed": seed, "seconds": r.train_seconds, "final_eval_seconds": r.final_eval_seconds,
                                "test_acc": r.test_acc, "test_acc_no_tta": r.test_acc_no_tta, "steps": r.steps,
                                "recompiles": r.recompiles})
            print(f"run {i + 1}/{args.runs}: train+eval {r.train_seconds:.3f} s, {r.steps} steps", flush=True)
            atomic_write_json(args.child_variant, out)
            continue
        cuda = rt.device.type == "cuda"                       # (one more run, profiled)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            t = time.perf_counter()
            r = session.run(seed, progress=StepMarks())
            rt.synchronize()
            wall = time.perf_counter() - t
        p = out["profile"] = breakdown(prof.events(), cuda, r.steps, r.train_seconds, wall)
        print(f"profiled run: {p['total_seconds']:.3f} s of {p['unit']} time in a {r.train_seconds:.3f} s run, "
              f"{p['kernels_per_step']} {p['per_step']} per step: " + ", ".join(
                  f"{k} {d['seconds'] / p['total_seconds']:.0%}" for k, d in p["by_kind"].items() if d["seconds"]))
    atomic_write_json(args.child_variant, out)
    return 0

# ---- the command line ----------------------------------------------------------------------

def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], fromfile_prefix_chars="@")
    # @FILE: one or more arguments a line, split as a shell does; "#" lines are comments
    p.convert_arg_line_to_args = lambda line: [] if line.lstrip().startswith("#") else shlex.split(line)
    p.add_argument("--synthetic", action="store_true", help="time variants of --recipe on random CIFAR-shaped data "
                   "(with --system peer:PATH, warm the peer up on the same data)")
    p.add_argument("--system", action="append", default=[], metavar="SPEC", help=SYSTEM_FORMS + " (repeatable)")
    p.add_argument("--pair", action="append", default=[], metavar="A:B", help="A's mean time over B's (repeatable)")
    p.add_argument("--recipe", help="--synthetic: the recipe whose variants are timed")
    p.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE@...][#SECONDS[/LEAST]]",
                   help="--synthetic: a variant (repeatable; default: base)")
    p.add_argument("--runs", type=int, default=10, help="timed runs per system or variant, after its warm-up")
    p.add_argument("--profile", action="store_true", help="--synthetic: one more run per variant under the profiler")
    p.add_argument("--n-train", type=int, default=50000, help="--synthetic: training images")
    p.add_argument("--n-test", type=int, default=10000, help="--synthetic: test images")
    p.add_argument("--data-dir", help="the folder holding cifar-10-batches-py/")
    p.add_argument("--device", choices=["cuda", "cpu"], help="speedrun's device (default: cuda when available)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every speedrun system or variant (before its own)")
    p.add_argument("--commit", help="the commit the record names (default: $SPEEDRUN_COMMIT, else git rev-parse HEAD)")
    p.add_argument("--out", type=Path, help="the JSON record (default: in $OUT, where it is set)")
    p.add_argument("--work", type=Path, help="keep the work folder (logs, bench folders, data) here")
    p.add_argument("--budget", type=float, help="seconds for every system, from this script's start: a system whose "
                   "limit no longer fits starts with what is left if that is at least its LEAST, else not at all")
    p.add_argument("--limit", type=float, help="each system's or variant's limit in seconds (SPEC#SECONDS: its own)")
    p.add_argument("--call-timeout", type=float, metavar="SECONDS", help="the device call's timeout_s: refuse a "
                   "--budget that cannot end in it (without --budget: the budget is what it leaves)")
    p.add_argument("--setup-seconds", type=float, default=15.0, metavar="SECONDS",
                   help="what the call spends before this script starts (copying, unpacking, installing; default 15)")
    p.add_argument("--cache-dir", type=Path, metavar="DIR", help="every process's inductor and Triton caches in DIR "
                   "(TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR): the same DIR in a lending's calls reuses its code")
    p.add_argument("--jobs", type=int, default=1, metavar="K", help="--synthetic: up to K processes side by side (a "
                   "warm-up call: compiling is CPU work; their times mean nothing)")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="K", help="every time of the plan (each system's "
                   "limit and least, --limit, --budget, --setup-seconds, --call-timeout) multiplied by K: to dry-run a "
                   "lending's files on a machine K times slower than the one they were planned for (default 1)")
    p.add_argument("--child-variant", type=Path, metavar="RESULT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.time_scale > 0:
        refuse(f"--time-scale {args.time_scale:g}: a factor above 0 (e.g. 4 on a CPU four times slower)")
    k = args.time_scale
    for name in ("limit", "budget", "call_timeout"):
        if getattr(args, name) is not None:
            setattr(args, name, getattr(args, name) * k)
    args.setup_seconds *= k
    return args


def fit_the_call(args) -> None:
    """With --call-timeout: the budget, the set-up before this script, stopping the last system and
    writing the record must end inside the call's timeout_s, or nothing runs (one line); without
    --budget, the budget is what they leave."""
    if args.call_timeout is None:
        return
    if args.call_timeout <= 0 or args.setup_seconds < 0:
        refuse("--call-timeout is seconds above 0, --setup-seconds 0 or more")
    rest = args.setup_seconds + KILL_GRACE_SECONDS + WRITE_SECONDS
    if args.budget is None:
        if args.call_timeout - rest <= 0:
            refuse(f"--call-timeout {args.call_timeout:.0f} s leaves no budget after {rest:.0f} s of set-up "
                   f"(--setup-seconds {args.setup_seconds:.0f}), stopping and writing")
        args.budget = args.call_timeout - rest
    elif args.budget + rest > args.call_timeout:
        refuse(f"the plan cannot end inside the call: --budget {args.budget:.0f} s + {args.setup_seconds:.0f} s before "
               f"this script (--setup-seconds) + {KILL_GRACE_SECONDS:.0f} s to stop the last system + "
               f"{WRITE_SECONDS:.0f} s to write the record = {args.budget + rest:.0f} s, more than --call-timeout "
               f"{args.call_timeout:.0f} s; lower --budget to {args.call_timeout - rest:.0f} or raise the call's "
               "timeout_s")


def main(argv=None) -> int:
    started = time.perf_counter()
    args = parse(argv)
    if args.child_variant:
        return child_variant(args)
    args.started = started
    if args.runs < 1:
        refuse("--runs must be at least 1")
    if (args.limit is not None and args.limit <= 0) or (args.budget is not None and args.budget <= 0):
        refuse("--limit and --budget are seconds above 0")
    fit_the_call(args)
    systems, part = (synthetic_variants if args.synthetic else real_systems)(args)
    names = [s.name for s in systems]
    if len(set(names)) < len(names):
        refuse(f"--{'variant' if args.synthetic else 'system'}: two are named "
               f"{next(n for n in names if names.count(n) > 1)!r}; each must appear once")
    name = "gpu-record-synthetic.json" if args.synthetic else "gpu-record.json"
    if args.out is None and not os.environ.get("OUT"):            # (a lent GPU machine returns only $OUT's files)
        refuse(f"--out FILE.json is required (or set $OUT: the record is then written to $OUT/{name})")
    args.out = args.out or Path(os.environ["OUT"]) / name
    try:
        check_output_file(args.out, "--out", overwrite=True)
    except SpeedrunError as err:
        refuse(str(err))
    if args.cache_dir is not None:
        args.cache_dir = args.cache_dir.expanduser().resolve()
        try:
            (args.cache_dir / "triton").mkdir(parents=True, exist_ok=True)
        except OSError as err:
            refuse(f"--cache-dir {args.cache_dir}: cannot make it ({err.strerror})")
    from speedrun.report.environment import gpu_clocks, machine          # (torch: nothing was refused)
    env = machine(args.commit)                                           # (the commit read before anything runs)
    record = {"mode": "synthetic" if args.synthetic else "real", "script": "benchmarks/gpu_record.py",
              "command": " ".join(["benchmarks/gpu_record.py", *sys.argv[1:]]), "commit": env["commit"],
              "device": args.device, "sets": args.sets, "budget_seconds": args.budget,
              "call_timeout_seconds": args.call_timeout, "setup_seconds": args.setup_seconds, "jobs": args.jobs,
              "time_scale": args.time_scale,
              "compile_cache_dir": None if args.cache_dir is None else str(args.cache_dir),
              "limits": {s.name: s.limit for s in systems}, "least": {s.name: s.least_seconds() for s in systems},
              "order": names, "definitions": DEFINITIONS,
              "environment": env, "gpu_before": gpu_clocks(), "left_out": [], **part}
    with tempfile.TemporaryDirectory(prefix="gpu-record-", ignore_cleanup_errors=True) as temporary:
        args.work_dir = (args.work or Path(temporary)).resolve()            # (--work is kept)
        args.work_dir.mkdir(parents=True, exist_ok=True)
        write_data(args, record, systems)
        run_each(args, record, systems)
    return finish(args, record)


if __name__ == "__main__":
    sys.exit(main())
