"""Run one benchmark worker command per rank on this machine and wait for all of them.

Each process gets the rank variables DeepSpeed's ``init_distributed`` reads, a fresh
rendezvous port, and on the CPU one thread (the ranks share the cores). DeepSpeed's CPU
communication leaves a ``/dev/shm`` buffer per rank behind; those of this run are removed
once every rank is gone.
"""

from __future__ import annotations

import os
import subprocess
from typing import List


def run_ranks(argv: List[str], ranks: int, device: str, timeout_s: float, what: str) -> None:
    """Run ``argv`` in ``ranks`` processes; RuntimeError with the first failed rank's log tail."""
    from ..single_rank import free_port, remove_shm_buffers
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                   LOCAL_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   DS_ACCELERATOR="cuda" if device == "cuda" else "cpu")
        if device != "cuda":  # the ranks share the cores: one thread each, no oversubscription
            env["OMP_NUM_THREADS"] = "1"
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
        remove_shm_buffers(port)  # every rank is gone: DeepSpeed leaves its buffers behind
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = "\n".join(logs[failed[0][0]].splitlines()[-15:]) if len(logs) > failed[0][0] else ""
        raise RuntimeError(f"{what} over {ranks} ranks: rank(s) {failed} failed:\n{tail}")
