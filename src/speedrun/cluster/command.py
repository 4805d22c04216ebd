"""``speedrun scale``: the cost model of ``model.py`` from the command line.

Reads what the model needs (gradient size, one GPU's speed, the network), checks every value
before anything is written, prints a table and optionally writes a plot and the numbers.
``--calibration`` prints the model against the published runs of ``calibration.py``.
Nothing here imports torch unless ``--recipe`` asks for a model to be built.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from rich.table import Table

from ..errors import UsageError
from ..files import atomic_write_bytes, atomic_write_json, check_output_file
from ..report.console import make_console
from .model import (COMM_BYTES, KNOWN_PARAMS, Network, Workload, default_gpu_counts, network_preset, predict)

out = make_console()
DEFAULT_NETWORK = "dgx-a100"


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------

def parse_gpu_counts(text: str | None) -> list[int]:
    """'1,8,64' -> [1, 8, 64] (sorted, each once); None -> powers of two up to 4096."""
    if text is None:
        return default_gpu_counts()
    counts = set()
    for part in (p.strip() for p in text.split(",")):
        try:
            value = int(part)
        except ValueError:
            raise UsageError(f"--gpus {text!r}: {part!r} is not a whole number (expected e.g. 1,8,64,512)") from None
        if value < 1:
            raise UsageError(f"--gpus {text!r}: {value} GPUs is not possible; every count must be 1 or more")
        counts.add(value)
    return sorted(counts)


def recipe_model_params(name: str, classes: int | None) -> tuple[int, str, int | None]:
    """Parameters of a recipe's model, built on the meta device (no memory, no data needed),
    with the recipe's batch per device when it names one."""
    import torch

    from ..data.sources.builtin import SPECS
    from ..models import build_model
    from ..recipe import load_recipe
    if classes is not None and classes < 1:
        raise UsageError(f"--classes {classes}: must be 1 or more")
    recipe = load_recipe(name)
    spec = SPECS.get(recipe.data.dataset)
    if spec is not None:
        in_channels, num_classes, note = spec.shape[0], spec.num_classes, f"{spec.num_classes} classes"
    else:
        in_channels, num_classes = 3, classes or 1000
        note = f"{num_classes} classes" + ("" if classes else " (ImageNet's; --classes changes it)")
    with torch.device("meta"):
        model = build_model(recipe.model, in_channels, num_classes)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch = recipe.data.per_device_batch or recipe.data.batch_size or None
    return params, f"recipe {recipe.name}, {recipe.model.name} with {note}", batch


def read_step_record(path: str) -> dict:
    """One GPU's measured speed from a throughput record (``benchmarks/throughput.py pipelines``
    writes one): its ``scale_input``, the model step's images/s alone at its batch per GPU and
    the model's parameters, with the recipe, device and precision they were measured with."""
    import json
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--step-record {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UsageError(f"--step-record {path}: not a readable JSON record ({err})") from None
    got = record.get("scale_input") if isinstance(record, dict) else None
    rate = got.get("images_per_second") if isinstance(got, dict) else None
    batch = got.get("batch_per_gpu") if isinstance(got, dict) else None
    if not (isinstance(rate, (int, float)) and rate > 0 and isinstance(batch, int) and batch > 0):
        raise UsageError(f"--step-record {path}: holds no scale_input with images_per_second and batch_per_gpu; "
                         "give a record written by benchmarks/throughput.py pipelines")
    return {**got, "path": str(path)}


def model_params(args, measured: dict | None = None) -> tuple[int, str, int | None]:
    if args.params is not None:
        if args.params < 1:
            raise UsageError(f"--params {args.params}: must be 1 or more")
        return args.params, f"{args.params:,} parameters", None
    if args.recipe:
        return recipe_model_params(args.recipe, args.classes)
    if measured is not None and args.model is None and isinstance(measured.get("params"), int):
        return measured["params"], f"{measured.get('recipe')} as measured", measured["batch_per_gpu"]
    name = (args.model or "resnet50").lower()
    if name not in KNOWN_PARAMS:
        raise UsageError(f"--model {args.model!r}: not known; choose one of {', '.join(KNOWN_PARAMS)}, or give "
                         "--recipe NAME or --params N")
    return KNOWN_PARAMS[name], name, None


def network_from(args) -> Network:
    """The preset, with any link the options give instead."""
    net = network_preset(args.network or DEFAULT_NETWORK)
    changes = {"inter_gbps": args.bandwidth_gbps, "intra_gbps": args.intra_bandwidth_gbps,
               "latency_us": args.latency_us, "gpus_per_node": args.gpus_per_node}
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes:
        given = ", ".join(f"{k}={v:g}" for k, v in changes.items())
        net = replace(net, description=f"{net.description}; changed: {given}", **changes)
    return net.validate()


def workload_from(args, params: int, recipe_batch: int | None, measured: dict | None = None) -> Workload:
    if args.classes is not None and not args.recipe:
        raise UsageError("--classes sets the classes of a --recipe model; give it with --recipe")
    if measured is not None and args.batch_per_gpu is None:
        recipe_batch = measured["batch_per_gpu"]           # the batch the rate was measured at
    batch = args.batch_per_gpu if args.batch_per_gpu is not None else recipe_batch
    if args.global_batch is not None and batch is None:
        batch = args.global_batch                    # one GPU carries the whole batch
    if batch is None:
        raise UsageError("give --batch-per-gpu B: the images each GPU processes per step")
    if args.step_time is not None:
        if not args.step_time > 0:
            raise UsageError(f"--step-time {args.step_time:g}: must be above 0 seconds")
        rate = batch / args.step_time
    elif args.images_per_second is not None:
        rate = args.images_per_second
    elif measured is not None:
        rate = measured["images_per_second"]
    else:
        raise UsageError("give one GPU's speed: --images-per-second X, or --step-time S (seconds per step at "
                         "--batch-per-gpu; `speedrun flops RECIPE --json F` measures model_seconds_per_step), or "
                         "--step-record FILE (a record of benchmarks/throughput.py pipelines)")
    return Workload(gradient_bytes=params * COMM_BYTES[args.comm_dtype], images_per_second=rate,
                    batch_per_gpu=batch, global_batch=args.global_batch, overlap=args.overlap,
                    overhead_s=args.overhead_ms / 1e3).validate()


def _check_outputs(args) -> None:
    if args.plot:
        if not str(args.plot).lower().endswith(".png"):
            raise UsageError(f"--plot {args.plot}: the plot is a PNG; give a file name ending in .png")
        check_output_file(Path(args.plot), "--plot")
    if args.json:
        check_output_file(Path(args.json), "--json")
    if args.plot and args.json and Path(args.plot).resolve() == Path(args.json).resolve():
        raise UsageError("--plot and --json name the same file; give two names")


# ------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------

def scale_command(args) -> int:
    if args.calibration:
        return calibration_command(args)
    gpu_counts = parse_gpu_counts(args.gpus)
    net = network_from(args)
    measured = read_step_record(args.step_record) if getattr(args, "step_record", None) else None
    params, model_label, recipe_batch = model_params(args, measured)
    work = workload_from(args, params, recipe_batch, measured)
    _check_outputs(args)
    dropped = [g for g in gpu_counts if args.global_batch is not None and g > args.global_batch]
    gpu_counts = [g for g in gpu_counts if g not in dropped]
    if not gpu_counts:
        raise UsageError(f"--global-batch {args.global_batch} is smaller than every GPU count asked for; "
                         "each GPU needs at least one image")
    rows = predict(gpu_counts, work, net, args.algorithm)

    mode = (f"strong scaling: global batch {args.global_batch:,} split over the GPUs" if args.global_batch
            else f"weak scaling: {work.batch_per_gpu:g} images per GPU")
    summary = [("model", f"{model_label}: {params:,} parameters"),
               ("gradients", f"{work.gradient_bytes / 1e6:,.1f} MB per step ({args.comm_dtype})"),
               ("one GPU", f"{work.images_per_second:,.1f} images/s at {work.batch_per_gpu:g} per step"),
               *([("measured", f"{measured['images_per_second']:,.1f} images/s at {measured['batch_per_gpu']} per "
                                   f"step, the model step alone of {measured.get('recipe')} in "
                                   f"{measured.get('precision')} on {measured.get('device_name')} "
                                   f"({measured['path']})")] if measured else []),
               ("scaling", mode),
               ("network", f"{net.name}: {net.description}"),
               ("links", f"{net.gpus_per_node} GPUs per node; {net.intra_gbps:g} Gb/s per GPU inside a node, "
                         f"{net.inter_gbps:g} Gb/s per node between nodes, {net.latency_us:g} µs per step"),
               ("all-reduce", f"{args.algorithm}; {work.overlap:.0%} of backward can hide it; "
                              f"fixed overhead {args.overhead_ms:g} ms per step")]
    head = Table(title="speedrun scale: an analytic model, not a measurement", show_header=False)
    head.add_column(style="bold")
    head.add_column()
    for k, v in summary:
        head.add_row(k, v)
    out.print(head)
    table = Table()
    for col in ("GPUs", "nodes", "batch/GPU", "compute ms", "all-reduce ms", "exposed ms", "step ms",
                "images/s", "efficiency"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r.gpus:,}", f"{r.nodes:,}", f"{r.batch_per_gpu:,.4g}", f"{r.compute_s * 1e3:,.2f}",
                      f"{r.allreduce_s * 1e3:,.2f}", f"{r.exposed_s * 1e3:,.2f}", f"{r.step_s * 1e3:,.2f}",
                      f"{r.images_per_s:,.0f}", f"{r.efficiency:.1%}")
    out.print(table)
    if dropped:
        out.print(f"left out: {', '.join(map(str, dropped))} GPUs (more GPUs than images in the global batch)")

    record = {"kind": "speedrun scale prediction", "model": model_label, "params": params,
              "comm_dtype": args.comm_dtype, "algorithm": args.algorithm, "network": asdict(net),
              "workload": asdict(work), "rows": [r.as_dict() for r in rows]}
    if measured:
        record["step_record"] = measured
    if args.plot:
        from ..report.plots import scaling_curves
        title = f"{model_label}, {net.name}, {args.algorithm} all-reduce, {mode}"
        atomic_write_bytes(Path(args.plot), scaling_curves(record["rows"], title))
        out.print(f"plot: {args.plot}")
    if args.json:
        atomic_write_json(Path(args.json), record)
        out.print(f"numbers: {args.json}")
    return 0


def calibration_command(args) -> int:
    from .calibration import calibration_table
    if args.plot:
        raise UsageError("--plot draws a prediction; it is not used with --calibration (--json is)")
    if args.json:
        check_output_file(Path(args.json), "--json")
    rows = calibration_table()
    table = Table(title="speedrun scale --calibration: ResNet-50, predicted against published")
    for col in ("run", "GPUs", "vs GPUs", "network", "all-reduce", "published", "predicted",
                "difference", "with full overlap"):
        table.add_column(col, justify="left" if col in ("run", "network", "all-reduce") else "right")
    for r in rows:
        table.add_row(r["key"], f"{r['gpus']:,}", f"{r['base_gpus']:,}", r["network"],
                      f"{r['algorithm']}, {r['comm_dtype']}", f"{r['published_efficiency']:.1%}",
                      f"{r['predicted_efficiency']:.1%}", f"{r['difference_points']:+.1f} pts",
                      f"{r['predicted_efficiency_full_overlap']:.1%}")
    out.print(table)
    for r in rows:
        out.print(f"[bold]{r['key']}[/]: {r['source']}. Published figure: {r['measure']}. Inputs: {r['inputs']}. "
                  f"Overlap in the run: {r['overlap_in_run']}.")
    if args.json:
        atomic_write_json(Path(args.json), {"kind": "speedrun scale calibration", "runs": rows})
        out.print(f"numbers: {args.json}")
    return 0
