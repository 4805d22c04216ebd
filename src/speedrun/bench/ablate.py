"""``speedrun ablate``: what each trick of a recipe buys.

Leave-one-out: the recipe is benchmarked as it is and with each trick turned off in turn.
Ladder (``--ladder a,b,c``): the recipe with all the named tricks off, then with them
turned back on one at a time in the given order, as in Page's series where each added
trick let training stop earlier. With ``--epochs-grid 0.6,0.8,1.0`` each variant is also
run at those fractions of its epochs, and the epochs it needs to reach the target mean
accuracy are interpolated.

An ablation is long (variants x runs), so the record is rewritten after every variant and
``--resume`` continues an interrupted one: variants already in the record are kept when the
recipe, runs per variant and epochs grid are the same, and only the missing ones are run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import RecipeError, RecordError
from ..files import atomic_write_json
from ..recipe import Recipe, apply_overrides, recipe_from_dict
from .stats import welch


@dataclass(frozen=True)
class Trick:
    name: str
    what: str
    is_on: Callable[[Recipe], bool]
    off: Callable[[Recipe], list[str]]


def _speednet(r: Recipe) -> bool:
    return r.model.name == "speednet"


TRICKS: list[Trick] = [
    Trick("alternating_flip", "alternating instead of random flips", lambda r: r.augment.flip == "alternating",
          lambda r: ["augment.flip=random"]),
    Trick("flip", "horizontal flips", lambda r: r.augment.flip != "none", lambda r: ["augment.flip=none"]),
    Trick("translate", "random crop (translation)", lambda r: r.augment.translate > 0,
          lambda r: ["augment.translate=0"]),
    Trick("cutout", "cutout", lambda r: r.augment.cutout > 0, lambda r: ["augment.cutout=0"]),
    Trick("label_smoothing", "label smoothing", lambda r: r.train.label_smoothing > 0,
          lambda r: ["train.label_smoothing=0"]),
    Trick("whitening", "frozen patch-whitening first layer", lambda r: _speednet(r) and r.model.whiten.kernel > 0,
          lambda r: ["model.whiten.kernel=0"]),
    Trick("whiten_bias", "training the whitening bias",
          lambda r: _speednet(r) and r.model.whiten.kernel > 0 and r.model.whiten.train_bias_epochs > 0,
          lambda r: ["model.whiten.train_bias_epochs=0"]),
    Trick("ghost_bn", "ghost batch norm", lambda r: r.model.norm.ghost_batch > 0, lambda r: ["model.norm.ghost_batch=0"]),
    Trick("frozen_bn_scale", "frozen batch-norm scale", lambda r: r.model.norm.scale == "frozen",
          lambda r: ["model.norm.scale=learned"]),
    Trick("identity_init", "Dirac initialisation", lambda r: _speednet(r) and r.model.identity_init,
          lambda r: ["model.identity_init=false"]),
    Trick("smooth_activation", "CELU/GELU instead of ReLU",
          lambda r: _speednet(r) and r.model.activation != "relu", lambda r: ["model.activation=relu"]),
    Trick("logit_scale", "scaled logits", lambda r: _speednet(r) and r.model.out_scale != 1,
          lambda r: ["model.out_scale=1.0"]),
    Trick("bias_lr_mult", "larger LR for batch-norm biases", lambda r: r.optim.norm_bias_lr_mult != 1,
          lambda r: ["optim.norm_bias_lr_mult=1.0"]),
    Trick("nesterov", "Nesterov momentum", lambda r: r.optim.nesterov and r.optim.momentum > 0,
          lambda r: ["optim.nesterov=false"]),
    Trick("no_bias_decay", "no decay on biases and norms", lambda r: r.optim.no_decay_bias_norm,
          lambda r: ["optim.no_decay_bias_norm=false"]),
    Trick("layer_decay", "layer-wise LR decay", lambda r: r.optim.layer_decay < 1,
          lambda r: ["optim.layer_decay=1.0"]),
    Trick("orthogonal_filters", "orthogonalised (Muon) updates for conv filters",
          lambda r: r.optim.filters == "orthogonal", lambda r: ["optim.filters=same"]),
    Trick("partial_tta", "TTA only on the least confident images", lambda r: r.eval.tta != "none"
          and r.eval.tta_fraction < 1, lambda r: ["eval.tta_fraction=1.0"]),
    Trick("weight_averaging", "EMA / lookahead weight averaging", lambda r: r.averaging.kind != "none",
          lambda r: ["averaging.kind=none"]),
    Trick("tta", "test-time augmentation", lambda r: r.eval.tta != "none", lambda r: ["eval.tta=none"]),
    Trick("translate_tta", "translated TTA views", lambda r: r.eval.tta == "flip_translate",
          lambda r: ["eval.tta=flip"]),
]
BY_NAME = {t.name: t for t in TRICKS}


def tricks_of(recipe: Recipe, names: list[str] | None = None) -> list[Trick]:
    """The tricks the recipe uses (or the named ones, which must be in use)."""
    if names is None:
        return [t for t in TRICKS if t.is_on(recipe)]
    chosen = []
    for name in names:
        if name not in BY_NAME:
            raise RecipeError(f"unknown trick {name!r}; known: {', '.join(BY_NAME)}")
        if not BY_NAME[name].is_on(recipe):
            raise RecipeError(f"trick {name!r} is not used by recipe {recipe.name!r}, so it cannot be ablated")
        chosen.append(BY_NAME[name])
    return chosen


def with_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """The variant; it keeps the user's --set values (and adds its own) for the data to apply
    after choosing the model (a folder recipe's ``data.auto_choices``)."""
    variant = recipe_from_dict(apply_overrides(recipe.to_dict(), overrides), source=f"{recipe.name} variant")
    variant._overrides = [*recipe._overrides, *overrides]
    return variant


def plan(recipe: Recipe, tricks: list[Trick], ladder: list[Trick] | None) -> list[dict]:
    """Variants to benchmark: {'label', 'kind', 'overrides', 'recipe', 'against'}."""
    variants = [{"label": "recipe", "kind": "baseline", "overrides": [], "recipe": recipe, "against": None}]
    for t in tricks:
        ov = t.off(recipe)
        variants.append({"label": f"without {t.name}", "kind": "leave_one_out", "trick": t.name,
                         "overrides": ov, "recipe": with_overrides(recipe, ov), "against": "recipe"})
    if ladder:
        off = [o for t in ladder for o in t.off(recipe)]
        prev = "ladder: none"
        variants.append({"label": prev, "kind": "ladder", "overrides": off,
                         "recipe": with_overrides(recipe, off), "against": None})
        for i, t in enumerate(ladder):
            ov = [o for u in ladder[i + 1:] for o in u.off(recipe)]
            label = f"ladder: +{t.name}"
            variants.append({"label": label, "kind": "ladder", "trick": t.name, "overrides": ov,
                             "recipe": with_overrides(recipe, ov), "against": prev})
            prev = label
    return variants


def epochs_to_target(points: list[tuple[float, float]], target: float) -> dict:
    """Interpolate the epochs at which mean accuracy reaches ``target`` from (epochs, mean acc)
    points; {'epochs': value, 'bound': '=' | '<=' | '>'}."""
    points = sorted(points)
    for i, (e, acc) in enumerate(points):
        if acc >= target:
            if i == 0:
                return {"epochs": e, "bound": "<="}
            e0, a0 = points[i - 1]
            return {"epochs": e0 + (e - e0) * (target - a0) / (acc - a0), "bound": "="}
    return {"epochs": points[-1][0] if points else None, "bound": ">"}


def _same(row: dict | None, variant: dict) -> bool:
    """Whether a recorded row is this planned variant, finished."""
    return (row is not None and row.get("overrides") == variant["overrides"]
            and row.get("against") == variant["against"]
            and any(p.get("fraction") == 1.0 for p in row.get("grid") or []))


def deltas(variant: dict, reference: dict) -> dict:
    """Change of mean accuracy and train+eval time from ``reference`` to ``variant``."""
    acc = welch([r["test_acc"] for r in reference["runs"]], [r["test_acc"] for r in variant["runs"]])
    tim = welch([r["times"]["train+eval"] for r in reference["runs"]],
                [r["times"]["train+eval"] for r in variant["runs"]])
    return {"delta_acc": acc["diff"], "p_acc": acc["p"], "delta_time": tim["diff"], "p_time": tim["p"]}


def check_record(previous: dict, path) -> None:
    """RecordError naming ``path`` unless ``previous`` has the shape of an ablate.json."""
    def bad(where: str):
        return RecordError(f"{path}: entry {where} is missing or damaged; it is not an ablate.json that "
                           "speedrun can resume (start a new ablation with another --out)")
    if not isinstance(previous.get("environment"), dict) or not isinstance(previous.get("variants"), list):
        raise bad("'environment' or 'variants'")
    grid = previous.get("epochs_grid")
    if not isinstance(grid, list) or not all(isinstance(g, (int, float)) for g in grid):
        raise bad("'epochs_grid'")
    for i, row in enumerate(previous["variants"]):
        if not isinstance(row, dict) or not isinstance(row.get("label"), str) or not isinstance(row.get("grid"), list):
            raise bad(f"variants[{i}]")
        for j, point in enumerate(row["grid"]):
            if not (isinstance(point, dict) and isinstance(point.get("runs"), list)
                    and isinstance(point.get("summary"), dict) and isinstance(point.get("fraction"), (int, float))):
                raise bad(f"variants[{i}].grid[{j}]")


def check_resumable(previous: dict, recipe: Recipe, runs: int, grid: list[float], device_name: str) -> None:
    """Raise RecipeError naming what differs when ``previous`` (an ablate.json) cannot be
    continued with these settings."""
    mismatches = []
    if previous.get("recipe_hash") != recipe.digest():
        mismatches.append(f"recipe (hash {previous.get('recipe_hash')} in the record, {recipe.digest()} now: "
                          "the same recipe, --set values and --seed are needed)")
    if previous.get("runs_per_variant") != runs:
        mismatches.append(f"--runs ({previous.get('runs_per_variant')} in the record, {runs} now)")
    if [float(g) for g in previous.get("epochs_grid", [])] != grid:
        mismatches.append(f"--epochs-grid ({previous.get('epochs_grid')} in the record, {grid} now)")
    before = previous.get("environment", {}).get("device_name")
    if before != device_name:
        mismatches.append(f"device ({before!r} in the record, {device_name!r} now)")
    if mismatches:
        raise RecipeError("cannot resume this ablation; it differs in " + "; ".join(mismatches))


def run_ablation(recipe: Recipe, device, runs: int, data_dir=None, tricks: list[str] | None = None,
                 ladder: list[str] | None = None, grid: list[float] | None = None, out_path=None,
                 progress=None, on_variant=None, previous: dict | None = None) -> dict:
    """Benchmark every variant (at every grid point) and compute the table's rows.

    ``previous``: an interrupted record of the same ablation; its finished variants are kept."""
    from ..engine.plan import plan_run
    from ..report.environment import environment
    from .runner import run_bench

    grid = sorted(set(grid or [1.0]))
    if 1.0 not in grid:
        grid.append(1.0)
    chosen = tricks_of(recipe, tricks)
    ladder_tricks = tricks_of(recipe, ladder) if ladder else None
    variants = plan(recipe, chosen, ladder_tricks)
    # the environment as the recipe itself runs: its runtime planned on its data (each variant's
    # bench plans its own, which may differ where a variant changes the model)
    env = {**environment(), **plan_run(recipe, data_dir, device, fit_batch=False).runtime.describe()}
    record = {"recipe": recipe.name, "target": recipe.target, "recipe_hash": recipe.digest(),
              "recipe_config": recipe.to_dict(),
              "runs_per_variant": runs, "epochs_grid": grid, "variants": [], "environment": env}
    done: dict[str, dict] = {}
    if previous is not None:
        check_record(previous, out_path)
        check_resumable(previous, recipe, runs, grid, env["device_name"])
        done = {row["label"]: row for row in previous.get("variants", [])}
        # the record keeps the environment its first variants ran in; each resumption is listed
        record["environment"] = previous["environment"]
        record["resumed"] = previous.get("resumed", []) + [{
            "kept": [v["label"] for v in variants if _same(done.get(v["label"]), v)], "environment": env}]
    benches: dict[str, dict] = {}
    for v in variants:
        old = done.get(v["label"])
        if _same(old, v):
            full = next(p for p in old["grid"] if p["fraction"] == 1.0)
            benches[v["label"]] = {"runs": full["runs"], "summary": full["summary"]}
            row = dict(old)
            row.update(deltas(benches[v["label"]], benches[v["against"]]) if v["against"] else {})
            record["variants"].append(row)
            continue
        points, main = [], None
        for g in grid:
            epochs = v["recipe"].train.epochs * g
            r = with_overrides(v["recipe"], [f"train.epochs={epochs!r}"]) if g != 1.0 else v["recipe"]
            bench = run_bench(r, device, runs, data_dir, progress=progress)
            bench.pop("environment", None)
            for run in bench["runs"]:
                run.pop("history", None)
            points.append({"fraction": g, "epochs": epochs, "summary": bench["summary"], "runs": bench["runs"]})
            if g == 1.0:
                main = bench
        benches[v["label"]] = main
        row = {k: v[k] for k in ("label", "kind", "overrides", "against")}
        row["trick"] = v.get("trick")
        row["test_acc"] = main["summary"]["test_acc"]
        row["time"] = main["summary"]["times"]["train+eval"]
        row["epochs"] = v["recipe"].train.epochs
        row["grid"] = points
        row["epochs_to_target"] = epochs_to_target(
            [(p["epochs"], p["summary"]["test_acc"]["mean"]) for p in points], recipe.target)
        row.update(deltas(main, benches[v["against"]]) if v["against"] else
                   {"delta_acc": None, "p_acc": None, "delta_time": None, "p_time": None})
        record["variants"].append(row)
        if out_path is not None:
            atomic_write_json(out_path, record)
        if on_variant is not None:
            on_variant(row)
    return record
