"""`gather`: a ZeRO-3 module's params gathered and copied out into whole params.

On 1 rank there is nothing to all-gather, so the copy-out stage is measured on a
realistic rank-major gathered buffer (world size 2), twice:

* kernel level: DeepSpeed's copy pattern (one ``torch.cat`` per param, on bare tensors)
  vs one ``gather_copy_out`` into one buffer, against one contiguous copy of the same
  bytes; the targets are judged on these rows;
* DeepSpeed path: DeepSpeed's own ``AllGatherCoalescedHandle.wait`` on real handles vs
  ``Zero3FusedCopies.wait`` (see ``ds_paths``).

With ``--ranks 2`` the real coalesced all-gather runs over gloo in 2 spawned processes
(see ``gather_dist``).
"""

from __future__ import annotations

from typing import List

from . import ds_paths, kernels, sizes
from .report import Progress, Result, keep

STOCK = kernels.GATHER_LOOP
FUSED = "fused gather_copy_out"
ROOFLINE = "roofline dst.copy_(src)"
WORLD = 2


def run(device: str, repeats: int, quick: bool, ranks: int = 1, progress: Progress = None) -> List[Result]:
    from .engines import prepare_process, quiet_deepspeed
    results = []
    for n, numel in sizes.kernel_shapes(quick, device):
        result = kernels.gather_copy_out_samples(n, numel, WORLD, device=device, repeats=repeats)
        result.update(bench="gather", series=f"gather copy-out (world {WORLD} layout, 1 process)",
                      x=numel * 4, n=n, numel=numel, stock=STOCK, ours=FUSED, roofline=ROOFLINE,
                      per=n, per_label="per tensor")
        keep(results, result, progress)
    prepare_process(device)
    quiet_deepspeed()
    for n, numel in sizes.shapes(quick):
        result = ds_paths.gather_wait(n, numel, WORLD, device, repeats)
        result.update(bench="gather", series=f"gather copy-out, DeepSpeed handle wait (world {WORLD} layout)",
                      x=numel * 4, n=n, numel=numel, per=n, per_label="per tensor",
                      notes=[ds_paths.speedup_note(result)])
        keep(results, result, progress)
    if ranks > 1:
        from . import gather_dist
        results.extend(gather_dist.run(device, repeats, quick, ranks, progress))
    return results


def cases(quick: bool, ranks: int = 1, device: str = "cpu") -> int:
    return len(sizes.kernel_shapes(quick, device)) + len(sizes.shapes(quick)) * (2 if ranks > 1 else 1)


def targets(results: List[Result], device: str):
    from .targets import copy_targets
    kernel_level, _ = ds_paths.split(results)
    copy_out = [r for r in kernel_level if r.get("ranks", 1) == 1]
    return copy_targets("fused gather copy-out", copy_out, device, FUSED, STOCK, ROOFLINE)
