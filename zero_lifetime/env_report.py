"""Environment report: ``python -m zero_lifetime.env_report``.

Prints the versions of the tools the compiled core depends on and which tracker
implementation loads (building the extension if needed), with the reason when the
compiled one is unavailable. Every probe is guarded: the report never raises and exits 0,
so it can be pasted into bug reports from broken environments. It never touches
torch.cuda beyond reading the compile-time CUDA version, so no CUDA context is created.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import warnings
from typing import Callable, List, Optional, Tuple

NOT_FOUND = "not found"


def _run_version(cmd: List[str], pick_last: bool = False) -> str:
    exe = shutil.which(cmd[0])
    if exe is None:
        return NOT_FOUND
    try:
        out = subprocess.run([exe] + cmd[1:], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{NOT_FOUND} ({type(e).__name__}: {e})"
    lines = [ln.strip() for ln in (out.stdout or out.stderr).splitlines() if ln.strip()]
    if not lines:
        return f"{NOT_FOUND} (no output, exit code {out.returncode})"
    return f"{lines[-1] if pick_last else lines[0]} [{exe}]"


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return NOT_FOUND


def _torch() -> str:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken install is exactly what we report
        return f"{NOT_FOUND} ({type(e).__name__}: {e})"
    cuda = torch.version.cuda or "none"  # compile-time value: no CUDA initialisation
    return f"{torch.__version__} (built with CUDA {cuda}, C++ ABI cxx11={torch.compiled_with_cxx11_abi()})"


def _nvcc() -> str:
    found = _run_version(["nvcc", "--version"], pick_last=True)
    if found != NOT_FOUND:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return _run_version([os.path.join(cuda_home, "bin", "nvcc"), "--version"], pick_last=True)
    return NOT_FOUND


def _cxx() -> str:
    compiler = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension invokes
    return _run_version([compiler, "--version"])


PROBES: List[Tuple[str, Callable[[], str]]] = [
    ("python", lambda: sys.version.replace("\n", " ")),
    ("torch", _torch),
    ("deepspeed", lambda: _dist_version("deepspeed")),  # not imported: importing it is slow
    ("gcc", lambda: _run_version(["gcc", "--version"])),
    ("c++ (CXX)", _cxx),
    ("nvcc", _nvcc),
    ("ninja", lambda: _run_version(["ninja", "--version"])),
    ("cmake", lambda: _run_version(["cmake", "--version"])),
]


def _guarded(probe: Callable[[], str]) -> str:
    try:
        return probe()
    except Exception as e:  # noqa: BLE001 - the report must never raise
        return f"{NOT_FOUND} (probe failed: {type(e).__name__}: {e})"


def _tracker_lines() -> List[Tuple[str, str]]:
    try:
        from zero_lifetime import _native
    except Exception as e:  # noqa: BLE001
        return [("tracker impl", f"unknown (cannot import zero_lifetime._native: {e})")]
    if not _native.force_python():
        print("building/loading the compiled tracker (the first build takes about a minute)...",
              file=sys.stderr, flush=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reason is printed below instead
            impl = _native.get_tracker_impl()
        impl_name = f"{impl.__module__}.{impl.__qualname__}"
    except Exception as e:  # noqa: BLE001
        impl_name = f"failed to choose ({type(e).__name__}: {e})"
    st = _native.status()
    lines = [("tracker impl", f"{st['impl']} ({impl_name})")]
    if st["force_python"]:
        lines.append(("reason", f"{_native.FORCE_PYTHON_ENV} is set"))
    lines.append(("loaded from", str(st["loaded_from"] or "-")))
    lines.append((".so path", str(st["so_path"] or "-")))
    lines.append(("build directory", str(st["build_directory"] or "-")))
    lines.append(("sources", str(st["sources_dir"] or NOT_FOUND)))
    if st["error"]:
        lines.append(("build failure", st["error"]))
    for note in st["notes"]:
        lines.append(("note", note))
    return lines


def _ops_lines() -> List[Tuple[str, str]]:
    """Which fused-op kernels the loaded extension registered (no CUDA context created)."""
    from . import _native

    if _native.force_python() or _native.load() is None:
        return [("fused ops", "pure-torch reference (zero_lifetime.ops_reference)")]
    import torch

    kernels = []
    for key in ("CPU", "CUDA", "Meta"):
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key("zero_lifetime::bucket_fill", key):
                kernels.append(key)
        except RuntimeError:
            pass
    module = _native.load()
    direct = ["CPU"] if hasattr(module, "bucket_fill_fast") else []
    if direct and getattr(module, "cuda_kernels_compiled", lambda: False)():
        direct.append("CUDA")
    return [("fused ops", f"compiled kernels: {', '.join(kernels) or 'none'}; "
                          f"direct entries: {', '.join(direct) or 'none'}")]


def _cuda_context_line() -> Optional[Tuple[str, str]]:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return ("cuda initialized", str(torch.cuda.is_initialized()))  # reads a flag only
    except Exception as e:  # noqa: BLE001
        return ("cuda initialized", f"unknown ({e})")


def report() -> List[Tuple[str, str]]:
    lines = [(name, _guarded(probe)) for name, probe in PROBES]
    try:
        lines += _tracker_lines()
    except Exception as e:  # noqa: BLE001
        lines.append(("tracker impl", f"unknown ({type(e).__name__}: {e})"))
    try:
        lines += _ops_lines()
    except Exception as e:  # noqa: BLE001 - the report never raises
        lines.append(("fused ops", f"unknown ({type(e).__name__}: {e})"))
    cuda_line = _cuda_context_line()
    if cuda_line:
        lines.append(cuda_line)
    return lines


def main() -> int:
    try:
        lines = report()
        width = max(len(name) for name, _ in lines)
        print("zero_lifetime environment report")
        for name, value in lines:
            print(f"  {name:<{width}} : {value}")
    except BaseException as e:  # noqa: BLE001 - exit 0 whatever happens, say what broke
        print(f"zero_lifetime env_report: unexpected {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
