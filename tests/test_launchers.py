"""The launcher example runs under torchrun and under the deepspeed launcher (2 ranks, CPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_lifetime.single_rank import free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multiloss_zero3.py"
LAUNCHERS = {
    "torchrun": lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(port)],
    "deepspeed": lambda port: [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2",
                               "--master_port", str(port)],
}


# torch issue 117762: a gloo worker thread that drops the last reference to a tensor Python
# let go of needs the GIL, and once the interpreter is finalizing that ends the thread with a
# forced unwind through C++ frames: std::terminate, exit code -6, after the script's last line.
# Seen here about 4 times in 100 launches under load, on both launchers, always after both ranks
# printed their result (native backtrace: ProcessGroupGloo::runLoop -> TensorImpl::decref_pyobject
# -> PyEval_AcquireThread -> pthread_exit; faulthandler: no Python frame). The tests' own
# spawned ranks end with os._exit once their work is written (rank_spawn.py); a launched
# script is the user's, so here the abort can only be recognised. faulthandler's thread dump
# after "Fatal Python error: Aborted" ("<no Python frame>") is not part of the sign: once the
# interpreter is far enough into finalizing it prints none (a clean-clone CI run, 2026-11-27).
_FINALIZING_ABORT = ("terminate called without an active exception", "Fatal Python error: Aborted")
MAX_FINALIZING_ABORTS = 2
_RESULT = "rank {rank}/2: 3 two-loss steps on ZeRO-3 OK; pinned 0, live handles 0"


def _launch(launcher: str):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the launcher sets them; the test process's single-rank env must not leak
    cmd = LAUNCHERS[launcher](free_port()) + [str(EXAMPLE), "--steps", "3"]
    # One stream, so that what the ranks print and the abort keep the order they happened in.
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    return done.returncode, done.stdout


def _results_printed(output: str) -> bool:
    return all(_RESULT.format(rank=rank) in output for rank in (0, 1))


def _aborted_while_finalizing(output: str) -> bool:
    """Both ranks checked out, and only then the abort of torch issue 117762 began."""
    if not _results_printed(output) or not all(sign in output for sign in _FINALIZING_ABORT):
        return False
    last_result = max(output.index(_RESULT.format(rank=rank)) for rank in (0, 1))
    return output.index(_FINALIZING_ABORT[0]) > last_result


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_example_under_launcher(launcher):
    returncode, output = _launch(launcher)
    aborted = []
    while returncode != 0 and _aborted_while_finalizing(output) and len(aborted) < MAX_FINALIZING_ABORTS:
        # Only that abort, and only after both ranks checked out: launch again. At about 7.5%
        # of loaded launches, one retry still failed about 1 run in 180 per launcher and
        # release; two make it about 1 in 2400. Any other failure fails at once.
        aborted.append(output)
        returncode, output = _launch(launcher)
    for n, earlier in enumerate(aborted, 1):
        output += f"\n--- launch {n}, aborted while finalizing ---\n{earlier[-2000:]}"
    assert returncode == 0, output[:1500] + "\n...\n" + output[-3000:]
    assert _results_printed(output), output[-3000:]
