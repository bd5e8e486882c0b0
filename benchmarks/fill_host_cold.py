"""The CPU fused bucket fill's host work with cold caches, and its share of a real fill.

    python benchmarks/fill_host_cold.py [--tensors 8192] [--numel 1024] [--dtype float32|bfloat16]

* host work, warm and cold: ``bucket_fill`` of one-element sources (nearly nothing copied),
  median of 60 calls, cold with a 128 MiB copy before each call to evict the caches (a real
  fill's copy evicts them only partly: its destination is written with streaming stores);
* the real fill against the same bytes from one source and the roofline ``copy_`` (medians of
  per-round means of 100 calls, methods interleaved over 9 rounds): fill minus one-source fill
  is what the many sources cost.
"""

from __future__ import annotations

import statistics
import time

import torch

from fill_args import parse_fill_args
from zero_lifetime import ops


def _median_call(fn, calls: int, before=None) -> float:
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _mean_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main():
    args, dtype = parse_fill_args("fill_host_cold", __doc__.splitlines()[0])
    n, numel = args.tensors, args.numel
    offsets = [i * numel for i in range(n)]
    buffer = torch.empty(n * numel)
    single_elements = [torch.randn(1).to(dtype) for _ in range(n)]
    sources = [torch.randn(numel).to(dtype) for _ in range(n)]
    flat = torch.randn(n * numel).to(dtype)
    evict_src, evict_dst = torch.ones(32 << 20), torch.empty(32 << 20)

    def host_only():
        ops.bucket_fill(buffer, single_elements, offsets)

    warm, cold = [], []
    for _ in range(5):
        warm.append(_median_call(host_only, 60))
        cold.append(_median_call(host_only, 60, before=lambda: evict_dst.copy_(evict_src)))
    print(f"{n} x {numel} {args.dtype} -> float32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, samples in (("host work, warm", warm), ("host work, cold", cold)):
        seconds = statistics.median(samples)
        print(f"{name:<24}{seconds * 1e3:>8.3f} ms{seconds / n * 1e9:>8.0f} ns per source")

    methods = {"roofline copy_": lambda: buffer.copy_(flat),
               "fused fill": lambda: ops.bucket_fill(buffer, sources, offsets),
               "fused, one source": lambda: ops.bucket_fill(buffer, [flat], [0])}
    rounds = {name: [] for name in methods}
    for _ in range(9):
        for name, fn in methods.items():
            rounds[name].append(_mean_call(fn, 100))
    roofline = statistics.median(rounds["roofline copy_"])
    for name, samples in rounds.items():
        seconds = statistics.median(samples)
        print(f"{name:<24}{seconds * 1e3:>8.3f} ms{seconds / roofline:>7.2f}x roofline")


if __name__ == "__main__":
    main()
