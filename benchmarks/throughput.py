"""Training throughput on one device: a recipe's model step alone against what feeds it, on a
synthetic folder of photo-like JPEGs. ``pipelines``: one Session's step alone, then fed by the
streamed pipeline and by the folder decoded once on the GPU; ``runs``: whole ``speedrun train``
processes against their model step alone. Usage and what each figure covers: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from speedrun.data.pipeline.dataset import open_source  # noqa: E402
from speedrun.data.pipeline.stream import default_workers  # noqa: E402
from speedrun.data.sources.folder import simplejpeg  # noqa: E402
from speedrun.engine.loop import Session  # noqa: E402
from speedrun.engine.plan import plan_run  # noqa: E402
from speedrun.engine.runtime import compiled_graphs, device_name, pick_device  # noqa: E402
from speedrun.engine.sizes import resized_in_step, step_image_shapes  # noqa: E402
from speedrun.errors import DataError, SpeedrunError  # noqa: E402
from speedrun.files import atomic_write_json, check_output_file  # noqa: E402
from speedrun.profiling.busy import profiled_busy  # noqa: E402
from speedrun.profiling.step_structure import real_batches  # noqa: E402
from speedrun.recipe import load_recipe  # noqa: E402
from speedrun.report.environment import machine  # noqa: E402

PROG = "throughput"
BOUND_SHARE = 0.9
BAR = (f"model-bound where the pipeline-fed steps reach {BOUND_SHARE:.0%} of the model step's images/s alone, "
       "else pipeline-bound")


def refuse(message, code: int = 2):
    """One line on stderr, then exit ``code``: 2 for a bad argument (nothing written), 1 once running."""
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(code)


# --- Synthetic photo folders ------------------------------------------------------------

_NOISE: dict = {}


def write_photo(path: str, seed: int, width: int, height: int, quality: int) -> int:
    """A JPEG at ``path`` that compresses about as a photograph does (smooth random colour fields, noise
    of sigma 12 grey levels): about 95 kB at 500 x 375, quality 90; noise alone would decode slower."""
    rng = np.random.default_rng(seed)

    def field(cells: int, amplitude: int) -> np.ndarray:
        gh, gw = max(2, height // cells), max(2, width // cells)
        small = rng.integers(128 - amplitude, 128 + amplitude + 1, (gh, gw, 3), dtype=np.uint8)
        return np.asarray(Image.fromarray(small, "RGB").resize((width, height), Image.BICUBIC)).astype(np.int16) - 128

    if (height, width) not in _NOISE:                 # one noise array per process, a window of it per image
        _NOISE[height, width] = np.random.default_rng(0).normal(0, 12, (2 * height, 2 * width, 3)).astype(np.int16)
    oy, ox = rng.integers(0, height), rng.integers(0, width)
    img = rng.integers(60, 190, 3).astype(np.int16) + field(96, 90) + field(4, 60)
    img += _NOISE[height, width][oy:oy + height, ox:ox + width]
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB").save(path, "JPEG", quality=quality)
    return os.path.getsize(path)


def photo_folder(root: Path, args, train_per_class: int) -> dict:
    """train/cNNNN/*.jpg and val/cNNNN/*.jpg under ``root`` (ImageNet's layout) of ``args.classes``,
    image i of size ``args.sizes[i % len(sizes)]``, written by forked workers (one per core)."""
    classes, val_per_class, sizes, quality, jobs = args.classes, args.val_per_class, args.sizes, args.quality, []
    for split, per in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"c{c:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per):
                w, h = sizes[(c * per + i) % len(sizes)]
                jobs.append((str(folder / f"{split}_{c:04d}_{i:05d}.jpg"), len(jobs), w, h, quality))
    t0, processes = time.perf_counter(), os.cpu_count() or 1
    if len(jobs) < 64 or processes == 1:
        written = [write_photo(*job) for job in jobs]
    else:                                  # forked before this process has run any torch op
        with mp.get_context("fork").Pool(processes) as pool:
            written = pool.starmap(write_photo, jobs, chunksize=max(1, len(jobs) // (processes * 8)))
    return {"classes": classes, "train_per_class": train_per_class, "val_per_class": val_per_class,
            "train_images": classes * train_per_class, "val_images": classes * val_per_class, "jpeg_quality": quality,
            "sizes_wxh": [f"{w}x{h}" for w, h in sizes], "mean_bytes": float(np.mean(written)) if written else 0.0,
            "total_bytes": int(sum(written)), "write_seconds": time.perf_counter() - t0, "write_processes": processes,
            "content": "smooth random colour fields plus noise (photo-like compression), not real photos"}


# --- Timing on the device: blocks of steps, the model step alone ------------------------

def timed_region(session, once, args, batch: int, profile: bool = True) -> dict:
    """``args.repeats`` blocks of ``args.steps`` calls of ``once`` (a training step, rewound before each
    block, synchronised at both ends) after ``args.warm`` untimed ones; then ``args.profile_steps`` profiled."""
    rt, step, graphs = session.runtime, session.step, compiled_graphs()
    step.rewind()
    for _ in range(args.warm):
        once()
    seconds = []
    for _ in range(args.repeats):
        step.rewind()
        rt.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            once()
        rt.synchronize()
        seconds.append(time.perf_counter() - t0)
    per_second = [args.steps * batch / s for s in seconds]
    out = {"batch": batch, "steps_per_block": args.steps, "warm_steps": args.warm, "block_seconds": seconds,
           "images_per_second": per_second, "images_per_second_median": float(np.median(per_second)),
           "seconds_per_step_median": float(np.median(seconds)) / args.steps}
    if profile and args.profile_steps:
        step.rewind()
        out["busy"] = profiled_busy(rt, once, args.profile_steps)
    return {**out, "graphs_compiled_during": compiled_graphs() - graphs}


def model_step(session, side: int, args, profile: bool = True, in_step_size: int | None = None) -> dict:
    """The session's TrainStep on one device-resident random batch of ``side`` px (shrunk to ``in_step_size``)."""
    rt, src, batch = session.runtime, session.source, session.local_batch
    gen = torch.Generator(device=rt.device).manual_seed(0)
    x = torch.randn(batch, src.in_channels, side, side, generator=gen, device=rt.device)
    x = x.to(rt.dtype).contiguous(memory_format=rt.memory_format)
    y = torch.randint(0, src.num_classes, (batch,), generator=gen, device=rt.device)
    session.reset(0)
    session.step.reset(0)

    def once():
        rt.mark_step()
        session.step(x, y, in_step_size)
    return {"side": side, **timed_region(session, once, args, batch, profile)}


def bound(pipeline_rate: float, model_rate: float) -> dict:
    """Which side bounds pipeline-fed steps (the record's ``bar``): their images/s against the model step's alone."""
    ratio = pipeline_rate / model_rate
    return {"pipeline_over_model": ratio, "bound_by": "model" if ratio >= BOUND_SHARE else "pipeline"}


# --- pipelines: one Session, its step alone and fed by each pipeline --------------------

def fed_region(session, args) -> dict:
    """The session's step, each batch from its source's pipeline as a run takes it."""
    batches = real_batches(session)

    def once():
        x, y, size = next(batches)
        session.runtime.mark_step()
        session.step(x, y, size)
    out = timed_region(session, once, args, session.recipe.data.batch_size)
    batches.close()                     # the pipeline and its workers go with the generator
    gc.collect()
    taken = args.warm + args.repeats * args.steps + args.profile_steps
    return {**out, "epochs_started": math.ceil(taken / session.steps_per_epoch)}


def pipelines(args, recipes, device, work: Path, made: dict) -> dict:
    folder = work / "photos"
    plan = plan_run(load_recipe(recipes[0], overrides(args, folder, "data.cache='off'")), folder, device)
    recipe, runtime = plan.recipe, plan.runtime
    t0 = time.perf_counter()
    session = Session(recipe, plan.source, runtime, warm_up=True)
    build = time.perf_counter() - t0
    params = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
    alone = model_step(session, recipe.data.image_size, args)
    rate = alone["images_per_second_median"]
    print(f"{recipe.name}: {params:,} parameters, {runtime.precision}, built and warmed up in {build:.1f} s; model "
          f"step alone: {rate:,.0f} images/s, busy {alone['busy']['busy_fraction']:.2f}", flush=True)
    n, decoder = default_workers(recipe.data.workers), recipe.data.decoder
    if decoder in ("auto", "simplejpeg"):                   # (simplejpeg: None where it is not installed)
        decoder = f"simplejpeg (data.decoder={decoder})" if simplejpeg else "Pillow (simplejpeg is not installed)"
    workers = f"{n} process" + "es" * (n != 1) if n else "in this process (data.workers=0)"
    streamed = {"pipeline": "streamed", "decoding": f"CPU workers: {workers}, {decoder}",
                "overrides": ["data.cache='off'"], **fed_region(session, args)}
    on_device = {"pipeline": "streamed, each batch decoded and cropped on the device (torchvision)",
                 "overrides": ["data.cache='off'", "data.decoder='torchvision'"]}
    try:
        if args.no_gpu_decode:
            raise DataError("left out (--no-gpu-decode)")
        r_dev = load_recipe(recipes[0], overrides(args, folder, *on_device["overrides"]))
        session.recipe, session.source = open_source(r_dev, folder)   # (refuses a missing torchvision in one line)
        on_device.update(available=True, decoding=f"torchvision on {device.type}, every epoch, host threads "
                         "reading the next batch", **fed_region(session, args))
    except DataError as err:
        on_device.update(available=False, why=str(err))
    gpu = {"pipeline": "decoded once on the device (torchvision), then cropped on the device",
           "overrides": ["data.cache='on'", "data.decoder='torchvision'"]}
    try:
        if args.no_gpu_decode:
            raise DataError("left out (--no-gpu-decode)")
        decode_device = "cuda" if torch.cuda.is_available() else "cpu"       # (speedrun data prepare's rule)
        r_gpu = load_recipe(recipes[0], overrides(args, folder, *gpu["overrides"],
                                                  f"data.cache_dir={str(work / 'cache')!r}"))
        t0 = time.perf_counter()
        session.recipe, session.source = open_source(r_gpu, folder)     # (the last region: fed from the cache)
        seconds, n = time.perf_counter() - t0, made["train_images"] + made["val_images"]
        gpu.update(available=True, decoding=f"torchvision on {decode_device}, once, into a cache at "
                   f"{session.source.stored_size[0]} px (shorter side resized, centre square)",
                   decode={"device": decode_device, "images": n, "seconds": seconds,
                           "images_per_second": n / seconds, "cache": session.source.cache},
                   **fed_region(session, args))
    except DataError as err:
        gpu.update(available=False, why=str(err))
    for p in (streamed, on_device, gpu):
        if p.get("available", True):
            p.update(bound(p["images_per_second_median"], rate))
        print(f"{p['pipeline']}: " + (f"{p['images_per_second_median']:,.0f} images/s ({p['pipeline_over_model']:.2f}"
              f" of the model step; {p['bound_by']}-bound)" if "bound_by" in p else f"not available ({p['why']})"))
    return {
        "benchmark": "ResNet-50 training throughput on one device: the model step alone and fed by speedrun's "
                     "pipelines from a synthetic ImageNet-like JPEG folder",
        "timed": {"model_step": "the TrainStep on one device-resident random batch, blocks synchronised at both ends",
                  "pipelines": "the same step and blocks, each batch from the pipeline as a run takes it (and its "
                               "workers' start in the warm steps)",
                  "busy": "profile steps after the blocks under torch.profiler (see busy.what)",
                  "decode": "open_source with data.cache=on, data.decoder=torchvision: every file decoded once"},
        "bar": BAR, "recipe": recipe.name, "recipe_config": recipe.to_dict(), "runtime": runtime.describe(),
        "batch": recipe.data.batch_size, "image_size": recipe.data.image_size, "params": params,
        "build_and_warm_up_seconds": build, "compile_seconds": session.compile_seconds,
        "model_step": alone, "pipelines": [streamed, on_device, gpu],
        "scale_input": {"images_per_second": rate, "batch_per_gpu": recipe.data.batch_size, "params": params,
                        "recipe": recipe.name, "device_name": device_name(device), "device": device.type,
                        "precision": runtime.precision, "image_size": recipe.data.image_size,
                        "what": "the model step alone: median images/s of the timed blocks"}}


def overrides(args, folder: Path | None, *extra: str) -> list[str]:
    own = ["data.dataset='folder'", f"data.batch_size={args.batch}", f"data.image_size={args.size}"]
    own += [f"data.workers={args.workers}"] if args.workers is not None else []
    own += [f"data.path={str(folder)!r}"] if folder is not None else []
    return own + list(extra) + list(args.sets)


# --- runs: whole speedrun train processes against their model step ----------------------

SUMMARY_TIMES = ("train_seconds", "final_eval_seconds", "compile_seconds", "monitor_seconds", "bookkeeping_seconds",
                 "wall_seconds", "recompiles", "steps", "batch_size", "epochs", "precision", "compile", "compile_mode",
                 "cuda_graphs", "channels_last", "device_name", "data_choices", "data_cache")


def child(cmd: list[str], work: Path, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """``cmd`` run to its end in ``work`` with this tree's src/ first; the process, its wall seconds."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work,
                          env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **env})
    return proc, time.perf_counter() - t0


def model_step_child(args) -> int:
    """(Its own process) a run's TrainStep alone at each of its training sizes, from its config.toml; to --out."""
    plan = plan_run(load_recipe(str(args.model_step)), None, pick_device(args.device), fit_batch=False)
    recipe, source, runtime = plan.recipe, plan.source, plan.runtime
    t0 = time.perf_counter()
    session = Session(recipe, source, runtime, warm_up=True)
    build = time.perf_counter() - t0
    sizes = Counter(h for h, _ in step_image_shapes(recipe, session.source.image_size, session.total_steps,
                                                        session.steps_per_epoch))
    full, in_step = source.image_size[0], resized_in_step(recipe)
    per_size = [{"train_size": side, "run_steps": n,
                 **model_step(session, full if in_step else side, args, side == full, side if in_step else None)}
                for side, n in sorted(sizes.items())]
    cache = getattr(source, "cache", None)
    atomic_write_json(args.out, {
        "build_and_warm_up_seconds": build, "compile_seconds": session.compile_seconds,
        "run_cache_reused": (not cache["cache_made_now"]) if cache else None, "runtime": runtime.describe(),
        "total_steps": session.total_steps, "batch": recipe.data.batch_size, "per_size": per_size,
        "model_seconds_for_the_run": sum(r["run_steps"] * r["seconds_per_step_median"] for r in per_size),
        "recipe_config": recipe.to_dict()})
    return 0


def model_step_process(run_dir: Path, work: Path, env: dict, args) -> dict:
    result = work / f"model-step-{run_dir.name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "runs", "--model-step", str(run_dir / "config.toml"),
           "--out", str(result), *[a for k in ("steps", "repeats", "warm", "profile_steps")
                                      for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]]
    proc, wall = child(cmd + (["--device", args.device] if args.device else []), work, env)
    out = {"process_wall_seconds": wall, "exit_code": proc.returncode, "ok": not proc.returncode}
    return {**out, **(json.loads(result.read_text()) if out["ok"] else {"stderr_tail": proc.stderr[-3000:]})}


def whole_runs(args, recipes, device, work: Path, made: dict) -> dict:
    """``speedrun train RECIPE`` in its own process per run (an empty decoded-folder cache), then its model step."""
    runs, steps = [], {}
    for recipe in recipes:
        for i in range(args.runs):
            run_dir, env = work / f"run-{recipe}-{i}", {"SPEEDRUN_CACHE": str(work / f"cache-{recipe}-{i}")}
            env.update({"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{recipe}-{i}")} if args.cold_compile else {})
            cmd = [sys.executable, "-m", "speedrun", "train", recipe, "--data-dir", str(work / "photos"),
                   "--out", str(run_dir), *(["--device", args.device] if args.device else []),
                   *[a for s in args.sets for a in ("--set", s)]]
            proc, wall = child(cmd, work, env)
            shown = " ".join(["speedrun", *cmd[3:]]).replace(str(work / "photos"), "SYNTH")
            row = {"recipe": recipe, "run": i, "command": shown.replace(str(work), "WORK"),
                   "process_wall_seconds": wall, "exit_code": proc.returncode, "ok": not proc.returncode}
            runs.append(row)
            if proc.returncode:
                row["stderr_tail"] = proc.stderr[-3000:]
                print(f"{recipe} run {i}: FAILED (exit {proc.returncode}): {proc.stderr[-300:]}", flush=True)
                continue
            summary = json.loads((run_dir / "summary.json").read_text())
            metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            images = summary["steps"] * summary["batch_size"]
            training = summary["train_seconds"] - summary["final_eval_seconds"]
            row.update(summary={k: summary.get(k) for k in SUMMARY_TIMES}, images=images, training_seconds=training,
                       epoch_seconds=[m.get("seconds") for m in metrics], pipeline_images_per_second=images / training)
            step = steps[recipe] = steps.get(recipe) or model_step_process(run_dir, work, env, args)
            if step["ok"]:
                model_rate = images / step["model_seconds_for_the_run"]
                row.update(model_step_seconds_for_the_run=step["model_seconds_for_the_run"],
                           model_step_images_per_second=model_rate, **bound(images / training, model_rate))
            print(f"{recipe} run {i}: process {wall:.1f} s, train_seconds {summary['train_seconds']:.1f}, pipeline "
                  f"{images / training:,.0f} images/s" + (f", model step {row['model_step_images_per_second']:,.0f}"
                  f" images/s ({row['bound_by']}-bound)" if step["ok"] else ", model step FAILED"), flush=True)
    return {
        "benchmark": "speedrun train on Imagenette-shaped synthetic photos: the whole process and its pipeline-fed "
                     "images/s against the model step's alone",
        "timed": {"process_wall_seconds": "each speedrun train process, from outside: start to exit",
                  "pipeline_images_per_second": "steps x batch / (train_seconds - final_eval_seconds)",
                  "model_step": "the run's TrainStep alone (another process) at each training size; its images/s: "
                                "steps x batch / the sum over sizes of the run's steps x median seconds per step"},
        "bar": BAR, "recipes": recipes, "overrides": args.sets, "cold_compile": args.cold_compile, "runs": runs,
        "model_step": steps, "failed": [f"{r['recipe']} run {r['run']}" for r in runs if not r["ok"]]
        + [f"{k} model step" for k, v in steps.items() if not v["ok"]]}


# --- Command line -----------------------------------------------------------------------

MODES = {  # the defaults: an ImageNet-like folder, one shaped like the Imagenette copy
    "pipelines": dict(recipes="imagenet-resnet50", classes=1000, images_per_class=None, val_per_class=1,
                      sizes=[(500, 375)] * 3 + [(375, 500)], quality=90, warm=5),
    "runs": dict(recipes="imagenette,folder", classes=10, images_per_class=947, val_per_class=393, sizes=[(224, 224)],
                 quality=75, warm=3),
}


def parse(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.error = refuse                                    # (argparse's own errors in one line too)
    sub = p.add_subparsers(dest="mode", required=True)
    for name, defaults in MODES.items():
        m = sub.add_parser(name, help=f"default recipe(s): {defaults['recipes']}")
        m.error = refuse                                # (and each mode's)
        a, d, one = m.add_argument, " (default %(default)s)", name == "pipelines"
        a("--recipe" if one else "--recipes", dest="recipes", help=("the recipe" if one else "comma-separated") + d)
        a("--steps", type=int, default=20, help="steps per timed block" + d)
        a("--repeats", type=int, default=3, help="timed blocks per region or training size" + d)
        a("--warm", type=int, help="untimed steps before the blocks" + d)
        a("--profile-steps", type=int, default=5, help="steps under torch.profiler" + d)
        a("--classes", type=int, help="class folders" + d)
        a("--images-per-class", type=int, help="training JPEGs per class" + ("" if one else d))
        a("--val-per-class", type=int, help="validation JPEGs per class" + d)
        a("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
        a("--device", choices=["cuda", "cpu"], help="default: cuda when available")
        a("--commit", help="the commit the record names (default: $SPEEDRUN_COMMIT, else git rev-parse HEAD)")
        a("--out", type=Path, required=True, help="the JSON record (an existing file is refused)")
        m.set_defaults(**defaults)
    a = sub.choices["pipelines"].add_argument
    a("--batch", type=int, default=256, help="images per step (data.batch_size; default %(default)s)")
    a("--size", type=int, default=224, help="training side in px (data.image_size; default %(default)s)")
    a("--workers", type=int, help="decoding worker processes (data.workers; default the recipe's)")
    a("--no-gpu-decode", action="store_true", help="leave out the region decoded on the GPU")
    a = sub.choices["runs"].add_argument
    a("--runs", type=int, default=1, help="training processes per recipe (default %(default)s)")
    a("--cold-compile", action="store_true", help="each process with an empty inductor cache")
    a("--model-step", type=Path, help=argparse.SUPPRESS)      # child: a run's config.toml; its figures to --out
    return p.parse_args(argv)


def check(args) -> list[str]:
    """The refusals that need no recipe and no device, each naming its option; the recipes."""
    pipes, recipes = args.mode == "pipelines", [r.strip() for r in args.recipes.split(",") if r.strip()]
    positive = ["steps", "repeats", "val_per_class", *(["batch", "profile_steps"] if pipes else ["runs"])]
    for name in positive + (["images_per_class"] if args.images_per_class is not None else []):
        if getattr(args, name) < 1:
            refuse(f"--{name.replace('_', '-')} {getattr(args, name)}: must be 1 or more")
    for bad, says in ((args.classes < 2, f"--classes {args.classes}: a classifier needs at least 2"),
                      (args.warm < 0 or args.profile_steps < 0, "--warm and --profile-steps must be 0 or more"),
                      (pipes and args.size < 8, f"--size {pipes and args.size}: must be at least 8 px"),
                      (pipes and len(recipes) > 1, f"--recipe {args.recipes!r}: one recipe"),
                      (not recipes, f"--recipes {args.recipes!r}: name at least one recipe")):
        if bad:
            refuse(says)
    return recipes


def run(args) -> int:
    started, recipes = time.perf_counter(), check(args)
    try:
        for r in recipes:                               # a bad name or --set stops here, naming it
            first = load_recipe(r, overrides(args, None) if args.mode == "pipelines" else args.sets)
        device = pick_device(args.device)
        check_output_file(args.out, "--out")
    except SpeedrunError as err:
        refuse(err)
    env = machine(args.commit)                          # (the commit that runs, read before it runs)
    per_class = args.images_per_class or math.ceil(
        (args.warm + args.repeats * args.steps + args.profile_steps) * first.data.batch_size / args.classes) + 1
    with tempfile.TemporaryDirectory(prefix=f"throughput-{args.mode}-") as work:
        made = photo_folder(Path(work) / "photos", args, per_class)
        print(f"wrote {made['train_images'] + made['val_images']:,} JPEGs ({made['mean_bytes'] / 1e3:.1f} kB each) "
              f"in {made['write_seconds']:.1f} s", flush=True)
        body = (pipelines if args.mode == "pipelines" else whole_runs)(args, recipes, device, Path(work), made)
    failed = body.pop("failed", [])
    record = {"benchmark": body.pop("benchmark"), "script": f"benchmarks/throughput.py {args.mode}",
              "commit": env["commit"], "commit_source": env["commit_source"], "device": str(device),
              "device_name": device_name(device), **body, "photos": made,
              "total_seconds": time.perf_counter() - started, "environment": env}
    atomic_write_json(args.out, record)
    print(f"record: {args.out}")
    if failed:
        print(f"{PROG}: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    args = parse(argv)
    try:
        return model_step_child(args) if args.mode == "runs" and args.model_step else run(args)
    except SpeedrunError as err:                         # trouble once running: no record
        refuse(err, code=1)


if __name__ == "__main__":
    sys.exit(main())
