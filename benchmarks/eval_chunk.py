"""What cutting an evaluation batch into model calls (``eval.chunk``) costs on a CPU: for each
recipe, its network (random weights, evaluation mode) computes the TTA logits of one evaluation
batch of random images, the whole batch in one model call per view and then in the calls of the
chunk ("auto": the images that make 10 GFLOP of forward passes), ``--rounds`` times each, one
after the other; the record has each round's seconds, the images per second and the largest
difference between the two ways' logits.

    python benchmarks/eval_chunk.py --out benchmarks/results/eval-chunk-CPU-COMMIT.json
    python benchmarks/eval_chunk.py --recipes fashion-mnist --images 64 --chunk 16 --rounds 1 --out FILE

The chunk changes only the sizes of the model calls, so the prediction is that the batch takes
about as long either way (within a few per cent) wherever a call still holds enough work for
the CPU's matrix kernels.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

SHAPES = {"cifar10": (3, 10, (32, 32)), "fashion-mnist": (1, 10, (28, 28)), "tiny-imagenet": (3, 200, (64, 64)),
          "imagenette": (3, 10, (160, 160)), "folder": (3, 10, (64, 64)), "imagenet": (3, 1000, (224, 224))}
"""(channels, classes, evaluation size) of each shipped recipe's data, by recipe or dataset name, where
the recipe does not set the size (data.eval_size, data.image_size); a folder's: 10 classes, 64 px."""


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the record's JSON file (refused where it exists)")
    p.add_argument("--recipes", default="cifar10-94,fashion-mnist,tiny-imagenet",
                   help="shipped recipes, comma-separated (default cifar10-94,fashion-mnist,tiny-imagenet)")
    p.add_argument("--images", type=int, help="images in the batch (default: each recipe's eval.batch_size)")
    p.add_argument("--chunk", type=int, help="images per call (default: the recipe's eval.chunk on a CPU)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each way (default 3)")
    p.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    p.add_argument("--note", default="", help="a note stored in the record")
    args = p.parse_args(argv)
    for name in ("images", "chunk", "rounds", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} {value}: at least 1")
    return args


def measure(recipe, images: int | None, chunk: int | None, rounds: int) -> dict:
    """One recipe's batch, whole and chunked: each round's seconds and what was compared."""
    import torch
    from speedrun.engine.evaluate import tta_logits
    from speedrun.engine.flops import eval_chunk
    from speedrun.models import build_model
    kind = next(k for k in (recipe.name, recipe.data.dataset, "folder") if k in SHAPES)
    channels, classes, size = SHAPES[kind]
    side = recipe.data.eval_size or recipe.data.image_size           # (0: the data's own size)
    size = (side, side) if side else size
    n = images or recipe.eval.batch_size
    chunk = chunk or eval_chunk(recipe, channels, classes, size, "cpu")
    torch.manual_seed(0)
    model = build_model(recipe.model, channels, classes).eval()
    x = torch.randn(n, channels, *size)
    ways = {"whole": None, "chunked": chunk}
    logits, seconds = {}, {w: [] for w in ways}
    with torch.no_grad():
        for way, c in ways.items():                      # one untimed call each: kernels chosen, memory held
            logits[way] = tta_logits(model, x, recipe.eval.tta, fraction=recipe.eval.tta_fraction, chunk=c,
                                     between=lambda: None)[0]
        for _ in range(rounds):
            for way, c in ways.items():
                t0 = time.perf_counter()
                tta_logits(model, x, recipe.eval.tta, fraction=recipe.eval.tta_fraction, chunk=c, between=lambda: None)
                seconds[way].append(time.perf_counter() - t0)
    med = {w: statistics.median(s) for w, s in seconds.items()}
    return {"recipe": recipe.name, "images": n, "image_size": list(size), "channels": channels, "classes": classes,
            "tta": recipe.eval.tta, "tta_fraction": recipe.eval.tta_fraction, "chunk": chunk,
            "calls_per_view": -(-n // chunk), "seconds": seconds,
            "median_seconds": med, "images_per_second": {w: n / s for w, s in med.items()},
            "chunked_over_whole": med["chunked"] / med["whole"],
            "max_abs_logit_difference": float((logits["chunked"] - logits["whole"]).abs().max())}


def main(argv=None) -> int:
    args = parse(argv)
    from speedrun.errors import SpeedrunError
    from speedrun.files import atomic_write_json, check_output_file
    from speedrun.recipe import load_recipe
    try:
        check_output_file(args.out, "--out")
        recipes = [load_recipe(name) for name in args.recipes.split(",")]
    except SpeedrunError as err:
        raise SystemExit(f"eval_chunk: error: {err}")
    import torch
    from speedrun.report.environment import machine
    if args.threads:
        torch.set_num_threads(args.threads)
    record = {"benchmark": "an evaluation batch's TTA logits on a CPU, whole and cut into eval.chunk calls",
              "note": args.note, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "precision": "fp32",
              "environment": machine(), "recipes": []}
    for recipe in recipes:
        done = measure(recipe, args.images, args.chunk, args.rounds)
        record["recipes"].append(done)
        atomic_write_json(args.out, record)
        print(f"eval_chunk: {recipe.name}: {done['images']} images, whole {done['median_seconds']['whole']:.3f} s, "
              f"in calls of {done['chunk']} {done['median_seconds']['chunked']:.3f} s "
              f"(x {done['chunked_over_whole']:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
