"""ResNet-50 on ImageNet-like photos, on one device: the training step's images/s alone, then
fed by speedrun's pipelines from a folder of JPEGs, and which side bounds it.

    python benchmarks/imagenet_throughput.py [--batch 256] [--size 224] [--steps 20] [--repeats 3]
        [--classes 1000] [--images-per-class N] [--workers W] [--set KEY=VALUE ...]
        [--device cuda|cpu] [--commit SHA] [--out FILE]

One process, one Session of the recipe (default ``imagenet-resnet50``, the model, optimizer
and TrainStep exactly as ``speedrun train`` builds them, with the device's defaults: on CUDA
bf16, channels_last, compiled by inductor; warmed up before anything is timed):

1. **model step**: the training step alone on one device-resident random batch (``--batch``
   images of ``--size`` px in the compute dtype), ``--repeats`` blocks of ``--steps`` steps
   after ``--warm`` untimed ones, each block timed with the device synchronised at both ends:
   images/s of one device, and the busy fraction of ``--profile-steps`` more under
   torch.profiler (CUDA: the kernels' own time over the wall time).
2. **streamed**: the same step fed by the pipeline ``speedrun train`` streams a folder with
   (``data.dataset=folder``, ``data.cache=off``): worker processes (``--workers``, default
   the recipe's: one per core, at most 8) decode each JPEG and cut its random-resized crop,
   the batch is moved to the device and augmented there (flip, colour jitter, lighting;
   mixup inside the step); same blocks, same profile.
3. **decoded on the GPU**: speedrun decodes on the GPU only when it decodes a folder once
   into its cache (``data.decoder=torchvision`` with ``data.cache=on``: nvjpeg, then resized
   on the device); the cached, device-resident images are then cropped on the device batch by
   batch. Timed: the decoding (images/s) and the fed steps as above. Recorded as not available
   where torchvision cannot be imported. (Streamed workers read ``decoder=torchvision`` as
   Pillow, so there is no streamed GPU-decoding pipeline to time.)

The folder is synthetic: ``--classes`` class folders of ``--images-per-class`` photo-like JPEGs
of 500x375 px (every fourth 375x500; quality 90), written with Pillow into a temporary folder
at the start and deleted at the end; the default count holds every timed batch of a pipeline
in one epoch. For each pipeline the record gives its images/s against the model step's and
the side that bounds it (model-bound at 90% of the model step's rate or more). Its
``scale_input`` is what ``speedrun scale --step-record FILE`` reads: the model step's
images/s per device at this batch, and the model's parameters.

The record (JSON, written once at the end) names the device, its clocks as found, torch,
CUDA and cuDNN, the commit (``--commit``, else $SPEEDRUN_COMMIT, else git; read at start),
the resolved recipe and runtime, every block of every region, and published figures to
compare with. Default ``--out``: benchmarks/results/imagenet-throughput-<device>-<commit>.json.
A bad argument stops before anything is written: one line, exit code 2. On a CPU it runs at
tiny sizes, e.g. ``--device cpu --size 32 --batch 8 --steps 2 --images-per-class 4
--classes 2 --set model.width=8 --set runtime.compile=off``.

photo_throughput.py uses this file's synthetic photo folders, model-step timer, busy fraction
and one-line refusals.
"""
from __future__ import annotations

import argparse
import gc
import io
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.report.environment import machine, read_commit  # noqa: E402

BOUND_SHARE = 0.9
"""A pipeline whose fed steps reach this share of the model step's images/s alone is called
model-bound; below it, pipeline-bound."""


# ------------------------------------------------------------------------------------------
# Refusals: one line, exit code 2, nothing written
# ------------------------------------------------------------------------------------------

class Refused(Exception):
    """A bad argument or value: said in one line, exit code 2, before anything is written."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr (no usage block) and exit code 2."""

    def error(self, message):
        raise Refused(message)


def refusal(prog: str, err: Exception) -> int:
    print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
    return 2


def record_path(kind: str, given: Path | None, device, commit: str | None) -> Path:
    """--out, else benchmarks/results/KIND-<device>-<commit>.json; refused where it exists."""
    from speedrun.files import check_output_file
    name = slug(device_label(device) if device.type == "cuda" else f"cpu-{device_label(device)}")
    out = given or ROOT / "benchmarks" / "results" / f"{kind}-{name}-{(commit or 'nocommit')[:7]}.json"
    check_output_file(out, "--out")
    return out


def guarded(prog: str, body) -> int:
    """``body()``'s exit code; a refusal is one line and exit 2, trouble once running
    (data, device) one line and exit 1, with no record."""
    try:
        return body()
    except Refused as err:
        return refusal(prog, err)
    except SpeedrunError as err:
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1


def device_label(device) -> str:
    from speedrun.engine.runtime import device_name
    return device_name(device)


def slug(text: str) -> str:
    out = "".join(c.lower() if c.isalnum() else "-" for c in text)
    return "-".join(p for p in out.split("-") if p)[:40] or "device"


# ------------------------------------------------------------------------------------------
# Synthetic photo folders
# ------------------------------------------------------------------------------------------

_NOISE: dict = {}


def photo_bytes(seed: int, width: int, height: int, quality: int) -> bytes:
    """A JPEG that compresses about as a photograph does: a flat colour, smooth random colour
    fields (coarse blobs and finer texture, upsampled bicubically) and per-pixel noise
    (sigma 12 grey levels, one array per process, a window of it per image). At 500 x 375 and
    quality 90 the files are about 95 kB, at 224 x 224 and quality 75 about 13 kB; noise alone
    would make them several times larger and slower to decode than photographs."""
    rng = np.random.default_rng(seed)

    def field(cells: int, amplitude: int) -> np.ndarray:
        gh, gw = max(2, height // cells), max(2, width // cells)
        small = rng.integers(128 - amplitude, 128 + amplitude + 1, (gh, gw, 3), dtype=np.uint8)
        big = Image.fromarray(small, "RGB").resize((width, height), Image.BICUBIC)
        return np.asarray(big).astype(np.int16) - 128

    key = (height, width)
    if key not in _NOISE:
        _NOISE[key] = np.random.default_rng(0).normal(0, 12, (2 * height, 2 * width, 3)).astype(np.int16)
    oy, ox = rng.integers(0, height), rng.integers(0, width)
    img = rng.integers(60, 190, 3).astype(np.int16) + field(96, 90) + field(4, 60)
    img += _NOISE[key][oy:oy + height, ox:ox + width]
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _write(job) -> int:
    path, seed, width, height, quality = job
    data = photo_bytes(seed, width, height, quality)
    Path(path).write_bytes(data)
    return len(data)


def photo_folder(root: Path, classes: int, train_per_class: int, val_per_class: int, sizes: list[tuple[int, int]],
                 quality: int, processes: int | None = None) -> dict:
    """train/cNNNN/*.jpg and val/cNNNN/*.jpg under ``root`` (the layout of ImageNet's folders
    and speedrun's ``folder`` data set): image i takes its (width, height) from ``sizes`` in
    turn. Written by ``processes`` forked workers (default: every core). Returns what was
    written and how long it took."""
    jobs = []
    for split, per in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"c{c:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per):
                w, h = sizes[(c * per + i) % len(sizes)]
                jobs.append((str(folder / f"{split}_{c:04d}_{i:05d}.jpg"), len(jobs), w, h, quality))
    t0 = time.perf_counter()
    processes = processes or os.cpu_count() or 1
    if len(jobs) < 64 or processes == 1:
        written = [_write(j) for j in jobs]
    else:                                  # forked before this process has run any torch op
        with mp.get_context("fork").Pool(processes) as pool:
            written = pool.map(_write, jobs, chunksize=max(1, len(jobs) // (processes * 8)))
    seconds = time.perf_counter() - t0
    return {"root": str(root), "classes": classes, "train_images": classes * train_per_class,
            "val_images": classes * val_per_class, "sizes_wxh": [f"{w}x{h}" for w, h in sizes],
            "jpeg_quality": quality, "mean_bytes": float(np.mean(written)) if written else 0.0,
            "total_bytes": int(sum(written)), "write_seconds": seconds, "write_processes": processes}


def parse_wxh(text: str, option: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise Refused(f"{option} {text!r}: expected WIDTHxHEIGHT in pixels, e.g. 500x375") from None
    if w < 8 or h < 8:
        raise Refused(f"{option} {text}: each side must be at least 8 pixels")
    return w, h


# ------------------------------------------------------------------------------------------
# Timing on the device
# ------------------------------------------------------------------------------------------

def random_batch(session, side: int, seed: int = 0):
    """A device-resident random batch as the step receives it: normalised-looking values in
    the compute dtype and the runtime's memory layout, labels of the data set's classes."""
    import torch
    rt, src = session.runtime, session.source
    gen = torch.Generator(device=rt.device)
    gen.manual_seed(seed)
    batch = session.local_batch
    x = torch.randn(batch, src.in_channels, side, side, generator=gen, device=rt.device)
    x = x.to(rt.dtype).contiguous(memory_format=rt.memory_format)
    y = torch.randint(0, src.num_classes, (batch,), generator=gen, device=rt.device)
    return x, y


def timed_blocks(rt, step_once, steps: int, repeats: int, warm: int, before_block=None) -> list[float]:
    """Seconds of each of ``repeats`` blocks of ``steps`` calls of ``step_once`` (the device
    synchronised before and after each block), after ``warm`` untimed calls.
    ``before_block()`` runs untimed before the warm calls and before each block."""
    if before_block:
        before_block()
    for _ in range(warm):
        step_once()
    out = []
    for _ in range(repeats):
        if before_block:
            before_block()
        rt.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step_once()
        rt.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def model_step(session, side: int, steps: int, repeats: int, warm: int, profile_steps: int = 0,
               in_step_size: int | None = None) -> dict:
    """The training step alone (the session's own TrainStep: forward, loss, backward,
    optimizer, averaging) on one device-resident random batch of ``side`` px, called
    ``steps`` times per block; the counter is rewound before each block so that a block never
    runs past the schedule's end. With ``profile_steps``, the busy fraction of that many more
    (:func:`profiled_busy`). ``in_step_size``: the size a step that resizes inside itself
    shrinks the batch to."""
    from speedrun.engine.runtime import compiled_graphs
    rt, step = session.runtime, session.step
    graphs = compiled_graphs()
    x, y = random_batch(session, side)
    session.reset(0)
    step.reset(0)

    def once():
        rt.mark_step()
        step(x, y, in_step_size)
    seconds = timed_blocks(rt, once, steps, repeats, warm, before_block=step.rewind)
    batch = session.local_batch
    rates = [steps * batch / s for s in seconds]
    out = {"side": side, "batch": batch, "steps_per_block": steps, "warm_steps": warm, "block_seconds": seconds,
           "seconds_per_step": [s / steps for s in seconds], "images_per_second": rates,
           "images_per_second_median": float(np.median(rates)),
           "seconds_per_step_median": float(np.median(seconds)) / steps}
    if profile_steps:
        step.rewind()
        out["busy"] = profiled_busy(rt, once, profile_steps)
    out["graphs_compiled_during"] = compiled_graphs() - graphs
    return out


# ------------------------------------------------------------------------------------------
# Busy fraction, from torch.profiler
# ------------------------------------------------------------------------------------------

WINDOW = "speedrun.profiled_window"


def covered(intervals) -> float:
    """Length of the union of (start, end) intervals (overlaps, e.g. several streams or nested
    ops, count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def busy_fraction(intervals, window: tuple[float, float]) -> float:
    lo, hi = window
    clipped = [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]
    return covered(clipped) / (hi - lo) if hi > lo else float("nan")


CPU_WORK = ("aten::", "Torch-Compiled Region", "CompiledFunction")


def profiled_busy(rt, step_once, steps: int) -> dict:
    """Over ``steps`` calls of ``step_once`` under torch.profiler (the device synchronised
    before the window opens and before it closes): on CUDA, the union of the kernels' own
    intervals (memory copies and sets included) over the window's wall time; on a CPU, the
    union of this process's ATen ops and compiled regions over it (input workers are other
    processes: what is left is waiting for batches, Python and the profiler's own cost).
    The profiler slows the host, so the figure is a lower bound of the unprofiled one where
    the host is the limit."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function
    cuda = rt.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rt.synchronize()
    with profile(activities=acts) as prof:
        with record_function(WINDOW):
            rt.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                step_once()
            rt.synchronize()
            wall = time.perf_counter() - t0
    events = prof.events()
    window = next(e.time_range for e in events if e.name == WINDOW)
    if cuda:
        spans = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        source = "CUDA kernels, copies and sets (device time)"
    else:
        spans = [(e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == DeviceType.CPU and e.name != WINDOW and e.name.startswith(CPU_WORK)]
        source = "this process's ATen ops and compiled regions (CPU time; no GPU)"
    frac = busy_fraction(spans, (window.start, window.end))
    return {"steps": steps, "wall_seconds": wall, "busy_fraction": frac, "busy_seconds": frac * wall,
            "what": source}


def bound(pipeline_rate: float, model_rate: float) -> dict:
    """Which side bounds pipeline-fed steps: their images/s against the model step's alone."""
    ratio = pipeline_rate / model_rate
    return {"pipeline_over_model": ratio, "bound_by": "model" if ratio >= BOUND_SHARE else "pipeline",
            "rule": f"model-bound where the pipeline-fed steps reach {BOUND_SHARE:.0%} of the model step's "
                    "images/s alone, else pipeline-bound"}


# ------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------

PROG = "imagenet_throughput"

PUBLISHED = [
    {"what": "NVIDIA DeepLearningExamples, ResNet-50 v1.5 for PyTorch, AMP with DALI, training throughput",
     "hardware": "1 x A100-80GB", "images_per_second_per_gpu": 2470, "image_size": 224},
    {"what": "MLPerf Training v4.0, ResNet-50, an 8-GPU H100 system (a whole timed training run, its "
             "evaluations included)", "hardware": "8 x H100", "images_per_second_per_gpu": 7150,
     "image_size": 224, "approximate": True},
    {"what": "FFCV ResNet-50 (its published ImageNet configs, low-resolution training)", "hardware": "8 x A100",
     "images_per_second_per_gpu": 3300, "image_size": 160, "approximate": True},
]

PHOTO_SIZES = [(500, 375), (500, 375), (500, 375), (375, 500)]


def parse(argv):
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="imagenet-resnet50", help="the recipe (default imagenet-resnet50)")
    p.add_argument("--batch", type=int, default=256, help="images per step (data.batch_size; default 256)")
    p.add_argument("--size", type=int, default=224, help="training side in px (data.image_size; default 224)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed block (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="timed blocks per region (default 3)")
    p.add_argument("--warm", type=int, default=5, help="untimed steps before the blocks (default 5; they include "
                   "starting the pipeline's workers)")
    p.add_argument("--profile-steps", type=int, default=5, help="steps under torch.profiler per region (default 5)")
    p.add_argument("--classes", type=int, default=1000, help="class folders (default 1000, ImageNet's)")
    p.add_argument("--images-per-class", type=int, help="training JPEGs per class (default: enough that one epoch "
                   "holds every batch a pipeline is timed on)")
    p.add_argument("--val-per-class", type=int, default=1, help="validation JPEGs per class (default 1)")
    p.add_argument("--photo", default=None, help="one WIDTHxHEIGHT for every JPEG (default: 500x375, every fourth "
                   "375x500)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    p.add_argument("--workers", type=int, help="decoding worker processes (data.workers; default the recipe's)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override, after the options above (repeatable)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--no-gpu-decode", action="store_true", help="leave out the region decoded on the GPU")
    p.add_argument("--commit", help="the commit the record names (default: $SPEEDRUN_COMMIT, else git rev-parse HEAD)")
    p.add_argument("--out", type=Path, help="the JSON record (default: benchmarks/results/imagenet-throughput-"
                   "<device>-<commit>.json); never overwritten")
    return p.parse_args(argv)


def check(args) -> None:
    for name in ("batch", "steps", "repeats", "classes", "val_per_class", "profile_steps"):
        if getattr(args, name) < 1:
            raise Refused(f"--{name.replace('_', '-')} {getattr(args, name)}: must be 1 or more")
    if args.size < 8:
        raise Refused(f"--size {args.size}: must be at least 8 px")
    if args.warm < 0:
        raise Refused(f"--warm {args.warm}: must be 0 or more")
    if args.classes < 2:
        raise Refused(f"--classes {args.classes}: a classifier needs at least 2")
    if args.images_per_class is not None and args.images_per_class < 1:
        raise Refused(f"--images-per-class {args.images_per_class}: must be 1 or more")
    if not 1 <= args.quality <= 100:
        raise Refused(f"--quality {args.quality}: JPEG quality is 1 to 100")
    if args.workers is not None and args.workers < 0:
        raise Refused(f"--workers {args.workers}: 0 (decode in this process) or more")
    bad = [s for s in args.sets if "=" not in s]
    if bad:
        raise Refused(f"--set {bad[0]!r}: expected KEY=VALUE")


def overrides(args, folder: Path | None, *extra: str) -> list[str]:
    own = ["data.dataset='folder'", f"data.batch_size={args.batch}", f"data.image_size={args.size}"]
    if args.workers is not None:
        own.append(f"data.workers={args.workers}")
    if folder is not None:
        own.append(f"data.path={str(folder)!r}")
    return own + list(extra) + list(args.sets)


# ------------------------------------------------------------------------------------------
def pipeline_fed(session, recipe, source, seed: int = 0):
    """(one pipeline-fed step, the pipeline): ``source`` opened as a run opens it (moved to the
    device where it is held there, the pipeline of its kind, the run's BatchAugment), epoch
    after epoch; each call takes the next batch and trains the session's step on it."""
    import torch
    from speedrun.data.augment.batch import BatchAugment
    from speedrun.data.pipeline.dataset import open_pipeline, place_source
    from speedrun.engine.sizes import epoch_image_side, resized_in_step
    rt = session.runtime
    session.reset(seed)
    data = open_pipeline(place_source(source, rt), recipe, rt, seed, session.shard)
    whiten = getattr(session.model, "whiten", None)
    if whiten is not None:
        whiten.fit(data.whitening_sample(recipe.model.whiten.samples))
    session.step.reset(seed)
    gen = torch.Generator(device=rt.device)
    gen.manual_seed(seed)
    augment = BatchAugment(recipe.augment, data.n_train, data.image_size, gen, rt.device, data.mean, data.std,
                           resized_crop=not data.crops_in_workers, input_size=getattr(data, "stored_size", None))
    in_step = resized_in_step(recipe)
    epochs = [0]

    def batches():
        while True:
            size = epoch_image_side(recipe, min(epochs[0], session.n_epochs - 1), data.image_size[0])
            for x, y in data.epoch(epochs[0], recipe.data.batch_size, augment, gen, size=None if in_step else size):
                yield x, y, size if in_step else None
            epochs[0] += 1
    it = batches()

    def once():
        x, y, s = next(it)
        rt.mark_step()
        session.step(x, y, s)
    return once, it, epochs


def fed_region(session, recipe, source, args) -> dict:
    from speedrun.engine.runtime import compiled_graphs
    rt = session.runtime
    graphs = compiled_graphs()
    once, it, epochs = pipeline_fed(session, recipe, source)
    seconds = timed_blocks(rt, once, args.steps, args.repeats, args.warm, before_block=session.step.rewind)
    session.step.rewind()
    busy = profiled_busy(rt, once, args.profile_steps)
    it.close()                          # the pipeline and its workers go with the closures
    del once, it
    gc.collect()
    batch = recipe.data.batch_size
    rates = [args.steps * batch / s for s in seconds]
    return {"batch": batch, "steps_per_block": args.steps, "warm_steps": args.warm, "block_seconds": seconds,
            "images_per_second": rates, "images_per_second_median": statistics.median(rates),
            "busy": busy, "epochs_started": epochs[0] + 1, "graphs_compiled_during": compiled_graphs() - graphs}


def run(args, commit, commit_source) -> int:
    from speedrun.files import atomic_write_json, check_output_file
    from speedrun.recipe import load_recipe

    started = time.perf_counter()
    check(args)                                     # (refusals first: torch is not imported yet)
    sizes = [parse_wxh(args.photo, "--photo")] if args.photo else PHOTO_SIZES
    try:
        base = load_recipe(args.recipe, overrides(args, None))
        if args.out:
            check_output_file(args.out, "--out")
        import torch
        from speedrun.data.pipeline.dataset import open_source
        from speedrun.data.sources.device_decode import torchvision_io
        from speedrun.data.pipeline.stream import default_workers
        from speedrun.engine.loop import Session
        from speedrun.engine.plan import plan_run
        from speedrun.engine.runtime import pick_device
        from speedrun.errors import DataError
        device = pick_device(args.device)
        out = record_path("imagenet-throughput", args.out, device, commit)
    except SpeedrunError as err:
        raise Refused(err) from None
    per_pipeline = args.warm + args.repeats * args.steps + args.profile_steps
    per_class = args.images_per_class or math.ceil(per_pipeline * base.data.batch_size / args.classes) + 1
    env = machine(commit, commit_source)

    with tempfile.TemporaryDirectory(prefix="imagenet-throughput-") as tmp:
        tmp = Path(tmp)
        folder = tmp / "photos"
        made = photo_folder(folder, args.classes, per_class, args.val_per_class, sizes, args.quality)
        print(f"wrote {made['train_images'] + made['val_images']:,} JPEGs ({made['mean_bytes'] / 1e3:.0f} kB each) "
              f"in {made['write_seconds']:.1f} s", flush=True)
        plan = plan_run(load_recipe(args.recipe, overrides(args, folder, "data.cache='off'")), folder, device)
        recipe, source, runtime = plan.recipe, plan.source, plan.runtime
        t0 = time.perf_counter()
        session = Session(recipe, source, runtime, warm_up=True)
        build_seconds = time.perf_counter() - t0
        params = sum(p.numel() for p in session.model.parameters() if p.requires_grad)
        print(f"{recipe.name}: {params:,} parameters, {runtime.precision}, compile {runtime.compile}, "
              f"channels_last {runtime.channels_last}; built and warmed up in {build_seconds:.1f} s", flush=True)

        alone = model_step(session, recipe.data.image_size, args.steps, args.repeats, args.warm, args.profile_steps)
        model_rate = alone["images_per_second_median"]
        print(f"model step alone: {model_rate:,.0f} images/s, busy {alone['busy']['busy_fraction']:.2f}", flush=True)

        workers = default_workers(recipe.data.workers)
        try:
            import simplejpeg  # noqa: F401
            worker_decoder = "simplejpeg (data.decoder=auto)" if recipe.data.decoder == "auto" else recipe.data.decoder
        except ImportError:
            worker_decoder = "Pillow (simplejpeg is not installed)" if recipe.data.decoder in ("auto", "simplejpeg") \
                else recipe.data.decoder
        procs = f"{workers} process{'es' if workers != 1 else ''}" if workers else "in this process (data.workers=0)"
        streamed = {"pipeline": "streamed", "decoding": f"CPU workers: {procs}, {worker_decoder}",
                    "overrides": ["data.cache='off'"], **fed_region(session, recipe, source, args)}
        streamed.update(bound(streamed["images_per_second_median"], model_rate))
        print(f"streamed, CPU workers: {procs}: {streamed['images_per_second_median']:,.0f} images/s "
              f"({streamed['pipeline_over_model']:.2f} of the model step; {streamed['bound_by']}-bound), busy "
              f"{streamed['busy']['busy_fraction']:.2f}", flush=True)
        pipelines = [streamed]

        gpu = {"pipeline": "decoded once on the device (torchvision), then cropped on the device",
               "overrides": ["data.cache='on'", "data.decoder='torchvision'"]}
        if args.no_gpu_decode:
            gpu.update(available=False, why="left out (--no-gpu-decode)")
        else:
            try:
                torchvision_io()
            except DataError as err:
                gpu.update(available=False, why=str(err))
        if gpu.get("available", True):
            decode_device = "cuda" if torch.cuda.is_available() else "cpu"       # (speedrun data prepare's rule)
            cache_dir = tmp / "cache"
            r_gpu = load_recipe(args.recipe, overrides(args, folder, *gpu["overrides"],
                                                       f"data.cache_dir={str(cache_dir)!r}"))
            t0 = time.perf_counter()
            r_gpu, cached = open_source(r_gpu, folder)
            decode_seconds = time.perf_counter() - t0
            n = made["train_images"] + made["val_images"]
            gpu.update(available=True, decoding=f"torchvision on {decode_device}, once, into a cache at "
                       f"{cached.stored_size[0]} px (shorter side resized, centre square)",
                       decode={"device": decode_device, "images": n, "seconds": decode_seconds,
                               "images_per_second": n / decode_seconds, "cache": cached.cache},
                       **fed_region(session, r_gpu, cached, args))
            gpu.update(bound(gpu["images_per_second_median"], model_rate))
            print(f"decoded on {decode_device} at {n / decode_seconds:,.0f} images/s, then "
                  f"{gpu['images_per_second_median']:,.0f} images/s fed from the cache "
                  f"({gpu['pipeline_over_model']:.2f} of the model step; {gpu['bound_by']}-bound)", flush=True)
            del cached
        else:
            print(f"decoded on the GPU: not available ({gpu['why'][:120]})", flush=True)
        pipelines.append(gpu)

    record = {
        "benchmark": "ResNet-50 training throughput on one device: the model step alone and fed by speedrun's "
                     "pipelines from a synthetic ImageNet-like JPEG folder",
        "script": "benchmarks/imagenet_throughput.py", "commit": commit, "commit_source": commit_source,
        "device": str(device), "device_name": device_label(device),
        "timed": {
            "model_step": "the recipe's TrainStep (forward, loss, backward, optimizer) on one device-resident random "
                          "batch; blocks of steps_per_block steps after warm_steps untimed ones, the device "
                          "synchronised before and after each block; images/s = steps x batch / block seconds",
            "pipelines": "the same step, each batch taken from the pipeline as speedrun train takes it (workers' "
                         "decoding and crops, the move to the device, the device-side augmentation) in the same "
                         "blocks; the warm steps include starting the workers",
            "busy": "over profile steps after the blocks, under torch.profiler: the union of the device's kernels "
                    "over the window's wall time on CUDA (on a CPU: this process's ATen ops and compiled regions)",
            "decode": "the region decoded on the GPU: open_source with data.cache=on and data.decoder=torchvision "
                      "(reading, decoding and resizing every training and validation file once, writing the cache)",
        },
        "recipe": recipe.name, "recipe_config": recipe.to_dict(),
        "runtime": {"precision": runtime.precision, "compile": runtime.compile, "compile_mode": runtime.compile_mode, "cuda_graphs": runtime.cuda_graphs,
                    "channels_last": runtime.channels_last, "choices": list(runtime.choices)},
        "batch": recipe.data.batch_size, "image_size": recipe.data.image_size, "params": params,
        "build_and_warm_up_seconds": build_seconds, "compile_seconds": session.compile_seconds,
        "photos": {**made, "root": None, "train_per_class": per_class, "val_per_class": args.val_per_class,
                   "content": "smooth random colour fields plus noise (photo-like compression), not real photos"},
        "model_step": alone, "pipelines": pipelines,
        "scale_input": {"images_per_second": model_rate, "batch_per_gpu": recipe.data.batch_size, "params": params,
                        "recipe": recipe.name, "device_name": device_label(device), "device": device.type,
                        "precision": runtime.precision, "image_size": recipe.data.image_size,
                        "what": "the model step alone: median images/s of the timed blocks"},
        "published": PUBLISHED,
        "total_seconds": time.perf_counter() - started,
        "environment": env,
    }
    atomic_write_json(out, record)
    print(f"record: {out}")
    return 0


def main(argv=None) -> int:
    def body():
        args = parse(sys.argv[1:] if argv is None else argv)
        return run(args, *read_commit(args.commit))        # (the commit that runs, read before it runs)
    return guarded(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
