"""`gather`: a ZeRO-3 module's params gathered and copied out into whole params.

On 1 rank there is nothing to all-gather, so the copy-out stage is measured on a
realistic rank-major gathered buffer (world size 2): DeepSpeed's per-param ``torch.cat``
(``AllGatherCoalescedHandle.wait``) vs one ``gather_copy_out`` into one buffer, against one
contiguous copy of the same bytes. With ``--ranks 2`` the real coalesced all-gather runs
over gloo in 2 spawned processes (see ``gather_dist``).
"""

from __future__ import annotations

from typing import List

from . import kernels, sizes
from .report import Progress, Result

STOCK = "per-param torch.cat (DeepSpeed)"
FUSED = "fused gather_copy_out"
ROOFLINE = "roofline dst.copy_(src)"
WORLD = 2


def run(device: str, repeats: int, quick: bool, ranks: int = 1, progress: Progress = None) -> List[Result]:
    results = []
    for n, numel in sizes.shapes(quick):
        result = kernels.gather_copy_out_samples(n, numel, WORLD, device=device, repeats=repeats)
        result.update(bench="gather", series=f"gather copy-out (world {WORLD} layout, 1 process)",
                      x=numel * 4, n=n, numel=numel, stock=STOCK, ours=FUSED, roofline=ROOFLINE,
                      per=n, per_label="per tensor")
        results.append(result)
        if progress:
            progress.step(result["case"])
    if ranks > 1:
        from . import gather_dist
        results.extend(gather_dist.run(device, repeats, quick, ranks, progress))
    return results


def cases(quick: bool, ranks: int = 1) -> int:
    return len(sizes.shapes(quick)) * (2 if ranks > 1 else 1)


def targets(results: List[Result], device: str):
    from .targets import copy_targets
    copy_out = [r for r in results if r.get("ranks", 1) == 1]
    return copy_targets("fused gather copy-out", copy_out, device, FUSED, STOCK, ROOFLINE)
