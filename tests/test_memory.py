"""runtime.hold_memory: glibc keeps freed memory, so a step's large blocks reuse their pages."""
import json
import subprocess
import sys

import pytest
import torch

from speedrun.engine.memory import auto_hold_memory, c_library
from speedrun.engine.runtime import resolve_runtime
from speedrun.errors import RecipeError
from speedrun.recipe import RuntimeConfig

# A "step" that allocates 40, 48 and 64 MiB (torch.ones touches every page) and frees them;
# three steps to settle, then the minor page faults of five more. glibc's default maps such
# blocks afresh each time, and every 4 KiB page faults again on first touch; with freed memory
# held, the heap's free blocks serve the next step (at most one block may still be carved anew
# now and then, where a small allocation landed after a freed one).
FAULTS = """
import json, resource, sys
import torch
from speedrun.engine.memory import hold_freed_memory
held = hold_freed_memory() if sys.argv[1] == "hold" else None
def step():
    blocks = [torch.ones(n * 2 ** 18) for n in (40, 48, 64)]
    del blocks
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"held": held, "faults": after - before}))
"""


def faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(c_library() != "glibc", reason="mallopt is glibc's")
def test_held_memory_is_reused_instead_of_faulted_in_again():
    default, held = faults("default"), faults("hold")
    pages = 5 * 152 * 2 ** 20 // 4096                     # 194,560 pages touched in the five steps
    assert default["faults"] > pages // 2                  # glibc's default: mapped and faulted in each time
    assert held["held"] is True
    assert held["faults"] < pages // 4                     # held: mostly the same pages every step


def test_auto_holds_memory_on_cpus_under_glibc_only():
    assert auto_hold_memory("auto", "cpu", "glibc")[0]
    assert not auto_hold_memory("auto", "cuda", "glibc")[0]
    assert auto_hold_memory("on", "cuda", "glibc")[0]
    assert not auto_hold_memory("auto", "cpu", "")[0]
    fitted, why = auto_hold_memory("auto", "cpu", "glibc", find_batch=True)     # the finder's conditions kept
    assert not fitted and "find_batch" in why
    assert auto_hold_memory("on", "cpu", "glibc", find_batch=True)[0]
    off, why = auto_hold_memory("off", "cpu", "glibc")
    assert not off and "hold_memory=off" in why


def test_hold_memory_on_without_glibc_is_refused_naming_the_field():
    with pytest.raises(RecipeError, match="runtime.hold_memory"):
        auto_hold_memory("on", "cpu", "musl")


@pytest.mark.skipif(c_library() != "glibc", reason="mallopt is glibc's")
def test_the_runtime_records_its_choice():
    rt = resolve_runtime(RuntimeConfig(), torch.device("cpu"))
    assert rt.hold_memory and rt.describe()["hold_memory"] is True
    assert any("freed memory kept" in c for c in rt.choices)
    assert not resolve_runtime(RuntimeConfig(hold_memory="off"), torch.device("cpu")).hold_memory


ACTIVATE = """
import json, torch
from speedrun.engine.runtime import resolve_runtime
from speedrun.recipe import RuntimeConfig
rt = resolve_runtime(RuntimeConfig(), torch.device("cpu")).activate()
print(json.dumps(rt.describe()))
"""


@pytest.mark.skipif(c_library() != "glibc", reason="mallopt is glibc's")
def test_activate_returns_what_the_c_library_accepted(monkeypatch):
    out = subprocess.run([sys.executable, "-c", ACTIVATE], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["hold_memory"] is True            # a real process: glibc accepted
    # where mallopt refuses (not seen under glibc), the record says so instead of the decision
    from speedrun.engine import memory
    monkeypatch.setattr(memory, "hold_freed_memory", lambda: False)
    rt = resolve_runtime(RuntimeConfig(), torch.device("cpu"))
    after = rt.activate()
    assert rt.hold_memory and not after.hold_memory and after.describe()["hold_memory"] is False
    assert "glibc refused" in after.choices[-1] and after.choices[:-1] == rt.choices
    assert rt.activate(hold_memory=False) is rt                      # probes: nothing asked, nothing changed
