"""torch JIT build locks a killed build left behind (torch's FileBaton, torch up to 2.13).

``torch.utils.cpp_extension.load`` takes ``<build_dir>/lock`` by creating the file and waits,
for ever, while it exists. A build killed half-way (a rank killed by its launcher, Ctrl-C, a
session cut off) leaves the file, and every later build of that extension hangs: ours, and
DeepSpeed's CPU comm op (``deepspeed_shm_comm``), which ``deepspeed.initialize`` builds on a
CPU machine, so every engine hangs. A live build keeps writing objects; a lock whose build
directory has had nothing written for ``ZERO_LIFETIME_JIT_LOCK_TIMEOUT`` seconds is stale.

``python -m zero_lifetime.clear_jit_locks`` removes the stale locks a JIT build in this
environment would wait on (``scripts/setup_env.sh`` runs it), or with ``--root DIR`` every stale
lock under DIR, and says which; ``--check`` only lists them. ``import zero_lifetime`` warns
about them (:func:`warn_if_stale`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

JIT_LOCK_TIMEOUT_ENV = "ZERO_LIFETIME_JIT_LOCK_TIMEOUT"
SWEEP_MODULE = "zero_lifetime.clear_jit_locks"
_DEFAULT_JIT_LOCK_TIMEOUT_S = 600.0


class StaleBuildLockError(RuntimeError):
    """torch's JIT build lock was left behind by a build that no longer runs."""


def extensions_root() -> Path:
    """Where torch JIT-builds extensions: ``TORCH_EXTENSIONS_DIR``, else torch's default root
    (its user cache folder, which follows ``XDG_CACHE_HOME``). Ours builds in a directory of its
    own right below it (``_native.build_directory``)."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def torch_ops_root() -> Path:
    """Where ``cpp_extension.load`` builds an extension it is given no directory for (DeepSpeed's
    JIT ops, one directory each): ``TORCH_EXTENSIONS_DIR``, else the ``py<ver>_<accelerator>``
    folder below torch's default root that ``cpp_extension._get_build_directory`` names (not
    called: it creates the directory). Other Pythons and torch builds use other folders."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return extensions_root()
    import torch

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return extensions_root() / f"{python}_{accelerator}"


def lock_timeout_s(timeout_s: Optional[float] = None) -> float:
    if timeout_s is not None:
        return timeout_s
    return float(os.environ.get(JIT_LOCK_TIMEOUT_ENV, _DEFAULT_JIT_LOCK_TIMEOUT_S))


def _newest_activity(build_dir: Path) -> float:
    """mtime of the most recently written file of a build (ninja writes as it goes)."""
    newest = build_dir.stat().st_mtime
    for path in build_dir.rglob("*"):
        try:
            newest = max(newest, path.stat().st_mtime)
        except OSError:  # removed while we look: that is activity too
            return time.time()
    return newest


def torch_build_lock_is_a_file_baton(cpp_extension: Any = None) -> bool:
    """Whether torch's JIT build lock is a FileBaton: ``<build_dir>/lock`` exists exactly while
    a build holds it (torch up to 2.13).

    torch 2.14.1 and 2.15 hold an OS advisory lock (filelock) on the same path instead: the file stays
    after every build, and the kernel frees the lock of a builder that died. Waiting on that
    file's existence would make every run after the first build wait out the timeout and
    fall back to the Python tracker (seen with torch 2.15.0), and torch's own lock needs no help.
    """
    if cpp_extension is None:
        from torch.utils import cpp_extension
    return hasattr(cpp_extension, "FileBaton")


def wait_for_build_lock(build_dir: Path, timeout_s: Optional[float] = None, poll_s: float = 0.5) -> None:
    """Wait while another process builds in ``build_dir``; raise if its lock is stale.

    For torch's FileBaton only (:func:`torch_build_lock_is_a_file_baton`). A lock with nothing
    written in the build directory for ``timeout_s`` seconds is reported, with the command
    that clears it.
    """
    timeout_s = lock_timeout_s(timeout_s)
    lock = build_dir / "lock"
    while lock.exists():
        idle = time.time() - _newest_activity(build_dir)
        if idle > timeout_s:
            raise StaleBuildLockError(
                f"zero_lifetime: the JIT build directory {build_dir} is locked by {lock}, and nothing "
                f"has been written there for {idle:.0f} s: a build was probably killed half-way. If no "
                f"other process is building it, remove the lock (rm {lock}) and run again. "
                f"({JIT_LOCK_TIMEOUT_ENV} sets how long an idle lock is trusted; now {timeout_s:.0f} s.)")
        time.sleep(poll_s)


# Where a FileBaton lock sits below a root named on the command line: ``<ext>/lock`` or
# ``<py_device>/<ext>/lock``.
_LOCK_PATTERNS = ("*/lock", "*/*/lock")


def stale_locks(root: Path, timeout_s: Optional[float] = None) -> List[Tuple[Path, float]]:
    """``(lock, seconds idle)`` for each lock under ``root`` whose build directory has been
    idle past the timeout."""
    return _idle_past_timeout(sorted(lock for pattern in _LOCK_PATTERNS for lock in root.glob(pattern)), timeout_s)


def _idle_past_timeout(locks: List[Path], timeout_s: Optional[float] = None) -> List[Tuple[Path, float]]:
    timeout_s = lock_timeout_s(timeout_s)
    found = []
    for lock in locks:
        try:
            idle = time.time() - _newest_activity(lock.parent)
        except OSError:  # the build finished and removed it while we looked
            continue
        if idle > timeout_s:
            found.append((lock, idle))
    return found


def locks_this_process_waits_on() -> List[Path]:
    """The ``<ext>/lock`` files a JIT build in this process would wait on: DeepSpeed's ops'
    (:func:`torch_ops_root`) and ours (named by the hash of our sources, torch and Python).

    Nothing else: torch 2.14.1 and 2.15 leave their build's lock file behind (an OS lock's
    file), so where another environment with such a torch shares the cache, its folder or its
    build of ours holds lock files that no build here waits on, and a torch with FileBaton would
    take them for stale."""
    from . import _native

    ours_prefix = _native.EXTENSION_NAME + "_"
    own, ops_root = _native.build_directory(), torch_ops_root()
    locks = [lock for lock in ops_root.glob("*/lock")
             if not lock.parent.name.startswith(ours_prefix) or lock.parent == own]
    if own.parent != ops_root and (own / "lock").is_file():
        locks.append(own / "lock")
    return sorted(locks)


def stale_locks_here(root: Optional[Path] = None) -> List[Tuple[Path, float]]:
    """The stale locks a JIT build in this process would wait on, or with ``root`` every stale
    lock under it; none where this torch's lock cannot go stale. Cheap when there is no lock at
    all under the extensions root (two directory listings): ``import zero_lifetime`` runs it."""
    try:
        scanned = extensions_root() if root is None else root
        if not any(lock for pattern in _LOCK_PATTERNS for lock in scanned.glob(pattern)):
            return []
        if not torch_build_lock_is_a_file_baton():
            return []  # an advisory lock dies with its builder: nothing can be stale
        if root is not None:
            return stale_locks(root)
        return _idle_past_timeout(locks_this_process_waits_on())
    except OSError:
        return []


def describe_stale(stale: List[Tuple[Path, float]]) -> str:
    """What every report of stale locks says: which, why they matter, and the command that clears them."""
    return (f"stale JIT build locks (a build was killed half-way): {', '.join(str(lock) for lock, _ in stale)}. "
            f"A JIT build of that extension waits on it for ever, and deepspeed.initialize builds one on a CPU. "
            f"Remove them with `python -m zero_lifetime.clear_jit_locks`")


def _running_the_sweep() -> bool:
    """Whether this process is ``python -m zero_lifetime.clear_jit_locks``: runpy imports the
    package, and so its warning, before the command runs."""
    argv = getattr(sys, "orig_argv", ())
    return any(arg == "-m" + SWEEP_MODULE or (arg == "-m" and after == SWEEP_MODULE)
               for arg, after in zip(argv, [*argv[1:], ""]))


def warn_if_stale() -> None:
    """One warning naming the stale locks, if any: ``import zero_lifetime`` comes before
    ``deepspeed.initialize``, which would otherwise hang on them without a word. Not in the
    command that removes them: it would tell the user to run itself, and under
    ``-W error`` the warning would stop it before it removed anything."""
    if _running_the_sweep():
        return
    stale = stale_locks_here()
    if stale:
        import warnings

        warnings.warn(f"zero_lifetime: {describe_stale(stale)}.", RuntimeWarning, stacklevel=3)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_lifetime.clear_jit_locks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="every lock under this directory (default: the locks a "
                        "JIT build in this environment would wait on, under TORCH_EXTENSIONS_DIR or torch's cache)")
    parser.add_argument("--check", action="store_true", help="list the stale locks, remove nothing; exit 1 if any")
    args = parser.parse_args(argv)
    found = stale_locks_here(args.root)
    for lock, idle in found:
        if args.check:
            print(f"stale JIT build lock (nothing written for {idle:.0f} s): {lock}")
        else:
            lock.unlink(missing_ok=True)
            print(f"removed a stale JIT build lock (nothing written for {idle:.0f} s; a build was killed "
                  f"half-way, and every build of that extension would wait on it for ever): {lock}")
    return 1 if (args.check and found) else 0
