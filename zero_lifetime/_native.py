"""Build and load the compiled core ``zero_lifetime._C`` (DeepSpeed op_builder style).

Single source of truth for the native build: the source lists (``csrc/sources.txt``, and
``csrc/sources_cuda.txt`` when torch is a CUDA build and the toolkit is found), compiler
flags and include dirs below are used by setup.py (which loads this file by
path, without importing the package), by the JIT build and, through sources.txt, by
CMakeLists.txt.

Importing this module never builds or fails. :func:`load` builds on first use:

1. a prebuilt ``zero_lifetime._C`` (from ``pip install .`` / ``pip install -e .``) whose
   build hash matches the current sources and torch;
2. else a JIT build with ``torch.utils.cpp_extension.load`` into a directory keyed by that
   hash, so it is compiled once and cached. torch's FileBaton lock in that directory
   makes concurrently starting ranks compile once and the others wait;
3. else ``None``; :func:`get_tracker_impl` then falls back to the pure-Python
   ``zero_lifetime.tracker_py.Tracker`` with one warning saying why.

``ZERO_LIFETIME_FORCE_PYTHON=1`` selects the Python tracker without building anything.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

PACKAGE_DIR = Path(__file__).resolve().parent
EXTENSION_NAME = "zero_lifetime_C"  # JIT module name; the setup.py build is zero_lifetime._C
FORCE_PYTHON_ENV = "ZERO_LIFETIME_FORCE_PYTHON"

# The sources need C++17 (the torch-free core is built as C++17 by CMake). No -std flag
# here on purpose: torch adds the standard its headers require (-std=c++20 since torch
# 2.10), and a later -std=c++17 would override it and build against unsupported headers.
# -fopenmp: at::parallel_for is an inline OpenMP region in the headers; without the flag
# the pragma is dropped and the CPU kernels run on one thread (measured: no speed-up
# from 1 to 2 threads, while torch's own copy_ scaled).
extra_cflags: List[str] = ["-O3", "-fopenmp"]
# -l:libstdc++.so.6: link the C++ runtime torch itself uses, by name. Some toolchains
# find only libstdc++.a first (seen: a gcc wrapper whose -B directory has no .so) and
# link a private copy into the extension; its iostreams then share locale state with the
# process's libstdc++ and crash formatting any error message with a number in it.
extra_ldflags: List[str] = ["-fopenmp", "-l:libstdc++.so.6"]


def _find_csrc() -> Optional[Path]:
    # Installed wheel: setup.py ships csrc/ as zero_lifetime/csrc. Source checkout or
    # editable install: the top-level csrc/ next to the package.
    for candidate in (PACKAGE_DIR / "csrc", PACKAGE_DIR.parent / "csrc"):
        if (candidate / "sources.txt").is_file():
            return candidate
    return None


CSRC_DIR: Optional[Path] = _find_csrc()


def _read_sources(csrc: Optional[Path], listing: str = "sources.txt") -> List[str]:
    if csrc is None:
        return []
    try:
        lines = (csrc / listing).read_text().splitlines()
    except OSError:  # importing must never fail; load() reports the missing sources
        return []
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


SOURCES: List[str] = _read_sources(CSRC_DIR)  # relative to CSRC_DIR
# CUDA kernels (csrc/sources_cuda.txt), added only when cuda_build_enabled().
CUDA_SOURCES: List[str] = _read_sources(CSRC_DIR, "sources_cuda.txt")
# Files of csrc/ that matter to the build: hashed below and shipped by setup.py.
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh", ".txt")
# nvcc flags of the CUDA sources (torch adds the -std and its own defines).
extra_cuda_cflags: List[str] = ["-O3"]


CUDA_ARCH_UNKNOWN = ("a CUDA build of torch sees no GPU and TORCH_CUDA_ARCH_LIST is unset, so there is "
                     "no GPU architecture to compile the CUDA kernels for")


def cuda_toolchain_found() -> bool:
    """torch is a CUDA build, the CUDA toolkit (CUDA_HOME, nvcc) is found, and the kernels
    are not switched off (ZERO_LIFETIME_BUILD_CUDA=0)."""
    if not CUDA_SOURCES or os.environ.get("ZERO_LIFETIME_BUILD_CUDA", "1") == "0":
        return False
    try:
        import torch

        if torch.version.cuda is None:
            return False
        from torch.utils import cpp_extension

        return cpp_extension.CUDA_HOME is not None
    except Exception:  # noqa: BLE001 - no torch: nothing to build against anyway
        return False


def cuda_arch_unknown() -> bool:
    """No GPU visible and TORCH_CUDA_ARCH_LIST unset: torch's build picks the architectures
    of the visible GPUs, and with none its cpp_extension fails (an IndexError)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return False
    import torch

    return torch.cuda.device_count() == 0


def cuda_arch_missing() -> bool:
    """:func:`cuda_toolchain_found`, but no architecture to compile the kernels for
    (:func:`cuda_arch_unknown`): a JIT build leaves them out, setup.py refuses to."""
    try:
        return cuda_toolchain_found() and cuda_arch_unknown()
    except Exception:  # noqa: BLE001 - no torch: nothing to build against anyway
        return False


def cuda_build_enabled() -> bool:
    """Whether the CUDA kernels are compiled in: :func:`cuda_toolchain_found`, and an
    architecture to compile for. A CPU build simply lacks the CUDA kernels; a JIT build on
    a machine without a GPU needs none (setup.py refuses that case instead: a wheel built
    there is meant for GPUs)."""
    try:
        return cuda_toolchain_found() and not cuda_arch_unknown()
    except Exception:  # noqa: BLE001 - no torch: nothing to build against anyway
        return False


def source_paths() -> List[str]:
    """Absolute paths of the extension sources (the .cu ones included when CUDA is built)."""
    if CSRC_DIR is None:
        return []
    sources = SOURCES + (CUDA_SOURCES if cuda_build_enabled() else [])
    return [str(CSRC_DIR / s) for s in sources]


def include_dirs() -> List[str]:
    return [str(CSRC_DIR)] if CSRC_DIR else []


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except Exception:  # noqa: BLE001 - only feeds a hash; the build reports the real error
        return "no-torch"


def build_hash(with_cuda: Optional[bool] = None) -> str:
    """Hash of every file in csrc (headers included), flags, torch and Python versions, and
    whether the CUDA kernels are in (``with_cuda``; default: whether this machine builds them).

    Names the JIT build directory and is compiled into the module, so a prebuilt module
    built from other sources or for another torch is detected as stale.
    """
    h = hashlib.sha256()
    if CSRC_DIR is not None:
        for path in sorted(CSRC_DIR.rglob("*")):
            if path.is_file() and path.suffix in SOURCE_SUFFIXES:
                h.update(path.relative_to(CSRC_DIR).as_posix().encode())
                try:
                    h.update(path.read_bytes())
                except OSError:
                    h.update(b"<unreadable>")
    h.update(" ".join(extra_cflags + extra_ldflags).encode())
    if with_cuda is None:
        with_cuda = cuda_build_enabled()
    if with_cuda:  # the same torch builds with or without the kernels
        h.update(("cuda " + " ".join(extra_cuda_cflags)).encode())
    h.update(_torch_version().encode())
    h.update(f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    return h.hexdigest()[:16]


def build_hash_define() -> str:
    # An identifier, not a string literal: survives the shell quoting of ninja/setuptools
    # unchanged; bindings.cpp stringizes it.
    return f"-DZL_BUILD_HASH=zlh_{build_hash()}"


def build_directory() -> Path:
    from zero_lifetime.jit_locks import extensions_root  # not at the top: setup.py loads this file by path

    return extensions_root() / f"{EXTENSION_NAME}_{build_hash()}"


# ---------------------------------------------------------------------------- loading
_lock = threading.Lock()
_attempted = False
_module: Any = None
_status: Dict[str, Any] = {
    "impl": None,            # "compiled" or "python" once decided
    "loaded_from": None,     # "prebuilt" or "jit"
    "so_path": None,
    "build_directory": None,
    "error": None,           # why the compiled tracker is not used
    "notes": [],             # non-fatal: e.g. a stale prebuilt module that was skipped
}
_warned = False


def force_python() -> bool:
    return os.environ.get(FORCE_PYTHON_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _prebuilt_hashes() -> List[str]:
    """The build hashes a prebuilt module may have: this machine's, and where only the lack
    of a GPU leaves the CUDA kernels out of a build here, also that of a build with them
    (a module built on a GPU machine with the same torch serves the CPU kernels as well)."""
    hashes = [f"zlh_{build_hash()}"]
    if cuda_arch_missing():
        hashes.append(f"zlh_{build_hash(with_cuda=True)}")
    return hashes


def _prebuilt_is_stale() -> Optional[str]:
    """Why the prebuilt module must not even be imported, read from its file.

    Importing runs its static operator registrations (TORCH_LIBRARY(zero_lifetime)); a
    stale module imported only to read its hash would make the JIT rebuild's identical
    registrations abort the process. Its build hash is a string in the binary."""
    if CSRC_DIR is None:
        return None
    try:
        spec = importlib.util.find_spec("zero_lifetime._C")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    try:
        data = Path(spec.origin).read_bytes()
    except OSError as e:
        return f"prebuilt zero_lifetime._C unreadable: {e}"
    if not any(h.encode() in data for h in _prebuilt_hashes()):
        return (f"prebuilt zero_lifetime._C is stale (built from other sources, flags or "
                f"torch than zlh_{build_hash()}); rebuilding with JIT")
    return None


def _load_prebuilt() -> Any:
    stale = _prebuilt_is_stale()
    if stale:
        _status["notes"].append(stale)
        return None
    try:
        import torch  # noqa: F401 - the extension needs torch's shared libraries loaded

        mod = importlib.import_module("zero_lifetime._C")
    except ModuleNotFoundError as e:
        if e.name != "zero_lifetime._C":
            _status["notes"].append(f"prebuilt zero_lifetime._C not importable: {e}")
        return None
    except Exception as e:  # noqa: BLE001 - e.g. undefined symbols after a torch upgrade
        _status["notes"].append(f"prebuilt zero_lifetime._C failed to import: {e}")
        return None
    expected = _prebuilt_hashes()
    built = getattr(mod, "build_hash", "")
    if CSRC_DIR is not None and built not in expected:
        _status["notes"].append(
            f"prebuilt zero_lifetime._C is stale (build hash {built or 'none'}, sources "
            f"{expected[0]}); rebuilding with JIT")
        return None
    return mod


def _missing_toolchain() -> Optional[str]:
    from torch.utils import cpp_extension

    if not SOURCES:
        return f"C++ sources not found (looked for csrc/sources.txt near {PACKAGE_DIR})"
    if not cpp_extension.is_ninja_available():
        return "ninja is not available (pip install ninja)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler found (CXX={compiler!r} is not on PATH)"
    return None


def jit_load(verbose: bool = False) -> Any:
    """Compile (or reuse the cached build of) the extension; raises on failure."""
    missing = _missing_toolchain()
    if missing:
        raise RuntimeError(missing)
    from torch.utils import cpp_extension

    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    _status["build_directory"] = str(build_dir)
    if cuda_arch_missing():
        _status["notes"].append(f"CUDA kernels left out of the JIT build: {CUDA_ARCH_UNKNOWN}")
    from zero_lifetime import jit_locks  # not at the top: setup.py loads this file by path

    if jit_locks.torch_build_lock_is_a_file_baton(cpp_extension):
        jit_locks.wait_for_build_lock(build_dir)
    return cpp_extension.load(
        name=EXTENSION_NAME,
        sources=source_paths(),
        extra_cflags=extra_cflags + [build_hash_define()],
        extra_cuda_cflags=extra_cuda_cflags + [build_hash_define()],
        extra_ldflags=extra_ldflags,
        extra_include_paths=include_dirs(),
        build_directory=str(build_dir),
        verbose=verbose,
    )


def load(verbose: bool = False) -> Any:
    """The compiled module, building it on first use; None if that is impossible."""
    global _attempted, _module
    with _lock:
        if _attempted:
            return _module
        _attempted = True
        mod = _load_prebuilt()
        source = "prebuilt"
        if mod is None:
            source = "jit"
            try:
                mod = jit_load(verbose=verbose)
            except Exception as e:  # noqa: BLE001 - any build failure means: use Python
                msg = str(e).strip()
                # Compiler output can be long; the end holds the actual error.
                _status["error"] = f"{type(e).__name__}: {msg[-3000:]}"
                mod = None
        if mod is not None:
            _module = mod
            _status.update(impl="compiled", loaded_from=source,
                           so_path=getattr(mod, "__file__", None), error=None)
        else:
            _status["impl"] = "python"
        return _module


def get_tracker_impl():
    """The Tracker class to use: compiled if it builds, else the pure-Python one."""
    from . import tracker_py

    global _warned
    if force_python():
        return tracker_py.Tracker
    if load() is None:
        if not _warned:
            _warned = True
            warnings.warn(
                "zero_lifetime: compiled tracker unavailable, using the slower pure-Python "
                f"tracker. Reason: {_status['error']}", RuntimeWarning, stacklevel=2)
        return tracker_py.Tracker
    return _module.Tracker


def status() -> Dict[str, Any]:
    """Which implementation is loaded, from where, and why a build failed (never builds)."""
    with _lock:
        result = dict(_status, notes=list(_status["notes"]))
    result["force_python"] = force_python()
    if result["force_python"]:
        result["impl"] = "python"
    result["sources_dir"] = str(CSRC_DIR) if CSRC_DIR else None
    return result
