"""The ``speedrun`` command line."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import __version__
from .errors import SpeedrunError, UsageError
from .world import detect, process_age as _process_age


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def _int_range(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is not between {lo} and {hi}")
        return value
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not between 0 and 1 (exclusive)")
    return value


def _fractions(text: str) -> list[float]:
    """'0.6,0.8' -> [0.6, 0.8]: fractions of the epochs, each in (0, 1]."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a number (expected e.g. 0.6,0.8)") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"{value} is not a fraction of the epochs in (0, 1]")
        values.append(value)
    return values


LOG_HELP = ("when output is not a terminal, print a progress line every N steps ('100') or seconds "
            "('30s', the default)")


def _recipe_options(p, out_help: str, optional: bool = False, log: bool = True) -> None:
    p.add_argument("recipe", nargs="?" if optional else None,
                   help="a shipped recipe name (see `speedrun recipes`) or a .toml path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.lr=0.5 (repeatable)")
    p.add_argument("--data-dir", help="folder holding the dataset (else $SPEEDRUN_DATA, ~/.cache/speedrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--seed", type=int, help="seed (train.seed); bench and ablate use seed, seed+1, ...")
    p.add_argument("--init", metavar="WEIGHTS", help="weights to start from and fine-tune (model.init): a speedrun run "
                   "folder, a .pt/.pth/.safetensors ResNet file, torchvision:NAME.WEIGHTS or timm:NAME[=FILE] (any of timm's "
                   "architectures)")
    if out_help:
        p.add_argument("--out", type=Path, help=out_help)
    if log:
        p.add_argument("--log-every", metavar="N|Ns", help=LOG_HELP)


def _scale_options(p) -> None:
    from .cluster.model import ALGORITHMS, COMM_BYTES, KNOWN_PARAMS, NETWORKS
    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", metavar="NAME", help=f"a known model ({', '.join(KNOWN_PARAMS)}; default resnet50)")
    what.add_argument("--recipe", help="a shipped recipe or .toml: its model is built on the meta device and "
                      "its parameters counted")
    what.add_argument("--params", type=int, metavar="N", help="the number of parameters (gradient elements)")
    p.add_argument("--classes", type=int, metavar="N",
                   help="classes of a --recipe model on folder/npz data (default 1000)")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--images-per-second", type=float, metavar="X", help="one GPU's training images per second")
    speed.add_argument("--step-time", type=float, metavar="S", help="one GPU's seconds per step at --batch-per-gpu "
                       "(strong scaling without it: at the whole --global-batch)")
    speed.add_argument("--step-record", metavar="FILE", help="one GPU's speed, batch and parameters as measured by "
                       "benchmarks/throughput.py pipelines (its record's model step alone)")
    p.add_argument("--batch-per-gpu", type=int, metavar="B", help="images per GPU per step (default: the recipe's)")
    p.add_argument("--global-batch", type=int, metavar="N", help="strong scaling: split this batch over the GPUs "
                   "(default: weak scaling, --batch-per-gpu on every GPU)")
    p.add_argument("--comm-dtype", choices=list(COMM_BYTES), default="fp32",
                   help="element type of the all-reduced gradients (default fp32)")
    p.add_argument("--network", metavar="PRESET", help=f"{', '.join(NETWORKS)} (default dgx-a100)")
    p.add_argument("--bandwidth-gbps", type=float, metavar="GBPS",
                   help="per node between nodes, Gb/s, all adapters together")
    p.add_argument("--intra-bandwidth-gbps", type=float, metavar="GBPS", help="per GPU inside a node (NVLink), Gb/s")
    p.add_argument("--latency-us", type=float, metavar="US", help="per message step between nodes, microseconds")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs in one node (default: the preset's)")
    p.add_argument("--algorithm", choices=list(ALGORITHMS), default="hierarchical",
                   help="all-reduce algorithm (default hierarchical: reduce in the node, ring across nodes)")
    p.add_argument("--overlap", type=float, default=0.0, metavar="F",
                   help="fraction of the backward pass that can hide the all-reduce, 0 to 1 (default 0)")
    p.add_argument("--overhead-ms", type=float, default=0.0, metavar="MS",
                   help="fixed time added to every step (default 0)")
    p.add_argument("--gpus", metavar="N,N,...", help="GPU counts (default 1,2,4,...,4096)")
    p.add_argument("--plot", metavar="FILE.png", help="write throughput and efficiency curves to this PNG")
    p.add_argument("--json", metavar="FILE", help="also write the numbers to this JSON file")
    p.add_argument("--calibration", action="store_true",
                   help="print the model against published ResNet-50 runs (see docs/scaling.md)")


def _add(sub, name: str) -> argparse.ArgumentParser:
    """The parser of command ``name``, listed with its help from :data:`COMMANDS`."""
    return sub.add_parser(name, help=COMMANDS[name].help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speedrun", description="Train image classifiers to a target "
                                     "accuracy in the least time, and measure it honestly.")
    parser.add_argument("--version", action="version", version=f"speedrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _add(sub, "train")
    _recipe_options(p, "run folder (default: a new folder under runs/)", optional=True)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint.pt")
    p.add_argument("--find-batch", action="store_true",
                   help="halve data.batch_size on out-of-memory until it fits (runtime.find_batch)")
    p.add_argument("--log", "--loggers", dest="log", action="append", metavar="tensorboard|csv|none",
                   help="also log the per-step and per-epoch metrics for TensorBoard (RUN/tensorboard/) or as CSV "
                        "(RUN/steps.csv, RUN/epochs.csv); repeatable or a comma list (default: none, or what a "
                        "resumed run logged). Under torchrun spell it --loggers: torchrun takes --log for its own")

    _add(sub, "recipes")

    p = _add(sub, "bench")
    _recipe_options(p, "folder for bench.json (default: a new folder under runs/)")
    p.add_argument("--runs", type=_positive_int, required=True, help="number of runs")

    p = _add(sub, "compare")
    p.add_argument("a", help="A: bench.json or its folder")
    p.add_argument("b", help="B: bench.json or its folder")
    p.add_argument("--region", default="train+eval", help="timing region (train+eval, end_to_end, run_start_to_stop)")
    p.add_argument("--alpha", type=_fraction, default=0.05, help="significance level (default 0.05)")
    p.add_argument("--json", help="also write the comparison to this JSON file")

    p = _add(sub, "ablate")
    _recipe_options(p, "folder for ablate.json and ablation.png (default: a new folder under runs/)")
    p.add_argument("--runs", type=_positive_int, required=True, help="runs per variant")
    p.add_argument("--tricks", help="comma-separated tricks to ablate (default: every trick the recipe uses)")
    p.add_argument("--ladder", help="comma-separated tricks to add back one by one, in this order")
    p.add_argument("--epochs-grid", type=_fractions, help="fractions of the epochs to also run at, e.g. 0.6,0.8 "
                   "(to interpolate the epochs needed to reach the target)")
    p.add_argument("--resume", action="store_true", help="continue the interrupted ablation in --out: keep "
                   "its finished variants, run the rest (same recipe, --set, --seed, --runs, grid)")

    p = _add(sub, "flops")
    _recipe_options(p, "", log=False)
    p.add_argument("--steps", type=_positive_int, default=10, help="training steps to time for the data/model split")
    p.add_argument("--json", help="also write the figures to this JSON file")

    _scale_options(_add(sub, "scale"))

    p = _add(sub, "predict")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the folder of a finished run (model.pt, config.toml)")
    p.add_argument("images", metavar="IMAGES", nargs="+", help="image files, folders (searched recursively) or "
                   "glob patterns ('photos/**/*.jpg')")
    p.add_argument("--top-k", type=_positive_int, default=1, help="the K most probable classes per image (default 1)")
    p.add_argument("--tta", action="store_true", help="average the recipe's test-time views (eval.tta) of each image")
    p.add_argument("--format", default="table", help="table (default), csv or json")
    p.add_argument("--out", type=Path, help="write the predictions to this new file instead of the terminal")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--batch-size", type=_positive_int, help="images per forward pass (default: the run's eval.batch_size)")

    p = _add(sub, "evaluate")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the folder of a finished run")
    p.add_argument("--data-dir", help="where the run's data is now (else where the run read it, as its summary.json "
                   "records; else where config.toml says, $SPEEDRUN_DATA, ...)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")

    p = _add(sub, "export")
    p.add_argument("run", metavar="RUN_DIR", help="the folder of a finished `speedrun train` run")
    p.add_argument("--format", choices=["onnx", "torchscript", "safetensors"], required=True)
    p.add_argument("--out", type=Path, help="the file to write (default: RUN_DIR/model.onnx, model.torchscript.pt "
                   "or model.safetensors); an existing file is never overwritten")
    p.add_argument("--data-dir", help="where the run's data is, if not where it was trained from (the check uses "
                   "its test images; random images without them)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest difference of a logit from PyTorch's accepted (default 1e-4)")

    p = _add(sub, "report")
    p.add_argument("target", help="a run folder, or a folder holding bench.json or ablate.json")

    data = _add(sub, "data")
    dsub = data.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="decode an image folder once into a fixed-size uint8 .npz (memory-mapped), "
                        "or with --reduce write it again as smaller JPEGs (a reduced store)")
    p.add_argument("src", help="image folder (train/ and val/, or one folder to split)")
    p.add_argument("--size", type=_int_range(8, 4096), help="side of the square images, in pixels (the .npz)")
    p.add_argument("--out", type=Path, required=True, help="the .npz file to write, or with --reduce the new folder")
    p.add_argument("--reduce", action="store_true", help="write a reduced store instead: the folder in its own "
                   "layout, each image a JPEG whose longer side is at most --max-side (train on it as on any folder)")
    p.add_argument("--max-side", type=int, metavar="PX", help="with --reduce: the longest side kept, in pixels "
                   "(16 to 4096, e.g. 320); smaller JPEGs are copied as they are")
    p.add_argument("--quality", type=int, metavar="Q", help="with --reduce: JPEG quality of re-encoded images, "
                   "1 to 100 (default 90)")
    p.add_argument("--val-fraction", type=_fraction, default=None, help="held-out fraction when there is no val/")
    p.add_argument("--seed", type=_int_range(0, 2**63 - 1), default=0, help="seed of that split")
    p.add_argument("--workers", type=_int_range(-1, 256), default=-1, help="decoding processes (default: one per core, at most 8)")
    p.add_argument("--skip-corrupt", action="store_true", help="skip unreadable images instead of stopping")
    p.add_argument("--decoder", choices=["auto", "pillow", "simplejpeg", "torchvision"],
                   help="as data.decoder (default auto); torchvision decodes JPEGs in batches on the GPU (nvjpeg) when there "
                        "is one, else on the CPU, instead of in --workers processes")
    p = dsub.add_parser("export", help="write a built-in dataset as train/<class>/ and val/<class>/ images")
    p.add_argument("dataset", choices=["cifar10", "cifar100", "fashion-mnist"])
    p.add_argument("--format", choices=["png", "jpeg"], default="png")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quality", type=_int_range(1, 100), default=95, help="JPEG quality, 1 to 100")
    p.add_argument("--limit", type=_positive_int, help="only the first N images of each split")
    p.add_argument("--size", type=_int_range(8, 4096), help="resize to SIZE x SIZE pixels (bicubic)")
    p.add_argument("--layout", choices=["imagenet", "tiny-imagenet"], default="imagenet",
                   help="train/<class>/ and val/<class>/ (imagenet), or Tiny-ImageNet's train/<class>/images/ "
                        "with val/images/ and val_annotations.txt")
    p.add_argument("--data-dir", help="where the dataset is (else $SPEEDRUN_DATA, ~/.cache/speedrun)")
    return parser


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    args.started = started
    args.before_main = _process_age() if argv is None else None     # (a call from Python: no process start)
    try:
        return dispatch(args)
    except SpeedrunError as err:
        print(f"speedrun: error: {_rank()}{err}", file=sys.stderr)
        return _leave(err.exit_code)
    except KeyboardInterrupt:
        print("speedrun: interrupted", file=sys.stderr)
        return _leave(130)
    except Exception as err:                        # a bug: one line, the traceback in a file
        path = save_traceback(err)
        first = str(err).splitlines()[0][:300] if str(err) else ""
        print(f"speedrun: internal error: {_rank()}{type(err).__name__}: {first}\nThis is a bug in speedrun; the "
              f"traceback is in {path} (please include it when you report it).", file=sys.stderr)
        return _leave(1)


def _leave(code: int) -> int:
    """The exit code of a failed command. A process of a multi-process job exits at once: after
    a peer was lost, tearing down DDP's gloo process group can deadlock (its destructor joins a
    worker thread that waits for the GIL the main thread holds), which would leave the job
    hanging instead of ending it."""
    if detect().distributed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _rank() -> str:
    """'rank R/N: ' in a process of a multi-process job (every rank reports its own errors)."""
    world = detect()
    return f"rank {world.rank}/{world.size}: " if world.distributed else ""


def save_traceback(err: BaseException) -> str:
    """Write ``err``'s traceback to a file and return its path (under $SPEEDRUN_CRASH_DIR,
    ~/.cache/speedrun/crashes or the temporary folder, the first that can be written)."""
    text = "".join(traceback.format_exception(err))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    places = [os.environ.get("SPEEDRUN_CRASH_DIR"), os.path.expanduser("~/.cache/speedrun/crashes"),
              tempfile.gettempdir()]
    for place in filter(None, places):
        try:
            os.makedirs(place, exist_ok=True)
            fd, path = tempfile.mkstemp(dir=place, prefix=f"speedrun-crash-{stamp}-", suffix=".txt")
            with os.fdopen(fd, "w") as f:
                f.write(f"speedrun {__version__}, {' '.join(sys.argv)}\n\n{text}")
            return path
        except OSError:
            continue
    return "(nowhere: no writable folder; set SPEEDRUN_CRASH_DIR)"


ONE_PROCESS = {"bench": "runs its seeded runs one after another in one process",
               "ablate": "runs its variants one after another in one process",
               "flops": "times one device", "predict": "runs on one device", "evaluate": "runs on one device"}


Run = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """A command of the table: its help line (``speedrun --help`` lists it) and how to load
    the function that runs it. The modules behind a command are imported only when it runs,
    so that starting the command line costs no torch import."""
    help: str
    load: Callable[[], Run]


def _train() -> ModuleType:
    from . import training as train
    return train


def _bench() -> ModuleType:
    from .bench import commands
    return commands


def _compare() -> ModuleType:
    from .bench import compare_command
    return compare_command


def _ablate() -> ModuleType:
    from .bench import ablate_command
    return ablate_command


def _flops() -> ModuleType:
    from .bench import flops_command
    return flops_command


def _scale() -> ModuleType:
    from .cluster import command
    return command


def _predict() -> ModuleType:
    from .use import predict
    return predict


def _evaluate() -> ModuleType:
    from .use import evaluate
    return evaluate


def _export() -> ModuleType:
    from .use import export
    return export


def _report() -> ModuleType:
    from .report import command
    return command


COMMANDS: dict[str, Command] = {
    "train": Command("train one recipe once and write a run record", lambda: _train().train_command),
    "recipes": Command("list the shipped recipes", lambda: _train().recipes_command),
    "bench": Command("N seeded runs in one process, with statistics (bench.json)", lambda: _bench().bench_command),
    "compare": Command("compare two bench records with Welch t-tests", lambda: _compare().compare_command),
    "ablate": Command("benchmark the recipe with each trick turned off in turn", lambda: _ablate().ablate_command),
    "flops": Command("FLOPs per image and per run, peak, ideal time, data vs model time",
                     lambda: _flops().flops_command),
    "scale": Command("predict step time, throughput and scaling efficiency on 1 to 4,096 GPUs from one GPU's "
                     "speed, the gradient size and the network (a model)", lambda: _scale().scale_command),
    "predict": Command("classify image files with a finished run's model (probabilities, top-k)",
                       lambda: _predict().predict_command),
    "evaluate": Command("a finished run on its own test set: accuracy (equal to the run's), per class, top-5, "
                        "confusion matrix, mistakes; written into the run folder",
                        lambda: _evaluate().evaluate_command),
    "export": Command("a finished run's model as ONNX, TorchScript or safetensors, with its preprocessing in the "
                      "file, checked against PyTorch on the run's test images", lambda: _export().export_command),
    "report": Command("an HTML (and Markdown) report of a run, bench or ablate folder",
                      lambda: _report().report_command),
    "data": Command("prepare an image folder as arrays, or export a built-in set as a folder", lambda: data_command),
}
"""Every command, in the order ``speedrun --help`` lists them: the parser's commands and
:func:`dispatch`'s come from here."""


def dispatch(args) -> int:
    """Run the command ``args`` names, after the checks and option spellings all commands share."""
    if args.command in ONE_PROCESS and detect().distributed:
        raise UsageError(f"speedrun {args.command} {ONE_PROCESS[args.command]}; start it without torchrun or srun "
                         "(only `speedrun train` trains across processes)")
    if hasattr(args, "log_every"):
        from .report.console import LogEvery
        args.log_every = LogEvery.parse(args.log_every)
    if getattr(args, "find_batch", False):          # train's --find-batch is runtime.find_batch
        args.overrides.append("runtime.find_batch=true")
    if getattr(args, "init", None):                 # --init is model.init (a TOML string, whatever it holds)
        args.overrides.append(f"model.init={json.dumps(args.init)}")
    return COMMANDS[args.command].load()(args)


def data_command(args) -> int:
    from .data.prepare import export, prepare
    from .report.console import print_table
    if args.data_command == "prepare" and args.reduce:
        return reduce_command(args)
    if args.data_command == "prepare":
        from .data.sources.skipped import skipped_line
        if args.size is None:
            raise UsageError("data prepare: give --size S (the side of the .npz's square images), or --reduce "
                             "--max-side PX for a reduced store")
        given = [o for o, v in (("--max-side", args.max_side), ("--quality", args.quality)) if v is not None]
        if given:
            raise UsageError(f"data prepare: {' and '.join(given)} go with --reduce (a reduced store); the .npz "
                             "takes --size")
        out = prepare(args.src, args.size, args.out, args.val_fraction or 0.0, args.seed, args.workers,
                      args.skip_corrupt, args.decoder or "auto")
        skipped = out.pop("skipped_files")
        print_table(f"prepared {args.src}", [(k, str(v)) for k, v in out.items()])
        if out["skipped"]:
            print(f"speedrun: {skipped_line(skipped, out['skipped'])}")
    else:
        out = export(args.dataset, args.format, args.out, args.data_dir, args.quality, limit=args.limit,
                     size=args.size, layout=args.layout)
        print_table(f"exported {args.dataset}", [(k, str(v) if k != "classes" else str(len(v)))
                                                  for k, v in out.items()])
    return 0


def reduce_command(args) -> int:
    """``data prepare --reduce``: the reduced store, and what it holds."""
    from .data.reduced_store import MANIFEST, reduce_store
    from .data.sources.skipped import skipped_line
    from .report.console import print_table
    given = [o for o, v in (("--size", args.size), ("--val-fraction", args.val_fraction),
                            ("--decoder", args.decoder)) if v is not None]
    if given:
        raise UsageError(f"data prepare --reduce: {' and '.join(given)} are for the .npz; a reduced store keeps "
                         "each image's shape and every file (the split is made when training reads it)")
    if args.max_side is None:
        raise UsageError("data prepare --reduce: give --max-side PX, the longest side the stored images may have "
                         "(e.g. 320)")
    out = reduce_store(args.src, args.out, args.max_side, 90 if args.quality is None else args.quality,
                       args.workers, args.skip_corrupt)
    rows = [("out", str(args.out)), ("max side", str(out["max_side"])), ("quality", str(out["quality"])),
            *((f"{split} images" if split != "." else "images", str(sum(c.values())))
              for split, c in out["counts"].items()),
            ("classes", str(len(next(iter(out["counts"].values()))))),
            *((k, str(out[k])) for k in ("copied", "resized", "re-encoded", "skipped")), ("manifest", MANIFEST)]
    print_table(f"reduced {args.src}", rows)
    if out["skipped"]:
        files = {f["path"]: f["reason"] for f in out["skipped_files"]}
        print(f"speedrun: {skipped_line(files, out['skipped'], args.out / MANIFEST)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
