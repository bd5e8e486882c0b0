"""Where non-temporal stores start to pay for the CPU fused copies (the default threshold).

    python benchmarks/streaming_threshold.py [--rounds 15] [--numel 4096]

For destinations from 1 to 64 MiB (fp32 buckets of ``--numel``-element grads): the fused
bucket fill with cached stores (threshold out of reach) and with streaming stores (threshold
0), alone and followed by a read of the whole buffer (``buffer.sum()``, what an all-reduce of
the bucket does next: streaming stores leave nothing in the cache for it). Methods interleaved
round by round, medians of per-round medians of 5 calls; ratios are streaming / cached.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from zero_lifetime import ops
from zero_lifetime.bench.timing import interleave

NEVER = 1 << 62


def _with_threshold(threshold, fn):
    def run():
        previous = ops.set_streaming_store_threshold(threshold)
        try:
            fn()
        finally:
            ops.set_streaming_store_threshold(previous)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--numel", type=int, default=4096)
    args = parser.parse_args()
    if not ops.native_available():
        raise SystemExit("streaming_threshold: the compiled extension is not available "
                         "(python -m zero_lifetime.env_report)")
    print(f"fp32 bucket fill of {args.numel}-element grads, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, default threshold {ops.streaming_store_threshold() >> 20} MiB")
    print(f"{'destination':>12}{'cached':>10}{'streaming':>11}{'ratio':>7}{'+ read: cached':>16}"
          f"{'streaming':>11}{'ratio':>7}")
    for mib in (1, 2, 4, 8, 16, 32, 64):
        n = max(1, (mib << 20) // (4 * args.numel))
        grads = [torch.randn(args.numel) for _ in range(n)]
        offsets = [i * args.numel for i in range(n)]
        buffer = torch.empty(n * args.numel)

        def fill():
            ops.bucket_fill(buffer, grads, offsets)

        def fill_then_read():
            fill()
            buffer.sum()

        methods = {"cached": _with_threshold(NEVER, fill), "streaming": _with_threshold(0, fill),
                   "cached+read": _with_threshold(NEVER, fill_then_read),
                   "streaming+read": _with_threshold(0, fill_then_read)}
        samples = interleave(methods, "cpu", args.rounds, warmup=1, calls_per_round=5)
        m = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
        print(f"{mib:>8} MiB{m['cached']:>8.3f} ms{m['streaming']:>8.3f} ms{m['streaming'] / m['cached']:>6.2f}x"
              f"{m['cached+read']:>13.3f} ms{m['streaming+read']:>8.3f} ms"
              f"{m['streaming+read'] / m['cached+read']:>6.2f}x")


if __name__ == "__main__":
    main()
