"""Run one benchmark worker command per rank on this machine and wait for all of them.

Each process gets the rank variables DeepSpeed's ``init_distributed`` reads, a fresh
rendezvous port, and on the CPU one thread (the ranks share the cores). DeepSpeed's CPU
communication leaves a ``/dev/shm`` buffer per rank behind; those of this run are removed
once every rank is gone.

:func:`run_worker` (launcher side) and :func:`worker_main` (rank side) are the protocol of
the multi-rank benchmarks: a JSON spec in, rank 0's JSON list of results out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, List

_COPY_ROUTE = "cuda_memcpy_segment_bytes"  # the launcher's setting, in the spec each rank reads


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


def run_worker(module: str, spec: dict, ranks: int, device: str, timeout_s: float, what: str,
               progress=None) -> list:
    """``python -m <module> --worker SPEC OUT`` on ``ranks`` ranks; returns the results rank 0
    wrote, each a step of ``progress`` (a ``report.Progress``) when given."""
    from .. import ops
    if ops.native_available():  # each rank copies as this process does (bench --cuda-memcpy-segment-bytes)
        spec = {**spec, _COPY_ROUTE: ops.cuda_memcpy_segment_bytes()}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "rank0.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        run_ranks([sys.executable, "-m", module, "--worker", spec_path, out_path], ranks, device, timeout_s, what)
        with open(out_path) as f:
            results = json.load(f)
    if progress:
        for result in results:
            progress.step(result["case"])
    return results


def worker_main(work: Callable[[dict], list]) -> None:
    """A rank's ``--worker SPEC OUT`` entry: ``work(spec)`` on every rank, rank 0 writes its results."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    spec_path, out_path = parser.parse_args().worker
    with open(spec_path) as f:
        spec = json.load(f)
    if _COPY_ROUTE in spec:
        from .. import ops
        ops.set_cuda_memcpy_segment_bytes(spec.pop(_COPY_ROUTE))
    results = work(spec)
    import torch.distributed as dist
    from ..single_rank import exit_without_finalizing
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    # The results are written and every rank passed the barrier (torch 117762 struck rank 0 of
    # the gather worker while finalizing in a CI run).
    exit_without_finalizing()
