"""docs/python.md's example, timed as a user runs it: the example's code block, unchanged, in a
fresh Python process (its own folder, a cache of its own, so the arrays are stored and the FLOPs
counted as on a first run), ``--rounds`` times one after another. Each round records the
process's wall and CPU seconds and what the example's run wrote (test accuracy, training seconds,
wall seconds inside the run); the record names the machine, torch and the commit.

    python benchmarks/python_example.py --out benchmarks/results/python-example-CPU-COMMIT.json
    python benchmarks/python_example.py --rounds 1 --keep DIR --out FILE   # DIR: the round's folder kept

$SPEEDRUN_DATA (or --data-dir) names the folder that holds fashion-mnist/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from any_network import child_cpu_seconds   # (benchmarks/, the folder this script runs from)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "python.md"

DEFINITIONS = {
    "process_seconds": "wall time of the example's whole process: interpreter start, imports, storing the arrays, "
                       "training, the final evaluation, loading the run and the prediction",
    "process_cpu_seconds": "user + system CPU seconds of that process",
    "train_seconds": "the run's summary.json train_seconds (speedrun's timed region: the data's first touch on the "
                     "device to the final TTA accuracy)",
    "run_wall_seconds": "the run's summary.json wall_seconds",
}


def example_code() -> str:
    """The code block under docs/python.md's '## Example' heading."""
    blocks = re.findall(r"## Example.*?```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    if len(blocks) != 1:
        raise SystemExit(f"python_example: error: {DOC} has {len(blocks)} python blocks under '## Example', not one")
    return blocks[0]


def one_round(code: str, folder: Path, data_dir: str, threads: int | None) -> dict:
    """The example run once in ``folder``: what the process took and what its run recorded."""
    folder.mkdir(parents=True)
    (folder / "example.py").write_text(code, encoding="utf-8")
    env = {**os.environ, "SPEEDRUN_DATA": data_dir, "SPEEDRUN_CACHE": str(folder / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cpu0, t0 = child_cpu_seconds(), time.perf_counter()
    proc = subprocess.run([sys.executable, "example.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=3600)
    wall, cpu = time.perf_counter() - t0, child_cpu_seconds() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"python_example: error: the example exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((folder / "runs" / "python-demo" / "summary.json").read_text())
    return {"process_seconds": wall, "process_cpu_seconds": cpu, "test_acc": summary["test_acc"],
            "test_images": summary["test_images"], "train_seconds": summary["train_seconds"],
            "run_wall_seconds": summary["wall_seconds"], "stdout": proc.stdout.splitlines()}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the record's JSON file (refused where it exists)")
    p.add_argument("--rounds", type=int, default=3, help="how many times to run the example (default 3)")
    p.add_argument("--data-dir", default=os.environ.get("SPEEDRUN_DATA"),
                   help="the folder holding fashion-mnist/ (default $SPEEDRUN_DATA)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the example's process (default: torch's own)")
    p.add_argument("--keep", help="a new folder to keep the rounds' folders in (default: deleted)")
    p.add_argument("--note", default="", help="a note stored in the record")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    if not args.data_dir or not (Path(args.data_dir) / "fashion-mnist").is_dir():
        p.error(f"--data-dir {args.data_dir}: no fashion-mnist/ there; give the folder that holds it ($SPEEDRUN_DATA)")
    if args.keep and Path(args.keep).exists():
        p.error(f"--keep {args.keep}: it exists; give a new folder")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    from speedrun.errors import SpeedrunError
    from speedrun.files import atomic_write_json, check_output_file
    try:
        check_output_file(args.out, "--out")
    except SpeedrunError as err:
        raise SystemExit(f"python_example: error: {err}")
    import torch
    from speedrun.report.environment import machine
    code = example_code()
    record = {"benchmark": "docs/python.md's example in a fresh process, as a user runs it", "note": args.note,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "code": code,
              "threads": args.threads, "torch": torch.__version__, "definitions": DEFINITIONS,
              "environment": machine(), "rounds": []}
    with tempfile.TemporaryDirectory(prefix="python-example-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        for r in range(args.rounds):
            done = one_round(code, base / f"round-{r}", str(Path(args.data_dir).resolve()), args.threads)
            record["rounds"].append(done)
            figures = [x["process_seconds"] for x in record["rounds"]]
            record["summary"] = {"rounds": len(figures), "process_seconds_median": statistics.median(figures),
                                 "process_seconds_min": min(figures), "process_seconds_max": max(figures),
                                 "test_acc": [x["test_acc"] for x in record["rounds"]]}
            atomic_write_json(args.out, record)
            print(f"python_example: round {r + 1}/{args.rounds}: {done['process_seconds']:.1f} s for the process, "
                  f"{done['train_seconds']:.1f} s of training, test accuracy {done['test_acc']:.2%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
