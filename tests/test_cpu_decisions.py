"""What "auto" becomes on a CPU, as pure functions of what the CPU and torch report, and
checked against this machine: bf16 only where the CPU computes it natively."""
from __future__ import annotations

import pytest
import torch

from speedrun import compat
from speedrun.engine.runtime import auto_cpu_compile, auto_cpu_precision, resolve_runtime
from speedrun.recipe import load_recipe


@pytest.mark.parametrize("units, precision", [
    ((), "fp32"),                          # Zen 3, Skylake-X, Ice Lake: bf16 would be emulated
    (("avx512_bf16",), "bf16"),            # Zen 4, Zen 5, Cooper Lake
    (("amx",), "bf16"),                    # Sapphire Rapids and later without AVX-512 BF16 reported
    (("avx512_bf16", "amx"), "bf16"),
])
def test_auto_cpu_precision_is_bf16_only_with_native_units(units, precision):
    assert auto_cpu_precision(units) == precision


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_the_bf16_units_torch_reports_are_the_ones_the_kernel_lists():
    """torch's CPU feature probes agree with /proc/cpuinfo on this machine (whichever it is)."""
    flags = _cpu_flags()
    units = compat.cpu_bf16_units()
    assert ("avx512_bf16" in units) == ("avx512_bf16" in flags)
    assert ("amx" in units) == ("amx_tile" in flags)


def test_resolved_cpu_runtime_says_why():
    rt = resolve_runtime(load_recipe("fashion-mnist").runtime, torch.device("cpu"))
    expected = "bf16" if compat.cpu_bf16_units() else "fp32"
    assert rt.precision == expected
    assert rt.choices[0].startswith(f"precision {expected}: ") and "bf16" in rt.choices[0]
    assert rt.describe()["runtime_choices"] == list(rt.choices)
    pinned = resolve_runtime(load_recipe("fashion-mnist", ["runtime.precision=fp32"]).runtime, torch.device("cpu"))
    assert pinned.precision == "fp32" and not any(c.startswith("precision") for c in pinned.choices)


@pytest.mark.parametrize("model, precision, steps, norm_fp32, compiled", [
    ("speednet", "bf16", 100_000, True, False),    # no faster compiled on a CPU (Zen 4 bf16, Zen 3 fp32)
    ("speednet", "bf16", 100_000, False, False),
    ("speednet", "fp32", 100_000, True, False),
    ("resnet", "bf16", 2000, True, True),          # fp32 batch norm: 22% faster per step, pays after ~700 steps
    ("resnet", "bf16", 1999, True, False),
    ("resnet", "bf16", 100_000, False, False),     # bf16 batch norm: eager 1.91 s a step, compiled 2.79 s
    ("resnet", "fp32", 100_000, True, False),      # +6% on a Zen 4, -8% on a Zen 3
    (None, "bf16", None, True, False),             # length unknown: eager
    ("timm", "bf16", 100_000, True, False),        # not timed compiled on a CPU: eager, saying so
    ("custom", "fp32", 100_000, True, False),
])
def test_auto_cpu_compile_follows_the_measurements(model, precision, steps, norm_fp32, compiled):
    on, why = auto_cpu_compile(model, precision, steps, norm_fp32)
    assert on is compiled and why.startswith("compile on" if compiled else "compile off")
    assert "measured" not in why                      # (on the CPUs the timings come from)
    if model in ("timm", "custom"):
        whose = "timm" if model == "timm" else "your"
        assert why == (f"compile off: speedrun has not timed {whose} networks compiled on a CPU, so they run "
                       "eager (runtime.compile=on compiles them)")


def test_the_compile_line_says_its_timings_come_from_another_cpu():
    """On an Intel CPU the line that cites Zen 4 timings says they were measured there, not here."""
    name = "Intel(R) Xeon(R) Platinum 8488C"
    _, why = auto_cpu_compile("resnet", "bf16", 100_000, False, cpu=name)
    assert "Zen 4" in why and why.endswith(f"timings measured on 2-core AMD EPYCs (Zen 3, Zen 4), not on this CPU "
                                           f"({name})")
    _, why = auto_cpu_compile("speednet", "fp32", 100, True, cpu="AMD EPYC 7B13")
    assert "not on this CPU" not in why


def test_the_imagenette_recipes_stay_eager_on_a_cpu():
    """The 20-epoch recipe (2,960 steps, past the run length where a ResNet compiles) trains its
    ResNet-18D with batch norm in bf16, which is faster eager: the decision reads
    model.norm.fp32 from the recipe, and says why."""
    for name in ("imagenette", "imagenette-20"):
        r = load_recipe(name)
        rt = resolve_runtime(r.runtime.model_copy(update={"precision": "bf16"}), torch.device("cpu"), r.model.name,
                             20 * 147, r.model.norm.fp32)
        assert not rt.compile, name
        assert any("batch norm in bf16 runs faster eager" in c for c in rt.choices), rt.choices
    fp32_norm = load_recipe("imagenette-20", ["model.norm.fp32=true", "runtime.precision=bf16"])
    rt = resolve_runtime(fp32_norm.runtime, torch.device("cpu"), "resnet", 20 * 147, fp32_norm.model.norm.fp32)
    assert rt.compile


def test_auto_batch_norm_precision_on_a_cpu_is_said_and_keeps_resnets_eager():
    """model.norm.fp32 = auto (the default): batch norm reads bf16 on a CPU, which the start
    line says, and a long bf16 ResNet run then stays eager (its faster form)."""
    r = load_recipe("imagenet-resnet50", ["runtime.precision=bf16"])
    assert r.model.norm.fp32 == "auto"
    rt = resolve_runtime(r.runtime, torch.device("cpu"), "resnet", 5000, r.model.norm.fp32)
    assert not rt.compile
    assert any(c.startswith("batch norm in bf16") for c in rt.choices), rt.choices
    fp32 = resolve_runtime(load_recipe("imagenet-resnet50", ["runtime.precision=fp32"]).runtime, torch.device("cpu"),
                           "resnet", 5000, "auto")
    assert not any(c.startswith("batch norm") for c in fp32.choices)      # nothing to say in fp32


def test_the_run_length_decides_compiling_a_resnet_on_a_cpu():
    cfg = load_recipe("imagenet-resnet50", ["runtime.precision=bf16"]).runtime
    long = resolve_runtime(cfg, torch.device("cpu"), "resnet", 5000)
    short = resolve_runtime(cfg, torch.device("cpu"), "resnet", 50)
    assert long.compile and not short.compile
    assert any(c.startswith("compile on: a ResNet in bf16 for 5000 steps") for c in long.choices)
    assert any(c.startswith("compile off: 50 steps do not pay") for c in short.choices)
    pinned = resolve_runtime(load_recipe("imagenet-resnet50", ["runtime.compile=off"]).runtime, torch.device("cpu"),
                             "resnet", 5000)
    assert not pinned.compile and not any(c.startswith("compile") for c in pinned.choices)


def test_without_a_cpp_compiler_a_cpu_run_is_eager_and_says_so(tmp_path, fashion_small):
    """A real process whose PATH holds no C++ compiler: runtime.compile=on falls back to eager,
    says why at start and records it."""
    import json
    import os
    import subprocess
    import sys
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PATH"] = str(bin_dir)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "speedrun", "train", "fashion-mnist", "--data-dir", fashion_small,
                           "--set", "data.dataset=npz", "--set", "model.widths=[16,32,32]", "--set", "data.batch_size=64",
                           "--set", "train.epochs=3",
                           "--set", "runtime.compile=on", "--set", "runtime.precision=fp32", "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compile off: no C++ compiler found for inductor" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["compile"] is False
    chance = 0.1 + 3 * (0.1 * 0.9 / summary["test_images"]) ** 0.5
    assert summary["test_acc"] > chance, (summary["test_acc"], chance)       # and the eager run learned
    assert any("no C++ compiler" in c for c in summary["runtime_choices"])
