"""Where the CPU fused bucket fill loses to one contiguous copy with thousands of small grads.

    python benchmarks/fill_host_cost.py [--tensors 8192] [--numel 1024] [--rounds 15]
                                        [--dtype float32|bfloat16|float16]

The buffer is float32; ``--dtype`` is the grads' dtype (bfloat16: the cast fill of bf16
grads into an fp32 bucket, and a bf16 -> fp32 ``copy_`` as its roofline).

Side by side in one process, methods interleaved round by round (medians of per-round
medians of 10 calls), each as time / the roofline ``buffer.copy_(flat)`` of the same bytes:

* scattered: one separately allocated source per grad (what autograd hands over);
* contiguous views: the same bytes as views of one flat tensor (no scattered sources);
* host work only: the same number of 1-element sources, so nearly nothing is copied;
* tuple input: the scattered sources passed as a prebuilt tuple instead of a list.
"""

from __future__ import annotations

import statistics

import torch

from fill_args import parse_fill_args
from zero_lifetime import ops
from zero_lifetime.bench.timing import interleave


def main():
    args, dtype = parse_fill_args("fill_host_cost", __doc__.splitlines()[0],
                                  lambda parser: parser.add_argument("--rounds", type=int, default=15))
    n, numel = args.tensors, args.numel

    # Allocated as bench.kernels does (fp32 randn, then cast).
    scattered = [torch.randn(numel).to(dtype) for _ in range(n)]
    flat = torch.randn(n * numel).to(dtype)
    views = list(flat.split(numel))
    single_elements = [torch.randn(1).to(dtype) for _ in range(n)]
    offsets = [i * numel for i in range(n)]
    buffer = torch.empty(n * numel)
    tuple_sources, tuple_offsets = tuple(scattered), tuple(offsets)
    methods = {
        "roofline copy_": lambda: buffer.copy_(flat),
        "fused, scattered sources": lambda: ops.bucket_fill(buffer, scattered, offsets),
        "fused, contiguous views": lambda: ops.bucket_fill(buffer, views, offsets),
        "fused, host work only": lambda: ops.bucket_fill(buffer, single_elements, offsets),
        "fused, scattered, tuple input": lambda: ops.bucket_fill(buffer, tuple_sources, tuple_offsets),
    }
    samples = interleave(methods, "cpu", args.rounds, warmup=1, calls_per_round=10)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    roofline = medians["roofline copy_"]
    print(f"{n} x {numel} {args.dtype} -> float32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, seconds in medians.items():
        print(f"{name:<32}{seconds * 1e3:>8.2f} ms{seconds / roofline:>7.2f}x roofline"
              f"{seconds / n * 1e9:>8.0f} ns per tensor")


if __name__ == "__main__":
    main()
