"""single_rank: a one-process DeepSpeed run on the CPU takes its leaked /dev/shm buffer with it.

Real DeepSpeed in a subprocess (init_distributed creates the buffer there); the oracle is
the file system: the buffer exists while the run lives and is gone after it exits.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rank_spawn import env_for_own_rank0
from zero_lifetime.single_rank import free_port, remove_shm_buffers, shm_buffer_paths

RUN = textwrap.dedent("""
    import json, os, sys
    from zero_lifetime.single_rank import shm_buffer_paths, single_rank_env
    single_rank_env()
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    print(json.dumps({"port": os.environ["MASTER_PORT"], "live": shm_buffer_paths(os.environ["MASTER_PORT"])}))
""")


def run_one_rank(env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def require_buffer(run: dict) -> None:
    if not run["live"]:
        pytest.skip("this DeepSpeed created no /dev/shm all-reduce buffer (no shm_comm op): nothing leaks")


def test_a_run_that_picked_its_port_removes_its_buffer_at_exit():
    run = run_one_rank(env_for_own_rank0())
    require_buffer(run)
    assert shm_buffer_paths(run["port"]) == []


def test_a_port_set_by_someone_else_leaves_the_buffer_to_its_owner():
    # A launcher (or a test) that set MASTER_PORT owns the run: other ranks may still open the files.
    port = free_port()
    try:
        run = run_one_rank(dict(env_for_own_rank0(), MASTER_PORT=port))
        require_buffer(run)
        assert shm_buffer_paths(port) == run["live"]
    finally:
        remove_shm_buffers(port)
    assert shm_buffer_paths(port) == []


def test_remove_touches_only_the_named_run():
    mine, other = free_port(), free_port()
    paths = [f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}"
             for port in (mine, other) for rank in (0, 1)]
    for path in paths:
        open(path, "wb").close()
    try:
        remove_shm_buffers(mine)
        assert sorted(shm_buffer_paths(mine) + shm_buffer_paths(other)) == sorted(paths[2:])
        remove_shm_buffers(mine)  # already gone: not an error
    finally:
        for path in paths:
            if os.path.exists(path):
                os.remove(path)
