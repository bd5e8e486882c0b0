"""`bucket`: gradient bucket fill, kernel level and through DeepSpeed's own ZeRO-2 code path.

Kernel level (bare tensors, fp32 and bf16->fp32): DeepSpeed's copy pattern (one
``narrow().copy_()`` per gradient) vs torch alternatives vs the fused op, against one
contiguous copy of the same bytes; the targets are judged on these rows.

DeepSpeed path (fp32): a real ZeRO-2 engine's ``reduce_independent_p_g_buckets_and_remove_grads``
called per param, stock vs an identical engine with ``zero_lifetime.install`` (its
reserving hook, then the fused fill that runs before the reduction); see ``ds_paths``.
"""

from __future__ import annotations

from typing import List

import torch

from . import ds_paths, kernels, sizes
from .report import Progress, Result, keep

STOCK = kernels.BUCKET_LOOP
FUSED = "fused bucket_fill"
ROOFLINE = "roofline dst.copy_(src)"
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]


def run(device: str, repeats: int, quick: bool, progress: Progress = None) -> List[Result]:
    from .engines import prepare_process, quiet_deepspeed
    results = []
    for src, dst in DTYPES:
        for n, numel in sizes.kernel_shapes(quick, device):
            result = kernels.bucket_fill_samples(n, numel, src, dst, device=device, repeats=repeats)
            series = f"bucket fill {kernels._name(src)}->{kernels._name(dst)}"
            result.update(bench="bucket", series=series, x=numel * src.itemsize, n=n, numel=numel,
                          stock=STOCK, ours=FUSED, roofline=ROOFLINE, per=n, per_label="per tensor")
            keep(results, result, progress)
    prepare_process(device)
    quiet_deepspeed()
    for n, numel in sizes.shapes(quick):
        result = ds_paths.bucket_fill(n, numel, device, repeats)
        result.update(bench="bucket", series="bucket fill float32, DeepSpeed ZeRO-2 path", x=numel * 4, n=n,
                      numel=numel, per=n, per_label="per tensor", notes=[ds_paths.speedup_note(result)])
        keep(results, result, progress)
    return results


def cases(quick: bool, device: str = "cpu") -> int:
    return len(DTYPES) * len(sizes.kernel_shapes(quick, device)) + len(sizes.shapes(quick))


def targets(results: List[Result], device: str):
    from .targets import copy_targets
    kernel_level, _ = ds_paths.split(results)
    return copy_targets("fused bucket fill", kernel_level, device, FUSED, STOCK, ROOFLINE)
