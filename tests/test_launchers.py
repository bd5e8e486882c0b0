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


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_example_under_launcher(launcher):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the launcher sets them; the test process's single-rank env must not leak
    cmd = LAUNCHERS[launcher](free_port()) + [str(EXAMPLE), "--steps", "3"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}/2: 3 two-loss steps on ZeRO-3 OK; pinned 0, live handles 0" in output, output[-3000:]
