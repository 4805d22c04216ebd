"""What a run or a benchmark record ran on and from: device (CPU model and family, GPU),
software versions, the source commit and whether the tree was dirty, the command."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from ..engine.runtime import cpu_name

SOURCE_DIR = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=SOURCE_DIR, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def command_line() -> str:
    prog = Path(sys.argv[0]).name
    if prog in ("__main__.py", "-m", "-c", ""):
        prog = "speedrun"
    return " ".join([prog, *sys.argv[1:]])


def git_state() -> dict:
    """Commit of the speedrun source tree and whether it had uncommitted changes
    (None where speedrun is not installed from a git checkout)."""
    commit = _git("rev-parse", "HEAD")
    dirty = None
    if commit:
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status) if status is not None else None
    return {"git_commit": commit, "git_dirty": dirty}


def gpu_clocks() -> list[dict] | None:
    """Clocks, power draw and limit and temperature of each GPU as nvidia-smi reads them (None without it)."""
    fields = ["name", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw", "power.limit",
              "temperature.gpu", "driver_version"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in out.stdout.strip().splitlines()]


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni")


def cpu_details() -> dict:
    """What tells two CPUs with the same model name apart: vendor, family/model numbers (AMD
    family 26 is Zen 5), the clock the kernel reports, and the vector features that decide
    kernel speed (bf16 instructions, AVX-512)."""
    info: dict = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key in ("vendor_id", "cpu family", "model", "cpu MHz") and key not in info:
                info[key] = value
            elif key == "flags" and "features" not in info:
                flags = set(value.split())
                info["features"] = [f for f in CPU_FEATURES if f in flags]
            if line.strip() == "":
                break
    except OSError:
        pass
    return {"cpu_vendor": info.get("vendor_id"), "cpu_family_model": f"{info.get('cpu family')}/{info.get('model')}",
            "cpu_mhz": info.get("cpu MHz"), "cpu_features": info.get("features")}


def triton_version() -> str | None:
    try:
        import triton
    except Exception:                                   # (not in CPU builds)
        return None
    return triton.__version__


def environment() -> dict:
    env = {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "triton_version": triton_version(),
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_name(),
        **cpu_details(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "command": command_line(),
    }
    if torch.cuda.is_available():
        env["gpu_name"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_clocks"] = gpu_clocks()
    env.update(git_state())
    return env


def read_commit(given: str | None = None) -> tuple[str | None, str]:
    """(commit, where it was read) for a benchmark record: ``given`` (its --commit), else
    $SPEEDRUN_COMMIT, else the checkout's HEAD (a GPU machine without .git needs one of the first
    two). A benchmark reads it when it starts, so a commit made while it runs is not named."""
    if given:
        return given, "--commit"
    if os.environ.get("SPEEDRUN_COMMIT"):
        return os.environ["SPEEDRUN_COMMIT"], "$SPEEDRUN_COMMIT"
    head = _git("rev-parse", "HEAD")
    return (head, "git rev-parse HEAD") if head else (None, "unknown (no git; pass --commit)")


def machine(commit: str | None = None, commit_source: str | None = None) -> dict:
    """What every benchmark record names: ``environment()`` with the commit as ``read_commit``
    reads it (given, or read now) and where from; a commit not read from git replaces git's."""
    if commit_source is None:
        commit, commit_source = read_commit(commit)
    env = {**environment(), "commit": commit, "commit_source": commit_source}
    if commit and commit_source != "git rev-parse HEAD" and env["git_commit"] != commit:
        env.update(git_commit=commit, git_dirty=None)      # (the tree that ran is the named commit's)
    return env
