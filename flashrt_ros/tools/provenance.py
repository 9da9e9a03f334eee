"""Where a benchmark result came from: commit, date, host, device, driver, library versions and the command.

Every result JSON a benchmark writes goes through :func:`write_result` (or carries :func:`collect`'s dict under
``"provenance"``), so any figure can be traced to the code and the machine that made it.

The commit: ``FLASHRT_GIT_COMMIT`` when set (``<sha>`` or ``<sha>-dirty``, as ``git describe --always --dirty
--abbrev=40`` prints it), else ``git rev-parse HEAD`` of this checkout and whether its tracked files differ from it.
The GPU machine's tree is a copy whose ``git`` reports a stale commit: ``bench/h200.sh`` sets the variable from
``bench/gpu_commit.txt``, which the coordinator writes before the run (see BENCHMARKS.md, "How the figures are made").
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from pathlib import Path

COMMIT_ENV = "FLASHRT_GIT_COMMIT"
CHECKOUT = Path(__file__).resolve().parents[2]
LIBRARIES = ("torch", "triton", "transformers", "flash-linear-attention", "fla-core", "llguidance")
UNKNOWN = "unknown"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(environ: dict | None = None) -> dict:
    """``{"commit": sha, "dirty": bool | None, "commit_source": "env" | "git" | "none"}``."""
    given = (os.environ if environ is None else environ).get(COMMIT_ENV, "").strip()
    if given:
        sha, dirty = (given[:-len("-dirty")], True) if given.endswith("-dirty") else (given, False)
        return {"commit": sha, "dirty": dirty, "commit_source": "env"}
    sha = _git("rev-parse", "HEAD")
    if sha is None:
        return {"commit": UNKNOWN, "dirty": None, "commit_source": "none"}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": sha, "dirty": None if status is None else bool(status), "commit_source": "git"}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or UNKNOWN


def _nvidia_driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def device_facts(device: str) -> dict:
    """The device's name (GPU name, or the CPU model), and on CUDA the driver and the CUDA runtime torch uses."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        return {"device_type": "cuda", "device_name": props.name, "device_memory_bytes": props.total_memory,
                "sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
                "cuda_runtime": torch.version.cuda, "driver": _nvidia_driver(), "cpu_model": _cpu_model()}
    return {"device_type": "cpu", "device_name": _cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def library_versions() -> dict:
    """Installed versions of the libraries a figure depends on (None: not installed)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def collect(device: str, argv: list[str] | None = None, environ: dict | None = None) -> dict:
    """The provenance block of a result made now on ``device`` by the command line ``argv`` (default: this
    process's, as it was typed: ``python3 -m flashrt_ros.tools bench ...``)."""
    argv = sys.orig_argv if argv is None else argv
    return {**git_state(environ), "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "host": socket.gethostname(), **device_facts(device), "versions": library_versions(),
            "command": shlex.join(argv)}


def stamp(result: dict, device: str) -> dict:
    """``result`` with its provenance (kept when it already has one)."""
    result.setdefault("provenance", collect(device))
    return result


def write_result(path: str | Path, result: dict, device: str) -> dict:
    """Write ``result`` as JSON to ``path``, its provenance included; returns it."""
    stamp(result, device)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    return result
