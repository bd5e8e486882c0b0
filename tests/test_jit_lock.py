"""A JIT build killed half-way must not make later runs wait for ever on its lock."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from zero_lifetime import jit_locks
from zero_lifetime.jit_locks import (JIT_LOCK_TIMEOUT_ENV, StaleBuildLockError, torch_build_lock_is_a_file_baton,
                                      wait_for_build_lock)


def _age(path, seconds):
    old = time.time() - seconds
    os.utime(path, (old, old))


def test_stale_lock_is_reported_with_the_fix(tmp_path):
    (tmp_path / "build.ninja").write_text("")
    (tmp_path / "lock").write_text("")
    for path in (tmp_path / "build.ninja", tmp_path / "lock", tmp_path):
        _age(path, 120)
    with pytest.raises(StaleBuildLockError, match=r"rm .*lock"):
        wait_for_build_lock(tmp_path, timeout_s=60, poll_s=0.05)


def test_live_build_is_waited_for(tmp_path):
    """A lock whose build keeps writing is trusted, however old the lock itself is."""
    lock = tmp_path / "lock"
    lock.write_text("")
    _age(lock, 3600)

    def build():
        for i in range(6):
            (tmp_path / f"obj{i}.o").write_text("x")
            time.sleep(0.25)
        lock.unlink()

    builder = threading.Thread(target=build)
    started = time.monotonic()
    builder.start()
    wait_for_build_lock(tmp_path, timeout_s=1.0, poll_s=0.05)
    builder.join()
    assert time.monotonic() - started >= 1.2  # it did wait for the build to finish


def test_no_lock_returns_at_once(tmp_path):
    started = time.monotonic()
    wait_for_build_lock(tmp_path, timeout_s=1.0)
    assert time.monotonic() - started < 0.5


def _jit_load_over_an_old_lock(tmp_path, lock_timeout_s: int, lock_age_s: int, setup: str, run: str):
    """In a fresh process with TORCH_EXTENSIONS_DIR=tmp_path: ``setup``, then a ``lock`` file and
    its hashed build directory last touched ``lock_age_s`` ago, then ``run``; it must exit 0."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), ZERO_LIFETIME_JIT_LOCK_TIMEOUT=str(lock_timeout_s))
    code = "\n".join([
        "import os, time",
        textwrap.dedent(setup),
        "from zero_lifetime import _native, jit_locks",
        "build_dir = _native.build_directory()",
        "build_dir.mkdir(parents=True)",
        "lock = build_dir / 'lock'",
        "lock.write_text('')",
        f"old = time.time() - {lock_age_s}",
        "for path in (lock, build_dir):",
        "    os.utime(path, (old, old))",
        textwrap.dedent(run),
    ])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.mark.skipif(not torch_build_lock_is_a_file_baton(),
                    reason="this torch locks JIT builds with an OS lock, which a killed build cannot leave held")
def test_jit_load_fails_fast_on_a_stale_lock(tmp_path):
    """The real entry point: a stale lock in the hashed build directory ends the build
    attempt with the explanation, instead of torch's FileBaton waiting for ever."""
    done = _jit_load_over_an_old_lock(tmp_path, lock_timeout_s=1, lock_age_s=60, setup="", run="""
        try:
            _native.jit_load()
        except jit_locks.StaleBuildLockError as exc:
            print("STALE", exc)
    """)
    assert "STALE" in done.stdout and f"rm {tmp_path}" in done.stdout, done.stdout


def test_the_lock_kind_is_what_torch_locks_its_builds_with():
    """FileBaton (a file that exists while a build runs) up to torch 2.13; an advisory lock
    on a file that stays in torch 2.14.1 and 2.15. Told apart by what _jit_compile calls."""
    import inspect
    from types import SimpleNamespace

    from torch.utils import cpp_extension

    assert torch_build_lock_is_a_file_baton(SimpleNamespace(FileBaton=object))
    assert not torch_build_lock_is_a_file_baton(SimpleNamespace(FileLock=object))
    assert torch_build_lock_is_a_file_baton() == ("FileBaton(" in inspect.getsource(cpp_extension._jit_compile))


def test_jit_load_ignores_the_lock_file_an_advisory_lock_leaves(tmp_path):
    """torch 2.14.1 and 2.15 leave <build_dir>/lock after every build: a later run must go straight
    to torch's load (which takes the advisory lock itself), not wait out the timeout.
    Here such a torch is imitated (no FileBaton) and its load replaced, to see what is called."""
    done = _jit_load_over_an_old_lock(tmp_path, lock_timeout_s=5, lock_age_s=3600, setup="""
        from torch.utils import cpp_extension
        if hasattr(cpp_extension, "FileBaton"):
            del cpp_extension.FileBaton
        cpp_extension.load = lambda **kwargs: "LOADED " + kwargs["build_directory"]
    """, run="""
        started = time.monotonic()
        print(_native.jit_load(), round(time.monotonic() - started, 3))
    """)
    loaded, seconds = done.stdout.split()[-2:]
    assert loaded.startswith(str(tmp_path)) and float(seconds) < 1.0, done.stdout


def _build_dir(root: Path, name: str, age_s: float) -> Path:
    """A build directory holding a ``lock`` and an object file, all last written ``age_s`` ago."""
    build_dir = root / name
    build_dir.mkdir(parents=True)
    then = time.time() - age_s
    for path in (build_dir / "lock", build_dir / "part.o"):
        path.write_text("")
        os.utime(path, (then, then))
    os.utime(build_dir, (then, then))
    return build_dir


@pytest.mark.skipif(not torch_build_lock_is_a_file_baton(),
                    reason="this torch locks JIT builds with an OS lock, which a killed build cannot leave held")
def test_sweep_removes_only_the_locks_of_idle_builds(tmp_path, monkeypatch, capsys):
    """What setup_env.sh runs: DeepSpeed's comm op killed mid-build (the lock that hung every
    engine of a CI run) and one of ours are removed; a build still writing keeps its lock."""
    monkeypatch.setenv(JIT_LOCK_TIMEOUT_ENV, "600")
    killed_deepspeed = _build_dir(tmp_path, "py311_cpu/deepspeed_shm_comm", age_s=3600)
    killed_ours = _build_dir(tmp_path, "zero_lifetime_C_abc", age_s=700)
    live = _build_dir(tmp_path, "py311_cpu/live_ext", age_s=3600)
    (live / "fresh.o").write_text("")  # still compiling
    (tmp_path / "py311_cpu" / "finished").mkdir()

    assert jit_locks.main(["--root", str(tmp_path), "--check"]) == 1
    listed = capsys.readouterr().out
    assert str(killed_deepspeed / "lock") in listed and str(killed_ours / "lock") in listed
    assert str(live) not in listed and (killed_deepspeed / "lock").exists()  # --check removes nothing

    assert jit_locks.main(["--root", str(tmp_path)]) == 0
    removed = capsys.readouterr().out
    assert removed.count("removed a stale JIT build lock") == 2, removed
    assert not (killed_deepspeed / "lock").exists() and not (killed_ours / "lock").exists()
    assert (live / "lock").exists() and (killed_deepspeed / "part.o").exists()
    assert jit_locks.main(["--root", str(tmp_path), "--check"]) == 0


@pytest.mark.skipif(not torch_build_lock_is_a_file_baton(),
                    reason="this torch locks JIT builds with an OS lock, which a killed build cannot leave held")
def test_import_warns_about_a_stale_lock_only(tmp_path):
    """``import zero_lifetime`` comes before deepspeed.initialize, which would hang on the lock
    without a word: the import names it. A build still writing gets no warning."""
    killed = _build_dir(tmp_path, "deepspeed_shm_comm", age_s=3600)  # TORCH_EXTENSIONS_DIR: no py<ver> folder
    live = _build_dir(tmp_path, "live_ext", age_s=3600)
    (live / "fresh.o").write_text("")

    def import_warnings(root):
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), ZERO_LIFETIME_JIT_LOCK_TIMEOUT="600")
        done = subprocess.run([sys.executable, "-c", "import zero_lifetime"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return [line for line in done.stderr.splitlines() if "stale JIT build lock" in line]

    warned = import_warnings(tmp_path)
    assert len(warned) == 1 and str(killed / "lock") in warned[0] and str(live) not in warned[0], warned
    assert "python -m zero_lifetime.clear_jit_locks" in warned[0]
    (killed / "lock").unlink()
    assert import_warnings(tmp_path) == []


@pytest.mark.skipif(not torch_build_lock_is_a_file_baton(),
                    reason="this torch locks JIT builds with an OS lock, which a killed build cannot leave held")
@pytest.mark.parametrize("spelling", [["-m", "zero_lifetime.clear_jit_locks"], ["-mzero_lifetime.clear_jit_locks"]])
def test_command_line_as_setup_env_runs_it(tmp_path, spelling):
    """The command scripts/setup_env.sh runs, over the extensions root the environment names:
    exit codes, and no warning on the way: neither runpy's nor the import's about the very
    locks the command removes (under -W error either would stop it first)."""
    killed = _build_dir(tmp_path, "deepspeed_shm_comm", age_s=3600)
    command = [sys.executable, "-W", "error::RuntimeWarning", *spelling]
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), ZERO_LIFETIME_JIT_LOCK_TIMEOUT="600")
    check = subprocess.run(command + ["--check"], env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and str(killed / "lock") in check.stdout, check.stdout + check.stderr
    assert "Warning" not in check.stderr, check.stderr
    clear = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert clear.returncode == 0 and not (killed / "lock").exists(), clear.stdout + clear.stderr
    assert "Warning" not in clear.stderr, clear.stderr


def test_torch_ops_root_is_where_torch_builds_an_extension_given_no_directory(tmp_path, monkeypatch):
    """Oracle: torch's own choice of build directory, for the default root (which follows
    XDG_CACHE_HOME) and for TORCH_EXTENSIONS_DIR."""
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch_choice = Path(cpp_extension._get_build_directory("zl_probe", verbose=False)).parent
    assert jit_locks.torch_ops_root().resolve() == torch_choice.resolve()
    assert jit_locks.extensions_root().resolve() == (tmp_path / "cache" / "torch_extensions").resolve()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "explicit"))
    torch_choice = Path(cpp_extension._get_build_directory("zl_probe", verbose=False)).parent
    assert jit_locks.torch_ops_root() == torch_choice == tmp_path / "explicit"


@pytest.mark.skipif(not torch_build_lock_is_a_file_baton(),
                    reason="this torch locks JIT builds with an OS lock, which a killed build cannot leave held")
@pytest.mark.parametrize("layout", ["default_root", "TORCH_EXTENSIONS_DIR"])
def test_only_the_locks_a_build_here_waits_on_are_reported(tmp_path, monkeypatch, layout):
    """Another environment sharing the cache with torch 2.14.1 or later leaves a lock file in
    each of its builds (an OS lock's file, never removed): in its own py<ver>_<accelerator>
    folder, and in its build of ours (another hash). No build here waits on those, so they are
    neither reported nor removed (found when torch 2.13 warned about a torch 2.14.1 cache)."""
    from zero_lifetime import _native

    monkeypatch.setenv(JIT_LOCK_TIMEOUT_ENV, "600")
    if layout == "default_root":
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        root = tmp_path / "torch_extensions"
        ops = root / jit_locks.torch_ops_root().name
        other_names = ["py311_cu999/cpu_adam"]  # another torch's folder
    else:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        root = ops = tmp_path
        other_names = []
    other_names.append(_native.EXTENSION_NAME + "_0123456789abcdef")  # another torch's build of ours
    assert jit_locks.torch_ops_root() == ops
    ours = _build_dir(root, _native.build_directory().name, age_s=3600)
    deepspeed_op = _build_dir(ops, "deepspeed_shm_comm", age_s=3600)
    others = [_build_dir(root, name, age_s=3600) for name in other_names]

    assert [lock for lock, _ in jit_locks.stale_locks_here()] == sorted([ours / "lock", deepspeed_op / "lock"])
    assert jit_locks.main([]) == 0
    assert not (ours / "lock").exists() and not (deepspeed_op / "lock").exists()
    assert all((other / "lock").exists() for other in others)
    # Named on the command line, a root is swept whole.
    assert jit_locks.main(["--root", str(root)]) == 0
    assert not any((other / "lock").exists() for other in others)
