"""Every shipped recipe trains a few real steps through each pipeline it supports, eager in
fp32 and compiled in bf16, and ends with a complete run record; between them, the runs here
set every recipe field to a value other than its default at least once. Recipes whose steps
share the model, optimizer, weight average, loss and pipeline share one compiled bf16 entry
(tests/matrix.py: COMPILED_BY, checked below): a bf16 step is emulated, and slow, on CPUs
without native bf16.

Data: small real sets made from ../shared/datasets (conftest.py): CIFAR-10 and Fashion-MNIST
subsets (.npz, resident), CIFAR-10 as JPEG folders at 32 px (ImageNet layout), upscaled to
64 px (Tiny-ImageNet layout) and to 224 px (ImageNet layout), streamed, and the 32 and 64 px
folders decoded once with `speedrun data prepare` (resident). Networks are made small (widths),
photos train at 32 px, and runs are a few epochs of their slice: long enough that every entry
beats chance by three standard errors of its test accuracy, which it must; everything else is
the recipe's own (warm-ups and averages scaled to the short run where they are counted in
epochs or steps: tests/matrix.py).

"Compiled" is torch.compile with the backend named in each entry: inductor (what a GPU
runs, code generation included) for cifar10-94 in bf16, the CUDA default of the project's main
recipe (in two processes: the second must reuse every graph the first compiled into speedrun's
compile folder), and dynamo + AOTAutograd (aot_eager: the same graph capture, guards and joint
forward/backward graph, run by eager kernels) for the rest, whose cold inductor compiles take
from 35 s (a ResNet-18) to 78 s (a ResNet-50) each on a 2-core CPU; inductor's numerics are
tested on their own in test_loop.py (the bf16 global max pool).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speedrun.cli import main
from speedrun.recipe import Recipe, load_recipe, shipped_recipes

from matrix import COMPILED_BY, FIELDS, MATRIX, NPZ, SPEEDNET, Entry, bar, command, step_features
from test_cli import speedrun
from test_docs import field_paths


def _data(request, name: str):
    if name == "jpeg32_train":
        return request.getfixturevalue("jpeg32") / "train"
    return request.getfixturevalue(name)


TEACHER = MATRIX[0]
"""cifar10-94 in fp32, eager, on CIFAR-10's first 1,024 images: a matrix entry whose run is also
the model the distillation entry distils from and the fine-tuning entries start from."""
assert TEACHER.recipe == "cifar10-94" and TEACHER.data == "cifar_small" and TEACHER.backend is None \
    and TEACHER.precision == "fp32" and TEACHER.sets == tuple(NPZ + SPEEDNET) and not TEACHER.args


@pytest.fixture
def teacher(teacher_run):
    return teacher_run / "model.pt"


def _train(entry: Entry, data, out, monkeypatch, request) -> None:
    teacher = request.getfixturevalue("teacher") if {"teacher", "init"} & set(entry.args) else None
    argv, env = command(entry, data, out, teacher=teacher)
    if entry.cache_reuse:
        return _train_twice(argv, out, env)
    if entry.subprocess:
        speedrun(*argv, env=env)
        return
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(argv) == 0


def _train_twice(argv: list[str], out: Path, env: dict) -> None:
    """Two processes of the same run with no $TORCHINDUCTOR_CACHE_DIR of the user's: the first
    compiles into $SPEEDRUN_CACHE/compiled and says so at start, the second (into ``out``'s
    sibling ``again``) finds every graph there (inductor's FX-graph cache hits, written into the
    summary). Times are not asserted; the hits are."""
    cache = out.parent / "cache"
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}, **env,
           "SPEEDRUN_CACHE": str(cache)}
    summaries = []
    for folder in (out, out.parent / "again"):
        args = [str(folder) if a == str(out) else a for a in argv]
        proc = subprocess.run([sys.executable, "-m", "speedrun", *args], capture_output=True, text=True, env=env,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr
        assert f"less where {cache / 'compiled'} holds them" in proc.stdout
        summaries.append(json.loads((folder / "summary.json").read_text()))
    first, second = summaries
    assert first["compile_cache_dir"] == second["compile_cache_dir"] == str(cache / "compiled")
    assert first["compile_cache_misses"] > 0 and first["compile_cache_hits"] == 0
    assert second["compile_cache_hits"] == first["compile_cache_misses"] and second["compile_cache_misses"] == 0
    assert any((cache / "compiled").rglob("*"))
    assert second["recompiles"] == first["recompiles"] == 0


def check_record(out, entry: Entry) -> dict:
    """The run record is complete and consistent."""
    recipe = load_recipe(str(out / "config.toml"))
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("recipe", "recipe_hash", "test_acc", "test_acc_no_tta", "epochs", "steps", "train_seconds",
                "compile_seconds", "recompiles", "wall_seconds", "device", "precision", "compile", "compile_backend",
                "channels_last", "torch_version", "git_commit", "total_flops", "seed"):
        assert key in summary, key
    assert summary["recipe"] == entry.recipe == recipe.name and summary["recipe_hash"] == recipe.digest()
    assert summary["precision"] == entry.precision and summary["compile"] == (entry.backend is not None)
    assert summary["compile_backend"] == entry.backend
    assert summary["recompiles"] == 0                           # the warm-up compiled every shape
    # the Newton-Schulz products: none without orthogonal filters; else the field, or auto's run precision
    ns = None if recipe.optim.filters != "orthogonal" else \
        recipe.optim.ns_precision if recipe.optim.ns_precision != "auto" else entry.precision
    assert summary["newton_schulz_dtype"] == ns
    # eager bf16 on this CPU with runtime.conv_weight_grad=auto: each 3x3 shape measured and its choice kept
    measured = entry.precision == "bf16" and entry.backend is None and recipe.runtime.conv_weight_grad == "auto"
    assert bool(summary["conv_weight_grad_choices"]) == measured, summary["conv_weight_grad_choices"]
    # the run learned: better than chance by three standard errors of the accuracy on its test slice
    classes = len(json.loads((out / "preprocessing.json").read_text())["classes"])
    n = summary["test_images"]
    least = bar(classes, n)
    assert summary["test_acc"] >= least and summary["test_acc_no_tta"] >= least, \
        f"{entry.id}: accuracy {summary['test_acc']:.3f} (no TTA {summary['test_acc_no_tta']:.3f}) on {n} test " \
        f"images of {classes} classes; chance + 3 SE = {least:.3f}"
    assert summary["steps"] >= 3 and 0 < summary["train_seconds"] < summary["wall_seconds"]
    # the start-up (the warm-up in it) ends where the training clock starts: within the run's wall time
    # (measured from speedrun's entry point; in a process, the interpreter's share before it is added)
    assert summary["compile_seconds"] <= summary["start_up_seconds"] and \
        summary["start_up_seconds"] - (summary["before_main_seconds"] or 0) <= summary["wall_seconds"] - summary["train_seconds"]
    assert len(rows) == math.ceil(summary["epochs"] - 1e-9) and rows[-1]["test_acc"] == summary["test_acc_no_tta"]
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    state = torch.load(out / "model.pt", weights_only=True)
    assert state and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    for name in entry.expect_files:
        assert (out / name).is_file(), name
    return summary


@pytest.mark.parametrize("entry", [pytest.param(e, marks=pytest.mark.slow) if e.precision == "bf16" else e
                                   for e in MATRIX + FIELDS], ids=lambda e: e.id)   # (bf16: emulated on many CPUs)
def test_recipe_trains_and_writes_a_complete_record(entry, tmp_path, monkeypatch, request):
    if entry is TEACHER:                              # (trained once, for the entries that start from it too)
        check_record(request.getfixturevalue("teacher_run"), entry)
        return
    data = _data(request, entry.data)
    _train(entry, data, tmp_path / "run", monkeypatch, request)
    check_record(tmp_path / "run", entry)


def test_every_shipped_recipe_is_in_the_matrix_in_both_precisions_eager_and_compiled():
    for name in shipped_recipes():
        modes = {(e.precision, e.backend is not None) for e in MATRIX if e.recipe == name}
        assert ("fp32", False) in modes, name
        if name not in COMPILED_BY:
            assert ("bf16", True) in modes, name
            continue
        # its compiled bf16 step is another recipe's entry on the same pipeline, which compiles every
        # part of this recipe's step
        assert ("bf16", True) not in modes, f"{name} has its own compiled bf16 entry: drop it from COMPILED_BY"
        own = next(e for e in MATRIX if e.recipe == name)
        by = [e for e in MATRIX + FIELDS if e.recipe == COMPILED_BY[name] and e.precision == "bf16" and e.backend]
        assert by, f"{COMPILED_BY[name]} has no compiled bf16 entry to cover {name}"
        missing = step_features(load_recipe(name, list(own.sets))) - step_features(load_recipe(by[0].recipe, list(by[0].sets)))
        assert not missing, f"{name}'s step has {sorted(missing)}, which {COMPILED_BY[name]}'s compiled entry lacks"
        assert _pipeline(own.data) == _pipeline(by[0].data), (name, own.data, by[0].data)
    modes = {(e.precision, e.backend is not None) for e in MATRIX}
    assert modes == {("fp32", False), ("bf16", True), ("bf16", False), ("fp32", True)}
    # streamed (CIFAR-10 in fp32, Fashion-MNIST in bf16), resident
    assert {e.data for e in MATRIX if e.recipe == "folder"} == {"jpeg32", "fashion_jpeg", "npz32"}
    for name in ("imagenet-resnet50", "imagenet-resnet50-lars", "imagenet-resnet18-fast", "tiny-imagenet"):
        assert len({e.data for e in MATRIX if e.recipe == name}) == 2, name


def _pipeline(data: str) -> str:
    """The kind of data a matrix fixture is: arrays (.npz, resident), an image folder."""
    return "arrays" if data in ("cifar_small", "fashion_small", "npz32", "tiny_npz32") else "folder"


def test_step_features_tell_the_covering_entries_apart():
    """The check above can fail: cifar10-94 (plain SGD filters) does not cover cifar10-94-fast
    (orthogonal filter updates), nor a ResNet-18 a ResNet-50."""
    fast, base = step_features(load_recipe("cifar10-94-fast")), step_features(load_recipe("cifar10-94"))
    assert "filters=orthogonal" in fast - base
    assert step_features(load_recipe("imagenet-resnet50")) - step_features(load_recipe("imagenette"))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out


def _defaults(model=Recipe, prefix: str = "") -> dict:
    """Field path -> default, for every field that has one (per member of a union)."""
    out = {}
    for name, f in model.model_fields.items():
        options = getattr(f.annotation, "__args__", (f.annotation,))
        nested = [o for o in options if isinstance(o, type) and hasattr(o, "model_fields")]
        if nested:
            for n in nested:
                for k, v in _defaults(n, f"{prefix}{name}.").items():
                    out.setdefault(k, []).extend(v)
        elif not f.is_required():
            d = f.get_default(call_default_factory=True)
            out.setdefault(prefix + name, []).append(list(d) if isinstance(d, tuple) else d)
    return out


def test_every_recipe_field_is_set_away_from_its_default_by_some_run():
    defaults = _defaults()
    exercised, seen = set(), {}
    for e in MATRIX + FIELDS:
        sets = list(e.sets) + (["distill.teacher=x"] if "teacher" in e.args else []) + \
            (["model.init=x"] if "init" in e.args else [])
        if e.data == "jpeg32_train":
            sets.append("data.path=x")
        values = _flatten(load_recipe(e.recipe, sets).to_dict())
        values["runtime.compile"] = "on" if e.backend else "off"
        values["runtime.precision"] = e.precision
        if e.data != "jpeg32_train":
            values["data.path"] = "from --data-dir"
        exercised |= {k for k, v in values.items() if k not in defaults or v not in defaults[k]}
        for k, v in values.items():
            seen.setdefault(k, []).append(v)
    # the multi-process runs of tests/test_distributed.py set the [distributed] fields
    source = (Path(__file__).parent / "test_distributed.py").read_text()
    for item in sorted(set(re.findall(r'"((?:distributed|model\.norm)\.\w+=[^"{]+)"', source))):
        values = _flatten(load_recipe("fashion-mnist", [item]).to_dict())
        exercised |= {k for k, v in values.items() if k not in defaults or v not in defaults[k]}
    # the network tests (test_custom_network.py; test_timm_networks.py, in CI's torch 2.14.1 stage) set the
    # [model] fields of timm's networks and of your own as "model.FIELD=..." overrides or "FIELD": recipe keys
    source = "".join((Path(__file__).parent / f).read_text() for f in ("test_custom_network.py",
                                                                        "test_timm_networks.py", "networks.py"))
    exercised |= {f"model.{k}" for k in set(re.findall(r'model\.(\w+)=', source)) | set(re.findall(r'"(\w+)": ', source))
                  if f"model.{k}" in set(field_paths(Recipe))}
    # a tag of a union (model.name, schedule.kind) has one default per member: every member is used
    exercised |= {k for k, d in defaults.items() if len(set(map(str, d))) > 1 and all(x in seen.get(k, []) for x in d)}
    # max-autotune is refused on a CPU and CUDA graphs replay only on CUDA (see tests/matrix.py)
    exercised |= {"runtime.compile_mode", "runtime.cuda_graphs"}
    missing = sorted(set(field_paths(Recipe)) - exercised)
    assert not missing, f"no run sets these fields away from their defaults: {missing}"
