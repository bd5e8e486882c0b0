"""What a benchmark ran on: recorded next to every raw sample in the JSON."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Dict, Optional

import torch


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def git_commit() -> Optional[str]:
    repo = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str, ranks: int) -> Dict[str, object]:
    from .. import ops
    return {
        "device": device,
        "device_name": device_name(device),
        "ranks": ranks,
        "cpu_count": torch.multiprocessing.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "python": platform.python_version(),
        "fused_ops": "compiled" if ops.native_available() else "pure-torch reference",
        # From these segment bytes CUDA fused copies without a cast or scale use cudaMemcpyAsync.
        "cuda_memcpy_segment_bytes": ops.cuda_memcpy_segment_bytes() if ops.native_available() else None,
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", "zero_lifetime.bench", *sys.argv[1:]]),
    }


def describe(env: Dict[str, object]) -> str:
    commit = (env["git_commit"] or "unknown")[:10]
    route = env.get("cuda_memcpy_segment_bytes")
    from ..ops import CUDA_MEMCPY_NEVER
    on_cuda = env["device"] == "cuda" and route is not None and route < CUDA_MEMCPY_NEVER
    return (f"# {env['date']}  device {env['device']} ({env['device_name']}), {env['ranks']} rank(s), "
            f"torch {env['torch']} (threads {env['torch_threads']}), DeepSpeed {env['deepspeed']}, "
            f"fused ops {env['fused_ops']}" + (f", cudaMemcpyAsync route from {route} B segments" if on_cuda else "")
            + f", commit {commit}")
