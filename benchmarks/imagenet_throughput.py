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
"""
from __future__ import annotations

import gc
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from throughput_common import (ROOT, OneLineParser, Refused, bound, device_label, machine, model_step,  # noqa: E402
                               parse_wxh, photo_folder, profiled_busy, read_commit, refusal, slug, timed_blocks)
from speedrun.errors import SpeedrunError  # noqa: E402

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
        name = slug(device_label(device) if device.type == "cuda" else f"cpu-{device_label(device)}")
        out = args.out or ROOT / "benchmarks" / "results" / \
            f"imagenet-throughput-{name}-{(commit or 'nocommit')[:7]}.json"
        check_output_file(out, "--out")
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
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        commit, commit_source = read_commit(args.commit)        # (the commit that runs, read before it runs)
        return run(args, commit, commit_source)
    except Refused as err:
        return refusal(PROG, err)
    except SpeedrunError as err:                  # (data or device trouble once running: no record)
        print(f"{PROG}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
