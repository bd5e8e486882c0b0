"""Fused bucket fill from scattered vs sequential sources, against the roofline (CPU).

    python benchmarks/fill_source_layout.py [N NUMEL] [--dtype bfloat16|float32]

Interleaved, 40 rounds, medians: one contiguous ``dst.copy_(src)`` (the roofline), the fill
from that one source, from N separately made sources (scattered over the heap, as a
backward's gradients are), and from N views of one tensor (sequential memory). The gap
between the last two is what the sources' layout costs. To compare two builds, run it in
a worktree of each, alternately.
"""

import argparse
import statistics
import time

import torch

from zero_lifetime import ops


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("n", nargs="?", type=int, default=2000)
    parser.add_argument("numel", nargs="?", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    n, numel = args.n, args.numel
    offsets = [i * numel for i in range(n)]
    buffer = torch.empty(n * numel)
    scattered = [torch.randn(numel).to(dtype) for _ in range(n)]
    flat = torch.randn(n * numel).to(dtype)
    cases = (("roofline copy_", None), ("one source", [flat]), ("scattered sources", scattered),
             ("views of one tensor", list(flat.split(numel))))
    samples = {name: [] for name, _ in cases}
    for _ in range(args.rounds):
        for name, sources in cases:
            start = time.perf_counter()
            if sources is None:
                buffer.copy_(flat)
            else:
                ops.bucket_fill(buffer, sources, [0] if len(sources) == 1 else offsets)
            samples[name].append(time.perf_counter() - start)
    roofline = statistics.median(samples["roofline copy_"])
    print(f"{n} x {numel} {args.dtype} -> float32, torch threads {torch.get_num_threads()}, "
          f"medians of {args.rounds}")
    for name, _ in cases:
        t = statistics.median(samples[name])
        print(f"  {name:20s} {t * 1e6:8.0f} us  {t / roofline:5.2f}x")


if __name__ == "__main__":
    main()
