"""Does a change of speedrun's code leave training bit for bit as it was? `speedrun train` of
one recipe from another tree of speedrun (an earlier commit) and from this checkout, with the
same seed and settings, each in its own process; the trained weights (model.pt) compared
tensor by tensor with torch.equal, and the accuracies; exit code 1 when any setting differs.

    git archive BASE_COMMIT src | tar -x -C /tmp/base
    python benchmarks/same_weights.py /tmp/base BASE_COMMIT cifar10-94 --data-dir ../shared/datasets \\
        --setting eager:runtime.compile=off --setting compiled:runtime.compile=on \\
        --out benchmarks/results/same-weights-BASE-cifar10-94-<cpu>.json [-- --set train.epochs=0.1 ...]

Each ``--setting NAME:KEY=VALUE@KEY=VALUE`` is one pair of runs (default: the recipe as it is);
the arguments after ``--`` go to every run. Both trees run one after the other here, so the record's
train_seconds of a setting's two runs compare. ``--keep DIR`` keeps each run's folder in DIR (as
NAME-base/ and NAME-this/, with NAME-SIDE.json saying how it was made); ``--this-from DIR`` takes
this checkout's run of each setting from such a DIR instead of training it again (to hold several
base trees against one run of this checkout), refused where that run was made otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "src"))

import torch  # noqa: E402

from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.files import atomic_write_json, check_output_file  # noqa: E402
from speedrun.report.environment import machine  # noqa: E402


def command(args, sets: list[str], out: Path) -> list[str]:
    """The ``speedrun train`` command of one run into ``out``."""
    return [sys.executable, "-m", "speedrun", "train", args.recipe, "--out", str(out), *args.extra,
            *[a for s in sets for a in ("--set", s)], *(["--data-dir", args.data_dir] if args.data_dir else [])]


def made_as(args, sets: list[str], folder: Path) -> dict:
    """What a kept run's NAME-SIDE.json must say for it to stand for this call's run of ``sets``."""
    return {"tree": str(HERE), "command": " ".join(command(args, sets, folder)[1:])}


def reused(args, name: str, sets: list[str]) -> dict:
    """This checkout's run of setting ``name`` as an earlier call kept it in --this-from (refused where it was
    made from another tree or with other arguments, or is incomplete)."""
    folder = args.this_from.resolve() / f"{name}-this"
    note = folder.parent / f"{name}-this.json"
    try:
        run = json.loads(note.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"same_weights: error: --this-from {args.this_from}: no kept run of setting {name!r} "
                         f"({note}: {err})") from None
    want = made_as(args, sets, folder)
    if {k: run.get(k) for k in want} != want or not (folder / "model.pt").is_file():
        raise SystemExit(f"same_weights: error: --this-from {args.this_from}: the kept run of setting {name!r} was "
                         f"made otherwise ({run.get('command')!r} from {run.get('tree')}, not {want['command']!r} "
                         f"from {want['tree']}); train it again or keep it with these arguments")
    return {**run, "reused_from": str(folder)}


def train(tree: Path, args, sets: list[str], out: Path) -> dict:
    """``speedrun train`` from ``tree`` into ``out``, in its own process; what its summary says."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"),
               TORCHINDUCTOR_CACHE_DIR=str(out.parent / f"inductor-{out.name}"))
    cmd = command(args, sets, out)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=out.parent, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"same_weights: error: {tree}: speedrun train failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    keys = ("test_acc", "test_acc_no_tta", "train_seconds", "steps", "git_commit", "git_dirty")
    return {"process_wall_seconds": time.perf_counter() - t0, **{k: s.get(k) for k in keys},
            "command": " ".join(cmd[1:]), "tree": str(tree)}


def differing_tensors(a: Path, b: Path) -> list[str]:
    """The names of the state-dict tensors that two weight files do not hold equal (or hold only one of)."""
    wa, wb = (torch.load(f, map_location="cpu", weights_only=True) for f in (a, b))
    wa, wb = wa.get("model", wa), wb.get("model", wb)
    return sorted(k for k in set(wa) | set(wb) if k not in wa or k not in wb or not torch.equal(wa[k], wb[k]))


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="same_weights", description=__doc__.split("\n\n")[0])
    p.add_argument("base_tree", type=Path, help="a tree holding src/speedrun of the other commit")
    p.add_argument("base_commit", help="that commit, for the record")
    p.add_argument("recipe")
    p.add_argument("--data-dir")
    p.add_argument("--setting", action="append", default=[], metavar="NAME:KEY=VALUE@...")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep each run's folder in DIR (a new or empty folder)")
    p.add_argument("--this-from", type=Path, metavar="DIR", help="this checkout's runs from an earlier call's --keep DIR")
    args = p.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]
    if not (args.base_tree / "src" / "speedrun").is_dir():
        p.error(f"{args.base_tree}: no src/speedrun in it (git archive COMMIT src | tar -x -C DIR)")
    try:
        check_output_file(args.out, "--out")
    except SpeedrunError as err:
        p.error(str(err))
    if args.keep is not None and args.keep.exists() and (not args.keep.is_dir() or any(args.keep.iterdir())):
        p.error(f"--keep {args.keep}: exists and is not an empty folder")
    settings = []
    for spec in args.setting or ["recipe"]:
        name, _, tail = spec.partition(":")
        settings.append((name, [s for s in tail.split("@") if s]))
    kept = {name: reused(args, name, sets) for name, sets in settings} if args.this_from else {}
    record = {"benchmark": "same_weights: speedrun train from two trees, trained weights compared bit for bit",
              "script": "benchmarks/same_weights.py", "recipe": args.recipe, "base_commit": args.base_commit,
              "extra": args.extra, "environment": machine(), "settings": []}
    with tempfile.TemporaryDirectory(prefix="same-weights-") as tmp:
        where = Path(tmp) if args.keep is None else args.keep.resolve()
        where.mkdir(parents=True, exist_ok=True)
        for name, sets in settings:
            runs, folders = {}, {}
            for side, tree in (("base", args.base_tree.resolve()), ("this", HERE)):
                if side == "this" and name in kept:
                    runs[side], folders[side] = kept[name], Path(kept[name]["reused_from"])
                    print(f"== {name}: {side} ({tree}): kept in {folders[side]}, not trained again", flush=True)
                    continue
                print(f"== {name}: {side} ({tree})", flush=True)
                folders[side] = where / f"{name}-{side}"
                runs[side] = train(tree, args, sets, folders[side])
                if args.keep is not None:
                    atomic_write_json(where / f"{name}-{side}.json", runs[side])
            differ = differing_tensors(*(folders[side] / "model.pt" for side in ("base", "this")))
            record["settings"].append({"setting": name, "sets": sets, "runs": runs, "identical": not differ,
                                       "differing_tensors": differ,
                                       "same_test_acc": runs["base"]["test_acc"] == runs["this"]["test_acc"]})
            print(f"{name}: weights {'DIFFER: ' + ', '.join(differ[:5]) if differ else 'identical'}; test accuracy "
                  f"{runs['base']['test_acc']:.4%} / {runs['this']['test_acc']:.4%}", flush=True)
            atomic_write_json(args.out, record)
    return 0 if all(s["identical"] and s["same_test_acc"] for s in record["settings"]) else 1


if __name__ == "__main__":
    sys.exit(main())
