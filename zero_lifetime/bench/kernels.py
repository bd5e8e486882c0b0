"""Fused bucket fill and gather copy-out against the ways DeepSpeed and torch do it.

    python -m zero_lifetime.bench.kernels [--device cpu|cuda] [--repeats N] [--quick] [--json PATH]

Every method of a case runs once per round, rounds interleave the methods (so drift hits
all alike), medians are reported. The roofline is one contiguous ``dst.copy_(src)`` of the
same bytes (same source and destination dtypes). :func:`bucket_fill_samples` and
:func:`gather_copy_out_samples` return the raw samples for reuse by other front ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Dict, List, Sequence

import torch

from .. import ops
from .env import device_name
from .timing import interleave

BUCKET_LOOP = "per-param narrow.copy_ (kernel-level, DeepSpeed's copy pattern)"
GATHER_LOOP = "per-param torch.cat (kernel-level, DeepSpeed's copy pattern)"
BUCKET_SHAPES = [(2000, 4096), (200, 65536), (16, 1 << 20)]  # (tensors, elements each)
GATHER_WORLD_SIZES = (2, 4)


def bucket_fill_samples(n_tensors: int, numel: int, src_dtype: torch.dtype = torch.float32,
                        dst_dtype: torch.dtype = torch.float32, device: str = "cpu",
                        repeats: int = 15) -> Dict[str, object]:
    """Seconds per call of each way to fill a flat bucket from n_tensors grads of numel."""
    grads = [torch.randn(numel, device=device).to(src_dtype) for _ in range(n_tensors)]
    offsets = [i * numel for i in range(n_tensors)]
    buffer = torch.empty(n_tensors * numel, device=device, dtype=dst_dtype)
    views = [buffer.narrow(0, off, numel) for off in offsets]
    flat_src = torch.randn(n_tensors * numel, device=device).to(src_dtype)

    def deepspeed_loop():  # stage 1/2 ipg bucket: one narrow().copy_() per grad
        for g, off in zip(grads, offsets):
            buffer.narrow(0, off, g.numel()).copy_(g.view(-1))

    methods = {
        "fused bucket_fill": lambda: ops.bucket_fill(buffer, grads, offsets),
        BUCKET_LOOP: deepspeed_loop,
        "_foreach_copy_ (views prebuilt)": lambda: torch._foreach_copy_(views, grads),
        "torch.cat(out=)": lambda: torch.cat(grads, out=buffer),
        "roofline dst.copy_(src)": lambda: buffer.copy_(flat_src),
    }
    nbytes = n_tensors * numel * (flat_src.element_size() + buffer.element_size())
    return {"case": f"bucket fill {n_tensors} x {numel} {_name(src_dtype)}->{_name(dst_dtype)}",
            "bytes": nbytes, "samples": interleave(methods, device, repeats)}


def gather_copy_out_samples(n_params: int, numel: int, world_size: int,
                            dtype: torch.dtype = torch.float32, device: str = "cpu",
                            repeats: int = 15) -> Dict[str, object]:
    """Seconds per call of each way to unshard a rank-major all-gathered flat buffer."""
    shard = -(-numel // world_size)
    shard_numels, numels = [shard] * n_params, [numel] * n_params
    segment = shard * n_params
    gathered = torch.randn(world_size * segment, device=device).to(dtype)
    out = torch.empty(n_params * numel, device=device, dtype=dtype)
    out_views = [out.narrow(0, i * numel, numel).view(world_size, shard) for i in range(n_params)]
    ranks_view = gathered.view(world_size, segment)
    roof_src = gathered.narrow(0, 0, out.numel())

    def deepspeed_cat():  # AllGatherCoalescedHandle.wait: one torch.cat per param
        params = []
        for i in range(n_params):
            parts = [gathered.narrow(0, r * segment + i * shard, min(numel - r * shard, shard))
                     for r in range(world_size) if r * shard < numel]
            params.append(torch.cat(parts))
        return params

    methods = {
        "fused gather_copy_out": lambda: ops.gather_copy_out(
            gathered, out, shard_numels, numels, world_size),
        GATHER_LOOP: deepspeed_cat,
        "split_with_sizes_copy": lambda: torch.split_with_sizes_copy(
            ranks_view, shard_numels, dim=1, out=out_views),
        "roofline dst.copy_(src)": lambda: out.copy_(roof_src),
    }
    nbytes = 2 * out.numel() * out.element_size()
    return {"case": f"gather copy-out {n_params} x {numel} world {world_size} {_name(dtype)}",
            "bytes": nbytes, "samples": interleave(methods, device, repeats)}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def summarize(result: Dict[str, object]) -> List[Dict[str, object]]:
    """Rows of median time, GB/s and ratio to the roofline for one case."""
    samples = result["samples"]
    roof = statistics.median(samples["roofline dst.copy_(src)"])
    rows = []
    for method, times in samples.items():
        median = statistics.median(times)
        rows.append({"case": result["case"], "method": method, "median_ms": median * 1e3,
                     "gb_per_s": result["bytes"] / median / 1e9, "vs_roofline": median / roof})
    return rows


def run_all(device: str = "cpu", repeats: int = 15, quick: bool = False) -> List[Dict[str, object]]:
    shapes = BUCKET_SHAPES[:1] + BUCKET_SHAPES[-1:] if quick else BUCKET_SHAPES
    results = []
    for n, numel in shapes:
        results.append(bucket_fill_samples(n, numel, device=device, repeats=repeats))
        results.append(bucket_fill_samples(n, numel, torch.bfloat16, torch.float32, device, repeats))
    for n, numel in shapes:
        for world in GATHER_WORLD_SIZES:
            results.append(gather_copy_out_samples(n, numel, world, device=device, repeats=repeats))
    return results


def print_table(results: Sequence[Dict[str, object]]) -> None:
    print("| case | method | median | GB/s | time / roofline |\n|---|---|---:|---:|---:|")
    for result in results:
        for row in summarize(result):
            print(f"| {row['case']} | {row['method']} | {row['median_ms']:.3f} ms | "
                  f"{row['gb_per_s']:.1f} | {row['vs_roofline']:.2f}x |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per case (15, quick 5)")
    parser.add_argument("--quick", action="store_true", help="two shapes, fewer rounds")
    parser.add_argument("--json", help="also write rows and raw samples to this file")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    print(f"# device {args.device} ({device_name(args.device)}), torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, fused ops "
          f"{'compiled' if ops.native_available() else 'pure-torch reference'}, {repeats} rounds")
    results = run_all(args.device, repeats, args.quick)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "repeats": repeats,
                       "rows": [r for res in results for r in summarize(res)],
                       "samples": results}, f, indent=1)


if __name__ == "__main__":
    main()
