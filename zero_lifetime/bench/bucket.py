"""`bucket`: gradient bucket fill, DeepSpeed's per-param loop vs torch alternatives vs the fused op."""

from __future__ import annotations

from typing import List

import torch

from . import kernels, sizes
from .report import Progress, Result

STOCK = "per-param narrow.copy_"
FUSED = "fused bucket_fill"
ROOFLINE = "roofline dst.copy_(src)"
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]


def run(device: str, repeats: int, quick: bool, progress: Progress = None) -> List[Result]:
    results = []
    for src, dst in DTYPES:
        for n, numel in sizes.shapes(quick):
            result = kernels.bucket_fill_samples(n, numel, src, dst, device=device, repeats=repeats)
            series = f"bucket fill {kernels._name(src)}->{kernels._name(dst)}"
            result.update(bench="bucket", series=series, x=numel * src.itemsize, n=n, numel=numel,
                          stock=STOCK, ours=FUSED, roofline=ROOFLINE, per=n, per_label="per tensor")
            results.append(result)
            if progress:
                progress.step(result["case"])
    return results


def cases(quick: bool) -> int:
    return len(DTYPES) * len(sizes.shapes(quick))


def targets(results: List[Result], device: str):
    from .targets import copy_targets
    return copy_targets("fused bucket fill", results, device, FUSED, STOCK, ROOFLINE)
