"""`step --ranks N`: the training steps of ``step`` on N processes (gloo on the CPU, NCCL on GPUs).

On one rank ZeRO-3 gathers nothing and ZeRO-1/2 reduce nothing across ranks, so neither the
fused gather copy-out nor the ranks' bucket-layout check is in the 1-rank step. Here every
rank runs the same interleaved steps of ``step`` (stock and installed engines, ZeRO-3 and
ZeRO-2, then the retained two-backward step); rank 0's samples are reported, with what the
installed engines' ``stats()`` counted, so the fused paths are seen to have run.
"""

from __future__ import annotations

from typing import List

from .rank_launch import run_worker, worker_main
from .report import Progress, Result

WORKER_TIMEOUT_S = 600


def run(device: str, repeats: int, quick: bool, ranks: int, progress: Progress = None) -> List[Result]:
    spec = {"device": device, "repeats": repeats, "quick": quick}
    return run_worker("zero_lifetime.bench.step_dist", spec, ranks, device, WORKER_TIMEOUT_S, "step", progress)


def _work(spec: dict) -> List[Result]:
    from . import step
    import torch.distributed as dist

    results = step.run(spec["device"], spec["repeats"], spec["quick"])
    world = dist.get_world_size()
    for result in results:
        result["ranks"] = world
        result["case"] = f"{result['case']}, {world} ranks"
    return results


if __name__ == "__main__":
    worker_main(_work)
