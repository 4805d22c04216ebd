"""Imagenette-shaped photos on one device: does `speedrun train` feed its model as fast as the
model trains alone? The whole training process against the model step on device-resident
random tensors, per recipe.

    python benchmarks/photo_throughput.py [--recipes imagenette,folder] [--images-per-class 947]
        [--val-per-class 393] [--runs 1] [--set KEY=VALUE ...] [--device cuda|cpu]
        [--commit SHA] [--out FILE]

A synthetic folder shaped like the project's Imagenette copy (benchmarks/README.md: 224 x 224
JPEGs at quality 75, squashed, 10 classes, 9,469 training and 3,925 validation images; here
``--images-per-class`` and ``--val-per-class`` per class, default the copy's counts rounded to
947 and 393) is written with Pillow into a temporary folder. Then, for each recipe (default
``imagenette`` and ``folder``, which chooses the imagenette settings for photos) and each of
``--runs`` runs:

1. ``speedrun train RECIPE --data-dir SYNTH`` in its own process (the recipe's own epochs,
   5, unless ``--set train.epochs=...``), with an empty decoded-folder cache
   ($SPEEDRUN_CACHE in the work folder: the one-time decoding happens inside the process, as
   on a user's first run; the compile cache is the machine's, ``--cold-compile`` gives each
   process an empty one). Timed: the whole process (interpreter start to exit, from outside),
   and from its summary.json ``train_seconds`` and its parts. The **pipeline's images/s** are
   the training images (steps x batch) over the training seconds (``train_seconds`` less the
   final evaluation; monitoring evaluations and bookkeeping are already paused out of it).
2. the **model step alone**, in another process: the run's resolved recipe (its
   config.toml) and its cache, a Session built as the run built it, and its TrainStep timed
   on one device-resident random batch at each training size the run used (progressive
   resizing), ``--repeats`` blocks of ``--steps`` steps, synchronised; the run's steps at
   each size times that size's median seconds per step give the model-only seconds, and
   training images over them the model step's images/s.

Their ratio (pipeline over model step) is recorded with the bar it is held to: the pipeline-fed
run at 90% of the model step's images/s or more. Accuracy on synthetic data means nothing and
is not recorded. The record names the device, its clocks as found, torch, CUDA and cuDNN, the
commit (``--commit``, else $SPEEDRUN_COMMIT, else git; read at start), every run and each
process's command. Default ``--out``: benchmarks/results/photo-throughput-<device>-<commit>.json.
A bad argument stops before anything is written: one line, exit code 2. On a CPU it runs at
tiny sizes, e.g. ``--device cpu --images-per-class 6 --val-per-class 2 --set data.image_size=32
--set data.eval_size=40 --set data.batch_size=8 --set model.width=8 --set train.epochs=3
--set runtime.compile=off``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from imagenet_throughput import (BOUND_SHARE, ROOT, OneLineParser, Refused, bound, device_label, guarded,  # noqa: E402
                                 model_step, parse_wxh, photo_folder, record_path)
from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.report.environment import machine, read_commit  # noqa: E402

PROG = "photo_throughput"

SUMMARY_TIMES = ("train_seconds", "final_eval_seconds", "compile_seconds", "monitor_seconds", "bookkeeping_seconds",
                 "wall_seconds", "recompiles", "steps", "batch_size", "epochs", "precision", "compile", "compile_mode",
                 "cuda_graphs",
                 "channels_last", "device_name", "data_choices", "data_cache")


def parse(argv):
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="imagenette,folder", help="comma-separated (default imagenette,folder)")
    p.add_argument("--classes", type=int, default=10, help="class folders (default 10, Imagenette's)")
    p.add_argument("--images-per-class", type=int, default=947, help="training JPEGs per class (default 947)")
    p.add_argument("--val-per-class", type=int, default=393, help="validation JPEGs per class (default 393)")
    p.add_argument("--photo", default="224x224", help="WIDTHxHEIGHT of every JPEG (default 224x224)")
    p.add_argument("--quality", type=int, default=75, help="JPEG quality (default 75)")
    p.add_argument("--runs", type=int, default=1, help="training processes per recipe (default 1)")
    p.add_argument("--steps", type=int, default=20, help="model step: steps per timed block (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="model step: timed blocks per size (default 3)")
    p.add_argument("--warm", type=int, default=3, help="model step: untimed steps before the blocks (default 3)")
    p.add_argument("--profile-steps", type=int, default=5, help="model step: steps under torch.profiler at the full "
                   "training size (default 5; 0 = none)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every training process (repeatable)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--cold-compile", action="store_true", help="each process with an empty inductor cache")
    p.add_argument("--commit", help="the commit the record names (default: $SPEEDRUN_COMMIT, else git rev-parse HEAD)")
    p.add_argument("--out", type=Path, help="the JSON record (default: benchmarks/results/photo-throughput-"
                   "<device>-<commit>.json); never overwritten")
    p.add_argument("--model-step", type=Path, help=argparse.SUPPRESS)      # child: a run's config.toml
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)          # child: where its figures go
    return p.parse_args(argv)


def check(args) -> list[str]:
    for name in ("classes", "images_per_class", "val_per_class", "runs", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise Refused(f"--{name.replace('_', '-')} {getattr(args, name)}: must be 1 or more")
    if args.classes < 2:
        raise Refused(f"--classes {args.classes}: a classifier needs at least 2")
    if args.warm < 0 or args.profile_steps < 0:
        raise Refused("--warm and --profile-steps must be 0 or more")
    if not 1 <= args.quality <= 100:
        raise Refused(f"--quality {args.quality}: JPEG quality is 1 to 100")
    bad = [s for s in args.sets if "=" not in s]
    if bad:
        raise Refused(f"--set {bad[0]!r}: expected KEY=VALUE")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise Refused(f"--recipes {args.recipes!r}: name at least one recipe")
    return recipes


def child_env(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def tail(text: str, n: int = 3000) -> str:
    return text[-n:] if text else ""


# ------------------------------------------------------------------------------------------
# The model step alone (a child process)
# ------------------------------------------------------------------------------------------

def model_step_child(args) -> int:
    """Time a run's TrainStep alone at each of its training sizes; figures to --result."""
    from speedrun.engine.loop import Session
    from speedrun.engine.plan import plan_run
    from speedrun.engine.runtime import pick_device
    from speedrun.engine.sizes import resized_in_step, step_image_shapes
    from speedrun.files import atomic_write_json
    from speedrun.recipe import load_recipe
    recipe = load_recipe(str(args.model_step))
    # the run's cache, already made (same $SPEEDRUN_CACHE); the run's batch, already fitted
    plan = plan_run(recipe, None, pick_device(args.device), fit_batch=False)
    recipe, source, runtime = plan.recipe, plan.source, plan.runtime
    t0 = time.perf_counter()
    session = Session(recipe, source, runtime, warm_up=True)
    build = time.perf_counter() - t0
    sizes = Counter(h for h, _ in step_image_shapes(recipe, session.source.image_size, session.total_steps,
                                                        session.steps_per_epoch))
    full = source.image_size[0]
    in_step = resized_in_step(recipe)
    per_size = []
    for side, n in sorted(sizes.items()):
        m = model_step(session, full if in_step else side, args.steps, args.repeats, args.warm,
                       args.profile_steps if side == full else 0, side if in_step else None)
        per_size.append({"train_size": side, "run_steps": n, **m})
    model_seconds = sum(r["run_steps"] * r["seconds_per_step_median"] for r in per_size)
    cache = getattr(source, "cache", None)
    atomic_write_json(args.result, {
        "build_and_warm_up_seconds": build, "compile_seconds": session.compile_seconds,
        "run_cache_reused": (not cache["cache_made_now"]) if cache else None,
        "runtime": {"precision": runtime.precision, "compile": runtime.compile, "compile_mode": runtime.compile_mode, "cuda_graphs": runtime.cuda_graphs,
                    "channels_last": runtime.channels_last},
        "total_steps": session.total_steps, "batch": recipe.data.batch_size, "per_size": per_size,
        "model_seconds_for_the_run": model_seconds, "recipe_config": recipe.to_dict()})
    return 0


# ------------------------------------------------------------------------------------------
# The parent
# ------------------------------------------------------------------------------------------

def train_process(recipe: str, folder: Path, work: Path, i: int, args) -> dict:
    run_dir = work / f"run-{recipe}-{i}"
    extra = {"SPEEDRUN_CACHE": str(work / f"cache-{recipe}-{i}")}
    if args.cold_compile:
        extra["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{recipe}-{i}")
    cmd = [sys.executable, "-m", "speedrun", "train", recipe, "--data-dir", str(folder), "--out", str(run_dir)]
    cmd += (["--device", args.device] if args.device else []) + [a for s in args.sets for a in ("--set", s)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(**extra), cwd=work)
    wall = time.perf_counter() - t0
    shown = " ".join(["speedrun", *cmd[3:]]).replace(str(folder), "SYNTH").replace(str(work), "WORK")
    row = {"recipe": recipe, "run": i, "command": shown,
           "process_wall_seconds": wall, "exit_code": proc.returncode}
    if proc.returncode:
        row.update(ok=False, stderr_tail=tail(proc.stderr))
        return row
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    training = summary["train_seconds"] - summary["final_eval_seconds"]
    images = summary["steps"] * summary["batch_size"]
    row.update(ok=True, summary={k: summary.get(k) for k in SUMMARY_TIMES},
               epoch_seconds=[m.get("seconds") for m in metrics], training_seconds=training, images=images,
               pipeline_images_per_second=images / training, run_dir=run_dir, cache_env=extra["SPEEDRUN_CACHE"])
    return row


def model_step_process(row: dict, args, work: Path) -> dict:
    result = work / f"model-step-{row['recipe']}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model-step", str(row["run_dir"] / "config.toml"),
           "--result", str(result), "--steps", str(args.steps), "--repeats", str(args.repeats),
           "--warm", str(args.warm), "--profile-steps", str(args.profile_steps)]
    cmd += ["--device", args.device] if args.device else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(SPEEDRUN_CACHE=row["cache_env"]),
                          cwd=work)
    out = {"process_wall_seconds": time.perf_counter() - t0, "exit_code": proc.returncode}
    if proc.returncode:
        return {**out, "ok": False, "stderr_tail": tail(proc.stderr)}
    return {**out, "ok": True, **json.loads(result.read_text())}


def compare(row: dict, step: dict) -> dict:
    """The run's pipeline-fed images/s against the model step's at the run's own sizes."""
    model_rate = row["images"] / step["model_seconds_for_the_run"]
    return {"model_step_seconds_for_the_run": step["model_seconds_for_the_run"],
            "model_step_images_per_second": model_rate,
            **bound(row["pipeline_images_per_second"], model_rate),
            "meets_bar": row["pipeline_images_per_second"] >= BOUND_SHARE * model_rate}


def run(args, commit, commit_source) -> int:
    from speedrun.files import atomic_write_json, check_output_file
    from speedrun.recipe import load_recipe

    started = time.perf_counter()
    recipes = check(args)                           # (refusals first: torch is not imported yet)
    size = parse_wxh(args.photo, "--photo")
    try:
        for r in recipes:                           # a bad name or --set stops here, naming it
            load_recipe(r, args.sets)
        if args.out:
            check_output_file(args.out, "--out")
        from speedrun.engine.runtime import pick_device
        device = pick_device(args.device)
        out = record_path("photo-throughput", args.out, device, commit)
    except SpeedrunError as err:
        raise Refused(err) from None
    env = machine(commit, commit_source)

    runs, steps = [], {}
    with tempfile.TemporaryDirectory(prefix="photo-throughput-") as work:
        work = Path(work)
        folder = work / "photos"
        made = photo_folder(folder, args.classes, args.images_per_class, args.val_per_class, [size], args.quality)
        print(f"wrote {made['train_images'] + made['val_images']:,} JPEGs of {args.photo} px "
              f"({made['mean_bytes'] / 1e3:.1f} kB each) in {made['write_seconds']:.1f} s", flush=True)
        for recipe in recipes:
            for i in range(args.runs):
                row = train_process(recipe, folder, work, i, args)
                if row["ok"] and recipe not in steps:
                    steps[recipe] = model_step_process(row, args, work)
                step = steps.get(recipe)
                if row["ok"] and step and step["ok"]:
                    row.update(compare(row, step))
                row.pop("run_dir", None)
                row.pop("cache_env", None)
                runs.append(row)
                if row["ok"]:
                    s = row["summary"]
                    print(f"{recipe} run {i}: process {row['process_wall_seconds']:.1f} s, train_seconds "
                          f"{s['train_seconds']:.1f} (compile {s['compile_seconds']:.1f} s before it), pipeline "
                          f"{row['pipeline_images_per_second']:,.0f} images/s"
                          + (f", model step {row['model_step_images_per_second']:,.0f} images/s: "
                             f"{row['pipeline_over_model']:.2f} ({row['bound_by']}-bound)"
                             if "model_step_images_per_second" in row else ", model step FAILED"), flush=True)
                else:
                    print(f"{recipe} run {i}: FAILED (exit {row['exit_code']}): {row['stderr_tail'][-300:]}",
                          flush=True)

    record = {
        "benchmark": "speedrun train on Imagenette-shaped synthetic photos: the whole process and its pipeline-fed "
                     "images/s against the model step's alone",
        "script": "benchmarks/photo_throughput.py", "commit": commit, "commit_source": commit_source,
        "device": str(device), "device_name": device_label(device),
        "timed": {
            "process_wall_seconds": "each speedrun train process from before its interpreter starts to its exit, "
                                    "measured from outside (start-up, decoding the folder into its cache, "
                                    "compiling, training, the final evaluation, writing the record)",
            "training_seconds": "summary.json's train_seconds less its final_eval_seconds: the training epochs "
                                "from the first touch of the data, monitoring evaluations and bookkeeping paused",
            "pipeline_images_per_second": "steps x batch / training_seconds",
            "model_step": "the run's TrainStep, built from its config.toml in another process, on one "
                          "device-resident random batch per training size: median seconds per step over the "
                          "blocks; model_step_seconds_for_the_run = sum over sizes of the run's steps at that "
                          "size x that median; model_step_images_per_second = steps x batch / that",
            "pipeline_over_model": "pipeline_images_per_second / model_step_images_per_second",
        },
        "bar": f"the pipeline-fed run reaches {BOUND_SHARE:.0%} of the model step's images/s (meets_bar)",
        "photos": {**made, "root": None, "train_per_class": args.images_per_class,
                   "val_per_class": args.val_per_class,
                   "content": "smooth random colour fields plus noise (photo-like compression), not real photos",
                   "shaped_like": "the project's Imagenette copy: 224 x 224 squashed JPEGs at quality 75, 10 classes, "
                                  "9,469 / 3,925 images"},
        "recipes": recipes, "overrides": args.sets, "cold_compile": args.cold_compile,
        "runs": runs, "model_step": steps,
        "total_seconds": time.perf_counter() - started,
        "environment": env,
    }
    atomic_write_json(out, record)
    print(f"record: {out}")
    failed = [f"{r['recipe']} run {r['run']}" for r in runs if not r["ok"]] + \
        [f"{k} model step" for k, v in steps.items() if not v["ok"]]
    if failed:
        print(f"{PROG}: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    def body():
        args = parse(sys.argv[1:] if argv is None else argv)
        if args.model_step:
            return model_step_child(args)
        return run(args, *read_commit(args.commit))        # (the commit that runs, read before it runs)
    return guarded(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
