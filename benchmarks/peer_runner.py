"""Run a peer's own airbench-style script, unmodified, in this process (gpu_record.py starts one per
peer, in a folder holding cifar10/train.pt and test.pt): its ``__main__`` block's set-up, then
``main("warmup", ...)`` and N timed ``main(run, ...)`` calls, each run's own timer and ``tta_val_acc``
read from its final ``print_training_details`` entry, and inductor's cache counters after the warm-up
and after the runs (did the warm-up find the code an earlier process compiled?). How: benchmarks/README.md.

    python benchmarks/peer_runner.py SCRIPT.py --runs N --result RESULT.json
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from speedrun.files import atomic_write_json  # noqa: E402

TIMER_KEYS = ("time_seconds", "total_time_seconds")         # airbench94_muon.py's own timer, the legacy scripts'


class PeerError(Exception):
    """A script this runner cannot run as its ``__main__`` block would; the message says why."""


# ---- the script's __main__ block, read from its syntax tree --------------------------------

def main_calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == "main"]


def is_warmup(call: ast.Call) -> bool:
    return bool(call.args) and isinstance(call.args[0], ast.Constant) and call.args[0].value == "warmup"


def plan_script(source: str, name: str) -> dict:
    """``head`` (the statements above the last ``__main__`` block), ``setup`` (the block's before its
    first ``main`` call), the per-run call's ``args`` and ``keywords``, ``warmup_in_script``; or
    :class:`PeerError`. The modules keep the file's line numbers, so tracebacks name them."""
    try:
        tree = ast.parse(source, filename=name)
    except SyntaxError as err:
        raise PeerError(f"{name}: does not parse ({err.msg}, line {err.lineno})") from None
    guards = [i for i, n in enumerate(tree.body)
              if isinstance(n, ast.If) and ast.unparse(n.test) in ("__name__ == '__main__'", "'__main__' == __name__")]
    if not guards:
        raise PeerError(f"{name}: no `if __name__ == \"__main__\":` block; an airbench-style script runs its "
                        "timed runs there")
    head, body = tree.body[:guards[-1]], tree.body[guards[-1]].body
    missing = [f for f in ("main", "print_training_details")
               if f not in {n.name for n in head if isinstance(n, ast.FunctionDef)}]
    if missing:
        raise PeerError(f"{name}: defines no {' or '.join(missing)}(); not an airbench-style script "
                        "(its runs are read from print_training_details)")
    first = next((i for i, stmt in enumerate(body) if main_calls(stmt)), None)
    calls = [c for stmt in body[first or 0:] for c in main_calls(stmt)]
    timed = next((c for c in calls if not is_warmup(c)), None)
    if timed is None or not timed.args:
        raise PeerError(f"{name}: its __main__ block has no per-run call main(run, ...); cannot tell how it runs")
    if any(isinstance(a, ast.Starred) for a in timed.args) or any(k.arg is None for k in timed.keywords):
        raise PeerError(f"{name}: its per-run call of main passes *args or **kwargs; name the arguments")
    return {"head": ast.Module(body=head, type_ignores=[]), "setup": ast.Module(body=body[:first], type_ignores=[]),
            "setup_source": [ast.unparse(s) for s in body[:first]], "args": [ast.unparse(a) for a in timed.args[1:]],
            "keywords": {k.arg: ast.unparse(k.value) for k in timed.keywords},
            "warmup_in_script": any(is_warmup(c) for c in calls), "timed_call": ast.unparse(timed)}


def check_script(path: Path) -> dict:
    """The plan for the script at ``path`` (gpu_record.py checks every peer before any system runs)."""
    try:
        return plan_script(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as err:
        raise PeerError(f"{path}: cannot read it ({err})") from None


# ---- running it ---------------------------------------------------------------------------

def cache_counters() -> dict[str, int]:
    """inductor's and AOTAutograd's persistent-cache counters in this process so far (torch's own
    ``counters``: ``inductor.fxgraph_cache_hit`` / ``_miss`` and the like)."""
    from torch._dynamo.utils import counters
    return {f"{group}.{name}": int(n) for group in ("inductor", "aot_autograd")
            for name, n in sorted(counters[group].items()) if "cache" in name}


def run_peer(script: Path, runs: int, result_path: Path) -> None:
    import torch
    from torch._dynamo.utils import counters           # (graphs compiled so far: a run's recompiles)
    plan = check_script(script)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    name = "peer_" + re.sub(r"\W", "_", script.stem)
    module = sys.modules[name] = types.ModuleType(name)
    module.__file__ = str(script)
    sys.argv = [str(script)]                           # (the scripts read their own source from argv[0])
    sys.path.insert(0, str(script.parent))
    exec(compile(plan["head"], str(script), "exec"), module.__dict__)
    result = {"script": str(script), "cwd": os.getcwd(),
              "main_block": {k: v for k, v in plan.items() if k not in ("head", "setup")}}
    if not plan["warmup_in_script"]:
        result["note"] = ("its __main__ block makes no warm-up call; main('warmup', ...) was run before the timed "
                          "runs all the same, as for every system")

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
                           "test_acc_no_tta": None if val is None else float(val)})

    module.print_training_details = print_training_details
    t0 = time.perf_counter()
    exec(compile(plan["setup"], str(script), "exec"), module.__dict__)
    args = [eval(a, module.__dict__) for a in plan["args"]]
    kwargs = {k: eval(v, module.__dict__) for k, v in plan["keywords"].items()}
    module.main("warmup", *args, **kwargs)
    sync()
    warm = cache_counters()
    result.update(warmup_seconds=time.perf_counter() - t0, runs=[], inductor_cache={
        "dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "hits": warm.get("inductor.fxgraph_cache_hit", 0),
        "misses": warm.get("inductor.fxgraph_cache_miss", 0), "after_warmup": warm})
    print(f"PEER {script.name}: warm-up {result['warmup_seconds']:.1f} s; inductor's cache: "
          f"{result['inductor_cache']['hits']} graphs found compiled, {result['inductor_cache']['misses']} compiled",
          flush=True)
    atomic_write_json(result_path, result)
    for run in range(runs):
        finals.clear()
        graphs = counters["stats"]["unique_graphs"]
        t = time.perf_counter()
        module.main(run, *args, **kwargs)
        sync()
        wall = time.perf_counter() - t
        if len(finals) != 1:
            raise PeerError(f"{script.name}: run {run} logged {len(finals)} final entries (expected 1)")
        result["runs"].append({"run": run, **finals[0], "wall_seconds": wall,
                               "recompiles": counters["stats"]["unique_graphs"] - graphs})
        result["inductor_cache"]["after_runs"] = cache_counters()
        atomic_write_json(result_path, result)


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
