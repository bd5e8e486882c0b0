import os
import sys

import pytest

import zero_lifetime.single_rank as single_rank
from zero_lifetime import jit_locks

# Every port handed out in this process (the test modules import free_port after this
# file runs, so they get the recording one): see pytest_sessionfinish.
_PORTS = set()
_free_port = single_rank.free_port


def _recording_free_port() -> str:
    port = _free_port()
    _PORTS.add(port)
    return port


single_rank.free_port = _recording_free_port

# DeepSpeed on the CPU: gloo collectives, one process is rank 0 of 1 unless a test spawns more.
single_rank.single_rank_env()
_PORTS.add(os.environ["MASTER_PORT"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_sessionstart(session):
    """A lock left by a killed JIT build would hang every DeepSpeed engine (deepspeed.initialize
    builds its CPU comm op) until each test's timeout: say so at once instead."""
    if not jit_locks.torch_build_lock_is_a_file_baton() or not jit_locks.extensions_root().is_dir():
        return
    stale = jit_locks.stale_locks(jit_locks.extensions_root())
    if stale:
        pytest.exit("stale JIT build locks (a build was killed half-way; every engine would hang on "
                    f"them): {', '.join(str(lock) for lock, _ in stale)}. Remove them with "
                    "`python -m zero_lifetime.clear_jit_locks` (scripts/setup_env.sh does) and run again.",
                    returncode=3)


def pytest_sessionfinish(session, exitstatus):
    """Remove the shared-memory buffers DeepSpeed's CPU communication left for our ports.

    Ranks spawned by the tests run on ports from free_port and never clean up (a DeepSpeed
    leak: single_rank.remove_shm_buffers). Only this session's ports: concurrent runs keep theirs.
    """
    for port in _PORTS:
        single_rank.remove_shm_buffers(port)
