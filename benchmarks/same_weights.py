"""Does a change of speedrun's code leave training bit for bit as it was? `speedrun train` of
one recipe from another tree of speedrun (an earlier commit) and from this checkout, with the
same seed and settings, each in its own process; the trained weights (model.pt) compared
tensor by tensor with torch.equal, and the accuracies.

    git archive BASE_COMMIT src | tar -x -C /tmp/base
    python benchmarks/same_weights.py /tmp/base BASE_COMMIT cifar10-94 --data-dir ../shared/datasets \\
        --setting eager:runtime.compile=off --setting compiled:runtime.compile=on \\
        --out benchmarks/results/same-weights-BASE-cifar10-94-<cpu>.json [-- --set train.epochs=0.1 ...]

Each ``--setting NAME:KEY=VALUE@KEY=VALUE`` is one pair of runs (default: the recipe as it is);
the arguments after ``--`` go to every run. The record holds, per setting, both runs' test
accuracies, their train_seconds (timing is not the point here: both trees ran one after the
other on the same machine), and ``identical``: every tensor of the state dict equal, with the
names of any that differ. Exit code 1 when any setting's weights differ.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "src"))

from speedrun.files import atomic_write_json, check_output_file  # noqa: E402
from speedrun.report.environment import machine  # noqa: E402


def train(tree: Path, recipe: str, sets: list[str], extra: list[str], data_dir: str | None, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(out.parent / f"inductor-{out.name}")
    cmd = [sys.executable, "-m", "speedrun", "train", recipe, "--out", str(out), *extra]
    cmd += [a for s in sets for a in ("--set", s)]
    if data_dir:
        cmd += ["--data-dir", data_dir]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=out.parent, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"same_weights: {tree}: speedrun train failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    import json
    summary = json.loads((out / "summary.json").read_text())
    return {"process_wall_seconds": time.perf_counter() - t0, "test_acc": summary["test_acc"],
            "test_acc_no_tta": summary.get("test_acc_no_tta"), "train_seconds": summary["train_seconds"],
            "steps": summary.get("steps"), "git_commit": summary.get("git_commit"), "git_dirty": summary.get("git_dirty"),
            "command": " ".join(cmd[1:])}


def compare_weights(a: Path, b: Path) -> tuple[bool, list[str]]:
    import torch
    wa = torch.load(a, map_location="cpu", weights_only=True)
    wb = torch.load(b, map_location="cpu", weights_only=True)
    wa, wb = wa.get("model", wa), wb.get("model", wb)
    differ = sorted(k for k in set(wa) | set(wb)
                    if k not in wa or k not in wb or not torch.equal(wa[k], wb[k]))
    return not differ, differ


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="same_weights", description=__doc__.split("\n\n")[0])
    p.add_argument("base_tree", type=Path, help="a tree holding src/speedrun of the other commit")
    p.add_argument("base_commit", help="that commit, for the record")
    p.add_argument("recipe")
    p.add_argument("--data-dir")
    p.add_argument("--setting", action="append", default=[], metavar="NAME:KEY=VALUE@...")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not (args.base_tree / "src" / "speedrun").is_dir():
        p.error(f"{args.base_tree}: no src/speedrun in it (git archive COMMIT src | tar -x -C DIR)")
    check_output_file(args.out, "--out")
    settings = []
    for spec in args.setting or ["recipe"]:
        name, _, tail = spec.partition(":")
        settings.append((name, [s for s in tail.split("@") if s]))
    record = {"benchmark": "same_weights: speedrun train from two trees, trained weights compared bit for bit",
              "script": "benchmarks/same_weights.py", "recipe": args.recipe, "base_commit": args.base_commit,
              "extra": extra, "environment": machine(), "settings": []}
    ok = True
    with tempfile.TemporaryDirectory(prefix="same-weights-") as tmp:
        for name, sets in settings:
            runs = {}
            for side, tree in (("base", args.base_tree.resolve()), ("this", HERE)):
                out = Path(tmp) / f"{name}-{side}"
                print(f"== {name}: {side} ({tree})", flush=True)
                runs[side] = train(tree, args.recipe, sets, extra, args.data_dir, out)
            same, differ = compare_weights(Path(tmp) / f"{name}-base" / "model.pt",
                                           Path(tmp) / f"{name}-this" / "model.pt")
            ok &= same and runs["base"]["test_acc"] == runs["this"]["test_acc"]
            record["settings"].append({"setting": name, "sets": sets, "runs": runs, "identical": same,
                                       "differing_tensors": differ,
                                       "same_test_acc": runs["base"]["test_acc"] == runs["this"]["test_acc"]})
            print(f"{name}: weights {'identical' if same else 'DIFFER: ' + ', '.join(differ[:5])}; test accuracy "
                  f"{runs['base']['test_acc']:.4%} / {runs['this']['test_acc']:.4%}", flush=True)
            atomic_write_json(args.out, record)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
