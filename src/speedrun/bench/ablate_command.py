"""The ``ablate`` command: the recipe benchmarked with each trick turned off in turn (ablate.json,
ablation.png)."""
from __future__ import annotations

from rich.table import Table

from ..errors import RunFolderError
from ..files import OutputFolder, atomic_write_bytes, read_json_record
from ..report.console import TrainingProgress, make_console
from .ablate import run_ablation
from .common import out_folder, recipe_and_device

out = make_console()


def ablate_command(args) -> int:
    from ..report.html import ABLATION_COLUMNS, ablation_rows
    from ..report.plots import ablation_chart
    recipe, device = recipe_and_device(args, ["eval.every=0"])
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None
    grid = args.epochs_grid
    previous = None
    if args.resume:
        if args.out is None:
            raise RunFolderError("--resume needs --out: the folder of the interrupted ablation")
        previous = read_json_record(args.out / "ablate.json", "ablate.json", "variants",
                                    "nothing to resume; run without --resume to start the ablation",
                                    RunFolderError)
        folder = OutputFolder(args.out)
    else:
        folder = out_folder(args.out, "ablate", recipe.name, "ablate.json")
    try:
        with TrainingProgress(recipe.name, args.log_every) as progress:
            def on_variant(row):
                progress.print(f"{row['label']}: acc {row['test_acc']['mean']:.4f}, "
                               f"train+eval {row['time']['mean']:.3f} s")
            record = run_ablation(recipe, device, args.runs, args.data_dir, split(args.tricks), split(args.ladder),
                                  grid, folder.path / "ablate.json", progress, on_variant, previous)
    except BaseException:
        folder.discard()
        raise
    chart = folder.path / "ablation.png"
    atomic_write_bytes(chart, ablation_chart(record["variants"], record["target"]))
    t = Table(title=f"ablate {recipe.name}: {args.runs} runs per variant")
    for col in ABLATION_COLUMNS:
        t.add_column(col, justify="right")
    for row in ablation_rows(record):
        t.add_row(*row)
    out.print(t)
    out.print(f"record: {folder.path / 'ablate.json'}\nchart: {chart}")
    return 0
