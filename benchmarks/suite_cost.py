"""What the test suite costs: the given pytest selection run once with each test's `speedrun`
commands forked from an interpreter that has imported torch (tests/forked.py, what the suite does)
and once with every one of them in a fresh interpreter (SPEEDRUN_TEST_FRESH=1), one after the
other, each timed whole and test by test (wall seconds, and CPU-seconds of the test's process and
of the processes it started and waited for, the forked ones included).

    python benchmarks/suite_cost.py --out benchmarks/results/suite-cost-<cpu>-<commit>.json \\
        [--modes forked,fresh] [--workers 2] -- tests/test_cli.py tests/test_failures.py

The record holds, per mode: pytest's exit code, the wall seconds of the whole call, the CPU-seconds
of all its processes, every test's figures, and the CPU-seconds by test file; and the fresh mode's
CPU over the forked mode's. A test's CPU counts a process it started only once that process has
been waited for (what getrusage counts); the fork server's children, which the server waits for,
are counted in the row of the test that ran them from what the server says they used.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "src"))

from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.files import atomic_write_json, check_output_file  # noqa: E402
from speedrun.report.environment import machine  # noqa: E402

PLUGIN = '''
import json, os, resource, time
import pytest

def _cpu():
    import sys
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = sys.modules.get("forked")      # (the tests' fork server's children, which it waits for)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime + (forked.cpu_seconds if forked else 0.0)

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, (s0, c0) = time.time(), _cpu()
    yield
    t1, (s1, c1) = time.time(), _cpu()
    with open(os.environ["SUITE_COST_LOG"], "a") as f:
        f.write(json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"),
                            "start": t0, "wall_seconds": t1 - t0, "cpu_seconds": (s1 - s0) + (c1 - c0)}) + "\\n")
'''


def run_mode(mode: str, tests: list[str], workers: int, folder: Path) -> dict:
    log = folder / f"{mode}.jsonl"
    env = {**os.environ, "SUITE_COST_LOG": str(log), "PYTHONPATH": os.pathsep.join(
        [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("SPEEDRUN_TEST_FRESH", None)
    if mode == "fresh":
        env["SPEEDRUN_TEST_FRESH"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_cost_plugin",
           *(["-n", str(workers)] if workers > 1 else []), *tests]
    # the call in a child of its own, so that its processes' CPU is this child's children's alone
    probe = ("import resource, subprocess, sys, json, time; t = time.perf_counter(); "
             "rc = subprocess.run(sys.argv[1:], cwd=%r).returncode; "
             "c = resource.getrusage(resource.RUSAGE_CHILDREN); "
             "print(json.dumps({'rc': rc, 'wall': time.perf_counter() - t, 'cpu': c.ru_utime + c.ru_stime}))"
             % str(HERE))
    proc = subprocess.run([sys.executable, "-c", probe, *cmd], env=env, capture_output=True, text=True)
    try:
        whole = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"suite_cost: error: the {mode} call printed no result:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    by_file = defaultdict(float)
    for r in rows:
        by_file[r["test"].split("::")[0]] += r["cpu_seconds"]
    return {"mode": mode, "command": " ".join(cmd[1:]), "pytest_exit_code": whole["rc"],
            "wall_seconds": whole["wall"], "cpu_seconds": whole["cpu"], "tests": len(rows),
            "cpu_seconds_by_file": dict(sorted(by_file.items(), key=lambda kv: -kv[1])), "runs": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the record (JSON; refused where it exists)")
    p.add_argument("--modes", default="forked,fresh", help="comma-separated: forked, fresh (default: both)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (1: none)")
    p.add_argument("--commit", help="the commit to name in the record (default: git's)")
    p.add_argument("tests", nargs="*", default=[], help="pytest's selection and options, after -- (default: the whole suite)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("forked", "fresh")]
    if bad or not modes:
        p.error(f"--modes {args.modes}: each must be forked or fresh")
    if args.workers < 1:
        p.error(f"--workers {args.workers}: must be 1 or more")
    try:
        check_output_file(args.out)
    except SpeedrunError as err:          # (says what is wrong with the path, naming --out)
        p.error(str(err))
    with tempfile.TemporaryDirectory(prefix="suite-cost-") as tmp:
        folder = Path(tmp)
        (folder / "suite_cost_plugin.py").write_text(PLUGIN)
        results = []
        for mode in modes:
            print(f"suite_cost: {mode} ...", flush=True)
            r = run_mode(mode, args.tests, args.workers, folder)
            print(f"suite_cost: {mode}: exit {r['pytest_exit_code']}, {r['tests']} tests, {r['wall_seconds']:.0f} s, "
                  f"{r['cpu_seconds']:.0f} CPU-s", flush=True)
            results.append(r)
    record = {"benchmark": "suite_cost", "environment": machine(args.commit), "timed": (
        "each mode's whole pytest call (wall seconds; CPU-seconds of every process it started, servers and "
        "their children included) and each test (wall; CPU of the test's process and of the processes it waited for)"),
        "selection": args.tests or ["(the whole suite)"], "workers": args.workers, "modes": results}
    by = {r["mode"]: r for r in results}
    if {"forked", "fresh"} <= set(by):
        record["fresh_over_forked_cpu"] = by["fresh"]["cpu_seconds"] / by["forked"]["cpu_seconds"]
        record["fresh_over_forked_wall"] = by["fresh"]["wall_seconds"] / by["forked"]["wall_seconds"]
    atomic_write_json(args.out, record)
    print(f"suite_cost: wrote {args.out}")
    return 0 if all(r["pytest_exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
