"""What "auto" becomes on a CPU, as pure functions of what the CPU and torch report, and
checked against this machine: bf16 only where the CPU computes it natively."""
from __future__ import annotations

import pytest
import torch

from speedrun import compat
from speedrun.engine.runtime import auto_cpu_precision, resolve_runtime
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
