"""How far above its bar each "learned" check of the recipe matrix lands, over seeds, on this CPU.

The matrix entries (tests/matrix.py) must beat chance by three standard errors of their test
accuracy (tests/test_recipe_matrix.py). A bf16 entry computes differently on a CPU with native
bf16 (AVX512-BF16, AMX) and on one that emulates it (a Zen 3, or any CPU under
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``), so its margin is measured both ways: each
entry, seed and way is one `speedrun train` process on the test's own small data, with one
thread as under the suite's xdist workers. The record keeps every run and, per entry and way, the
lowest accuracy (with and without TTA, whichever is lower) and its margin over the bar in test
images. Exit 1 where a run fell under its bar or failed.

    .venv/bin/python benchmarks/margins.py --seeds 8 --ways native,emulated --jobs 2 \
        --out benchmarks/results/margins-bf16-CPU-COMMIT.json [--entries ID,ID ...] [--work DIR] \
        [--set KEY=VALUE ...]

Without ``--entries``: every bf16 entry of the matrix (``--precision all``: every entry);
``--tests``: the tests outside the matrix that assert a run learned in bf16 (LEARNING_TESTS), each
under pytest with $SPEEDRUN_TEST_SEED.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

import small_data  # noqa: E402
from matrix import FIELDS, MATRIX, bar, command  # noqa: E402

from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.files import atomic_write_json, check_output_file  # noqa: E402
from speedrun.report.environment import machine  # noqa: E402

WAYS = {
    "native": {},       # whatever the CPU computes
    "emulated": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},   # bf16 as a Zen 3 computes it
}


LEARNING_TESTS = {
    # test -> (its bar, the test images it scores on): the tests outside the matrix that assert a run
    # learned in bf16; each reads its seed from $SPEEDRUN_TEST_SEED and records its score
    "tests/test_loop.py::test_bf16_autocast_trains_on_cpu": (0.4, 2000),
    "tests/test_loop.py::test_a_model_stored_in_bf16_trains_with_its_batch_norm_in_fp32": (0.4, 2000),
    "tests/test_weight_grad.py::test_a_speed_net_learns_as_well_with_the_products": (0.4, 2000),
}


def names(entries) -> list[str]:
    """Each entry's id, with #2, #3 ... after the second and later of entries that share one (as
    pytest numbers them)."""
    seen: dict[str, int] = {}
    out = []
    for e in entries:
        seen[e.id] = seen.get(e.id, 0) + 1
        out.append(e.id if seen[e.id] == 1 else f"{e.id}#{seen[e.id]}")
    return out


def run_one(entry, name: str, data: Path, seed: int, way: str, work: Path, extra: list[str]) -> dict:
    """One `speedrun train` process of ``entry`` (called ``name``) with ``seed``, computing bf16
    ``way`` (``extra``: overrides after the entry's own, to try a change to it)."""
    out = work / f"runs-{os.getpid()}" / way / f"{name}-seed{seed}".replace("#", "-") / "run"   # (this sweep's own)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv, env = command(entry, data, out, seed=seed)
    argv += sum((["--set", s] for s in extra), [])
    env = {**os.environ, **env, **WAYS[way], "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "SPEEDRUN_CACHE": str(work / way / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / way / "inductor")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "speedrun", *argv], capture_output=True, text=True, env=env)
    row = {"entry": name, "seed": seed, "way": way, "seconds": round(time.perf_counter() - t0, 1),
           "returncode": proc.returncode}
    if proc.returncode != 0:
        return {**row, "stderr": proc.stderr[-2000:]}
    summary = json.loads((out / "summary.json").read_text())
    classes = len(json.loads((out / "preprocessing.json").read_text())["classes"])
    b = bar(classes, summary["test_images"])
    low = min(summary["test_acc"], summary["test_acc_no_tta"])
    return {**row, "test_acc": summary["test_acc"], "test_acc_no_tta": summary["test_acc_no_tta"],
            "test_images": summary["test_images"], "classes": classes, "bar": round(b, 4),
            "margin_images": round((low - b) * summary["test_images"], 1),
            "train_seconds": summary["train_seconds"]}


def run_test(node: str, seed: int, way: str, work: Path) -> dict:
    """One of LEARNING_TESTS under pytest in its own process, with ``seed``, computing bf16 ``way``:
    the score it recorded (pytest's junit XML) against its bar."""
    report = work / way / f"{node.split('::')[-1]}-seed{seed}.xml"
    report.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **WAYS[way], "OMP_NUM_THREADS": "1", "SPEEDRUN_TEST_SEED": str(seed),
           "SPEEDRUN_CACHE": str(work / way / "cache")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", node,
                           f"--junitxml={report}"], capture_output=True, text=True, env=env, cwd=TESTS.parent)
    row = {"entry": node, "seed": seed, "way": way, "seconds": round(time.perf_counter() - t0, 1),
           "returncode": proc.returncode}
    scores = [float(p.get("value")) for p in ET.parse(report).iter("property") if p.get("name") == "score"] \
        if report.exists() else []
    if not scores:
        return {**row, "stderr": (proc.stdout + proc.stderr)[-2000:]}
    b, images = LEARNING_TESTS[node]
    return {**row, "test_acc": scores[0], "test_acc_no_tta": scores[0], "test_images": images, "bar": b,
            "margin_images": round((scores[0] - b) * images, 1)}


def lowest(runs: list[dict]) -> dict:
    """Per entry and way: the seeds run, the lowest margin (test images above the bar) and its seed."""
    out: dict = {}
    for r in runs:
        key = f"{r['entry']} / {r['way']}"
        row = out.setdefault(key, {"seeds": 0, "failed": 0, "lowest_margin_images": None})
        row["seeds"] += 1
        if "margin_images" not in r:
            row["failed"] += 1
        elif row["lowest_margin_images"] is None or r["margin_images"] < row["lowest_margin_images"]:
            row.update(lowest_margin_images=r["margin_images"], lowest_seed=r["seed"],
                       lowest_acc=min(r["test_acc"], r["test_acc_no_tta"]), bar=r["bar"],
                       test_images=r["test_images"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", help="comma-separated entry ids (tests/matrix.py Entry.id); default: the bf16 ones")
    p.add_argument("--precision", choices=["bf16", "all"], default="bf16")
    p.add_argument("--tests", action="store_true", help="the tests outside the matrix that assert learning in bf16 "
                                                          "(LEARNING_TESTS), instead of the matrix's entries")
    p.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--ways", default="native,emulated", help=f"comma-separated, of {', '.join(WAYS)}")
    p.add_argument("--jobs", type=int, default=2, help="training processes at a time (one thread each)")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="an override after each entry's own (to try a change to an entry before making it)")
    p.add_argument("--work", type=Path, help="where the data and the runs go (default: a temporary folder)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    ways = args.ways.split(",")
    everything = [(n, e) for n, e in zip(names(MATRIX + FIELDS), MATRIX + FIELDS)
                  if not e.args and e.data != "jpeg32_train"]          # (not the teacher's, nor a data.path one)
    if args.entries:
        wanted = args.entries.split(",")
        unknown = sorted(set(wanted) - {n for n, _ in everything})
        if unknown:
            p.error(f"--entries: no such entry {', '.join(unknown)}")
        chosen = [(n, e) for n, e in everything if n in wanted]
    else:
        chosen = [(n, e) for n, e in everything if args.precision == "all" or e.precision == "bf16"]
    if args.tests:
        chosen = [(node, None) for node in LEARNING_TESTS]
    entries = [e for _, e in chosen if e is not None]
    if set(ways) - set(WAYS):
        p.error(f"--ways: give some of {', '.join(WAYS)}")
    try:
        check_output_file(args.out, "--out")
    except SpeedrunError as err:
        p.error(str(err))
    work = args.work or Path(tempfile.mkdtemp(prefix="speedrun-margins-"))
    work.mkdir(parents=True, exist_ok=True)
    data_dir = small_data.shared_data()
    data = {e.data: small_data.BUILDERS[e.data](work, data_dir) for e in entries}
    record = {"what": ("accuracy of the tests that assert learning in bf16, each under pytest, against its bar"
                       if args.tests else "accuracy of the recipe matrix's entries against the matrix's bar (chance "
                       "+ 3 SE)") + " over seeds, bf16 native and emulated; one thread per process", "environment": machine(),
              "ways": {w: WAYS[w] for w in ways}, "entries": [n for n, _ in chosen], "extra_sets": args.extra,
              "seeds": list(range(args.first_seed, args.first_seed + args.seeds)), "runs": []}
    jobs = [(n, e, s, w) for w in ways for s in record["seeds"] for n, e in chosen]
    failed = False

    def job(j):
        name, entry, seed, way = j
        if entry is None:
            return run_test(name, seed, way, work)
        return run_one(entry, name, data[entry.data], seed, way, work, args.extra)

    with ThreadPoolExecutor(args.jobs) as pool:
        for row in pool.map(job, jobs):
            record["runs"].append(row)
            record["lowest"] = lowest(record["runs"])
            atomic_write_json(args.out, record)
            under = row.get("margin_images", -1) < 0
            failed |= under
            print(f"{row['entry']} seed {row['seed']} {row['way']}: "
                  + (f"{min(row['test_acc'], row['test_acc_no_tta']):.3f} against {row['bar']:.3f} "
                     f"({row['margin_images']:+.0f} images)" if "bar" in row else f"failed ({row['returncode']})")
                  + f", {row['seconds']:.0f} s" + ("  UNDER" if under else ""), flush=True)
    for key, row in record["lowest"].items():
        print(f"{key}: lowest {row['lowest_margin_images']} images above the bar over {row['seeds']} seeds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
