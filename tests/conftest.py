import gc
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


def pytest_collection_finish(session):
    """Leave what the imports made out of every later garbage collection (gc.freeze).

    DeepSpeed collects garbage itself while it builds an engine (see_memory_usage with
    force=True: 11 times per ZeRO-3 engine on 0.17.6), and the tests collect to check
    releases. Each collection walks every tracked object, ~420k once torch and DeepSpeed are
    imported: 0.2 s on this project's CPUs. What the imports made lives as long as the
    process anyway; objects the tests make are collected as before. Rank workers do the
    same (two_rank_worker.run_rank)."""
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test, collect its garbage and freeze what outlives it, for the same reason.

    What a test leaves alive for good (lazily imported modules such as torch.compile's, caches,
    engines DeepSpeed's own caches keep) would otherwise be walked by every later collection:
    DeepSpeed's own at each engine build and the tests' checks of releases. Measured on
    0.17.6, 415 engine tests: 494 s of their 568 s were spent in gc. Collecting first leaves
    no garbage frozen, and walks only what this test made. Here, after the whole protocol:
    pytest drops the test's fixture values (item.funcargs) only after its teardown hooks."""
    reports = yield
    gc.collect()
    gc.freeze()
    return reports


def pytest_sessionstart(session):
    """A lock left by a killed JIT build would hang every DeepSpeed engine (deepspeed.initialize
    builds its CPU comm op) until each test's timeout: say so at once instead."""
    stale = jit_locks.stale_locks_here()
    if stale:
        pytest.exit(f"{jit_locks.describe_stale(stale)} (scripts/setup_env.sh does), and run again: every "
                    "engine would hang on them.", returncode=3)


def pytest_sessionfinish(session, exitstatus):
    """Remove the shared-memory buffers DeepSpeed's CPU communication left for our ports.

    Ranks spawned by the tests run on ports from free_port and never clean up (a DeepSpeed
    leak: single_rank.remove_shm_buffers). Only this session's ports: concurrent runs keep theirs.
    """
    for port in _PORTS:
        single_rank.remove_shm_buffers(port)
