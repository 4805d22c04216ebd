"""Run a peer's own airbench-style training script, unmodified, in this process: its warm-up,
then N timed runs, as the script's own ``__main__`` block does; collect each run's own timer
and TTA accuracy. Used by ``gpu_record.py`` (one fresh process per peer); the peer's code is
read from the path given and never copied anywhere.

    python benchmarks/peer_runner.py SCRIPT.py --runs N --result RESULT.json   # cwd: holds cifar10/*.pt

How the script is run, without changing a line of it:

- the source above its ``if __name__ == "__main__":`` line is executed as a module (named
  ``peer_<file stem>``, ``sys.argv[0]`` the script's path, as when run directly);
- its ``__main__`` block is read (``ast``), not executed: the statements before its first
  call of ``main`` (building and compiling models, printing the table head) run unchanged,
  then ``main("warmup", *ARGS)`` and ``main(run, *ARGS)`` for run = 0 .. N-1, where ARGS
  are the expressions its own per-run call passes after ``run`` (airbench94_muon.py: the
  model that its block builds and compiles with ``mode="max-autotune"``; legacy/airbench94.py:
  none). A script whose block leaves the warm-up out (legacy/airbench94.py has
  ``#main('warmup')``) is warmed up all the same, and the result says so
  (``warmup_in_script``), so that no system's first timed run pays its one-time costs;
- only its logging function ``print_training_details(variables, is_final_entry)`` is
  wrapped: the final entry of each run gives the script's own timer (``time_seconds`` or
  ``total_time_seconds``), ``tta_val_acc`` and the last epoch's ``val_acc`` (no TTA).

``warmup_seconds`` is the wall time of the block's set-up statements plus the warm-up run
(models built, compiled, autotuned, the warm-up's training on dummy labels), the device
synchronised at its end. Each timed run also has ``wall_seconds``: the whole ``main`` call
(loading the data onto the device, per-epoch evaluations and printing included), and
``recompiles``: graphs dynamo compiled during the call (0 when the warm-up compiled everything).
The result file is written after the warm-up and after every run, so a process stopped at its
time limit leaves what finished.

``write_cifar10_pt(BATCHES, FOLDER)`` writes the data the airbench scripts read from their
working folder, ``cifar10/train.pt`` and ``cifar10/test.pt``, from the official CIFAR-10 python
batches: each a dict of ``images`` (uint8, N x 32 x 32 x 3, as torchvision's ``CIFAR10.data``),
``labels`` (int64, N) and ``classes`` (the ten names from ``batches.meta``), which their
``CifarLoader`` loads with ``torch.load`` instead of downloading.

This file imports only the standard library, numpy and torch (not speedrun).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import pickle
import re
import sys
import time
import types
from pathlib import Path

MAIN_GUARD = re.compile(r"""^if\s+__name__\s*==\s*(['"])__main__\1\s*:""", re.MULTILINE)
TIMER_KEYS = ("time_seconds", "total_time_seconds")
"""The airbench scripts' own timers: airbench94_muon.py's, then the legacy scripts'."""

CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = ("test_batch",)
CIFAR_FILES = CIFAR_TRAIN + CIFAR_TEST + ("batches.meta",)


class PeerError(Exception):
    """A peer script this runner cannot run as its ``__main__`` would; the message says why."""


# ------------------------------------------------------------------------------------------
# The script's __main__ block
# ------------------------------------------------------------------------------------------

def split_source(source: str, name: str) -> tuple[str, str]:
    """(the module part, the ``if __name__ == "__main__":`` block) of a script's source."""
    guards = list(MAIN_GUARD.finditer(source))
    if not guards:
        raise PeerError(f"{name}: no `if __name__ == \"__main__\":` block; an airbench-style script runs its "
                        "timed runs there")
    at = guards[-1].start()
    return source[:at], source[at:]


def _calls_main(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "main"]


def _is_warmup(call: ast.Call) -> bool:
    return bool(call.args) and isinstance(call.args[0], ast.Constant) and call.args[0].value == "warmup"


def plan_main_block(block: str, name: str) -> dict:
    """What the ``__main__`` block does, read from its syntax tree: ``setup`` (a module of the
    statements before its first call of ``main``), ``args`` (source of the arguments its
    per-run call passes after the run number), ``keywords`` (name -> source) and
    ``warmup_in_script`` (whether it calls ``main("warmup", ...)`` itself)."""
    try:
        tree = ast.parse(block, filename=name)
    except SyntaxError as err:
        raise PeerError(f"{name}: its __main__ block does not parse ({err.msg}, line {err.lineno})") from None
    guard = tree.body[0]
    assert isinstance(guard, ast.If)
    body = guard.body
    first = next((i for i, stmt in enumerate(body) if _calls_main(stmt)), None)
    if first is None:
        raise PeerError(f"{name}: its __main__ block never calls main(run, ...); cannot tell how it runs")
    calls = [c for stmt in body[first:] for c in _calls_main(stmt)]
    timed = next((c for c in calls if not _is_warmup(c)), None)
    if timed is None or not timed.args:
        raise PeerError(f"{name}: its __main__ block has no per-run call main(run, ...)")
    if any(isinstance(a, ast.Starred) for a in timed.args) or any(k.arg is None for k in timed.keywords):
        raise PeerError(f"{name}: its per-run call of main passes *args or **kwargs; name the arguments")
    setup = ast.Module(body=body[:first], type_ignores=[])
    return {"setup": setup, "setup_source": [ast.unparse(s) for s in body[:first]],
            "args": [ast.unparse(a) for a in timed.args[1:]],
            "keywords": {k.arg: ast.unparse(k.value) for k in timed.keywords},
            "warmup_in_script": any(_is_warmup(c) for c in calls),
            "timed_call": ast.unparse(timed)}


def check_script(path: Path) -> dict:
    """The plan for ``path``, or :class:`PeerError` naming what is missing (checked before any
    system runs: a file that is not an airbench-style script is refused at once)."""
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PeerError(f"{path}: cannot read it ({err})") from None
    head, block = split_source(source, str(path))
    try:
        tree = ast.parse(head, filename=str(path))
    except SyntaxError as err:
        raise PeerError(f"{path}: does not parse ({err.msg}, line {err.lineno})") from None
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = [f for f in ("main", "print_training_details") if f not in defined]
    if missing:
        raise PeerError(f"{path}: defines no {' or '.join(missing)}(); not an airbench-style script "
                        "(its runs are read from print_training_details)")
    plan = plan_main_block(block, str(path))
    ast.increment_lineno(plan["setup"], head.count("\n"))     # (tracebacks name the file's own lines)
    return plan


def long_warmup(plan: dict) -> bool:
    """Whether the block's set-up compiles with ``max-autotune`` (airbench94_muon.py: about 140 s
    of autotuning on an H100 before its first run)."""
    return any("max-autotune" in line for line in plan["setup_source"])


# ------------------------------------------------------------------------------------------
# Data: the official CIFAR-10 batches as airbench's cifar10/{train,test}.pt
# ------------------------------------------------------------------------------------------

def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def write_cifar10_pt(batches: Path, folder: Path) -> dict:
    """``folder/cifar10/train.pt`` and ``test.pt`` from the official python batches in
    ``batches`` (cifar-10-batches-py); returns what was written."""
    import numpy as np
    import torch

    missing = [n for n in CIFAR_FILES if not (batches / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{batches}: missing CIFAR-10 batch files {missing}")
    classes = [c.decode() for c in _unpickle(batches / "batches.meta")[b"label_names"]]
    out = folder / "cifar10"
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, names in (("train", CIFAR_TRAIN), ("test", CIFAR_TEST)):
        parts = [_unpickle(batches / n) for n in names]
        x = np.concatenate([np.asarray(p[b"data"], dtype=np.uint8) for p in parts]).reshape(-1, 3, 32, 32)
        x = x.transpose(0, 2, 3, 1)                   # NHWC, as torchvision's CIFAR10.data
        y = np.concatenate([np.asarray(p[b"labels"], dtype=np.int64) for p in parts])
        data = {"images": torch.from_numpy(np.ascontiguousarray(x)), "labels": torch.from_numpy(y),
                "classes": classes}
        path = out / f"{split}.pt"
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(data, tmp)
        os.replace(tmp, path)
        written[split] = {"path": str(path), "images": len(y)}
    return written


# ------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------

def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _versions(torch) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:                                   # (absent from CPU builds)
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"torch_version": torch.__version__, "cuda_version": torch.version.cuda, "triton_version": triton_version,
            "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "gpu_name": torch.cuda.get_device_name(0) if cuda else None, "python_version": sys.version.split()[0],
            "torch_threads": torch.get_num_threads()}


def compiled_graphs(torch) -> int | None:
    """Graphs dynamo has compiled in this process so far (None where dynamo cannot be read)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:                                   # (a torch without dynamo)
        return None
    return int(counters["stats"]["unique_graphs"])


def run_peer(script: Path, runs: int, result_path: Path) -> dict:
    started = time.perf_counter()
    import torch
    plan = check_script(script)
    source = script.read_text(encoding="utf-8")
    head, _ = split_source(source, str(script))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    name = "peer_" + re.sub(r"\W", "_", script.stem)
    module = types.ModuleType(name)
    module.__file__ = str(script)
    sys.modules[name] = module
    sys.argv = [str(script)]                           # (the scripts read their own source from argv[0])
    sys.path.insert(0, str(script.parent))
    t0 = time.perf_counter()
    exec(compile(head, str(script), "exec"), module.__dict__)
    import_seconds = time.perf_counter() - t0

    finals: list[dict] = []
    log = module.print_training_details

    def print_training_details(variables, is_final_entry):
        log(variables, is_final_entry)
        if is_final_entry:
            timer = next((k for k in TIMER_KEYS if variables.get(k) is not None), None)
            if timer is None or variables.get("tta_val_acc") is None:
                raise PeerError(f"{script.name}: its final log entry has no {' / '.join(TIMER_KEYS)} or "
                                "tta_val_acc; cannot read its timer")
            val = variables.get("val_acc")
            finals.append({"seconds": float(variables[timer]), "timer": timer,
                           "test_acc": float(variables["tta_val_acc"]),
                           "test_acc_no_tta": float(val) if val is not None else None})

    module.print_training_details = print_training_details

    def main_args() -> tuple[list, dict]:
        scope = module.__dict__
        return ([eval(a, scope) for a in plan["args"]],
                {k: eval(v, scope) for k, v in plan["keywords"].items()})

    result = {"script": str(script), "file": script.name, "cwd": os.getcwd(), "runs_asked": runs,
              "main_block": {k: plan[k] for k in ("setup_source", "args", "keywords", "timed_call",
                                                  "warmup_in_script")},
              "import_seconds": import_seconds, **_versions(torch)}
    if not plan["warmup_in_script"]:
        result["note"] = ("its __main__ block makes no warm-up call; main('warmup', ...) was run before the timed "
                          "runs all the same, as for every system")
    t0 = time.perf_counter()
    exec(compile(plan["setup"], str(script), "exec"), module.__dict__)
    args, kwargs = main_args()
    module.main("warmup", *args, **kwargs)
    sync()
    result["warmup_seconds"] = time.perf_counter() - t0
    result["warmup_own_seconds"] = finals[-1]["seconds"] if finals else None
    print(f"PEER {script.name}: warm-up {result['warmup_seconds']:.1f} s", flush=True)
    result["runs"] = []
    _write_json(result_path, result)                    # (a process stopped in its runs keeps the warm-up)
    for run in range(runs):
        finals.clear()
        graphs = compiled_graphs(torch)
        t = time.perf_counter()
        returned = module.main(run, *args, **kwargs)
        sync()
        wall = time.perf_counter() - t
        after = compiled_graphs(torch)
        if len(finals) != 1:
            raise PeerError(f"{script.name}: run {run} logged {len(finals)} final entries (expected 1)")
        result["runs"].append({"run": run, **finals[0], "wall_seconds": wall,
                               "recompiles": None if graphs is None else after - graphs,
                               "returned": float(returned) if isinstance(returned, (int, float)) else None})
        result["process_seconds_so_far"] = time.perf_counter() - started
        _write_json(result_path, result)
    _write_json(result_path, result)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("script", type=Path)
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--result", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        run_peer(args.script.resolve(), args.runs, args.result.resolve())
    except PeerError as err:
        print(f"peer_runner: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
