"""Where non-temporal stores start to pay for the CPU fused copies (the default threshold).

    python benchmarks/streaming_threshold.py [--rounds 15] [--numel 4096] [--sizes 1,2,...,256]
        [--kinds fill,fill-bf16,gather] [--cache warm|hot|cold]

For destinations from 1 to 256 MiB: a fused op (``fill``: fp32 bucket fill of ``--numel``-element
grads; ``fill-bf16``: the same from bf16 grads; ``gather``: fp32 gather copy-out of
``--numel``-element params, world 2) with cached stores (threshold out of reach) and with
streaming stores (threshold 0), alone and followed by a read of the whole destination
(``sum()``, what an all-reduce of the bucket or the forward does next: streaming stores leave
nothing in the cache for it). Methods interleaved round by round; ratios are streaming / cached.

The answer depends on what is still in the cache when the op starts (``--cache``):
  warm  the same buffers again and again, 5 calls in a row per method and round (median);
  hot   the destination written by a plain ``copy_`` (untimed) right before every call;
  cold  1 GiB written (untimed) before every call, as the backward and step between two fills
        of one bucket do in training.
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
        with ops.streaming_stores(threshold):
            fn()
    return run


def _fused_op(kind: str, dest_bytes: int, numel: int):
    """(op, destination) for ``kind`` writing ``dest_bytes`` of fp32."""
    n = max(1, dest_bytes // (4 * numel))
    destination = torch.empty(n * numel)
    if kind == "gather":
        shard = -(-numel // 2)
        gathered = torch.randn(2 * n * shard)
        return (lambda: ops.gather_copy_out(gathered, destination, [shard] * n, [numel] * n, 2)), destination
    grads = [torch.randn(numel).to(torch.bfloat16 if kind == "fill-bf16" else torch.float32) for _ in range(n)]
    offsets = [i * numel for i in range(n)]
    return (lambda: ops.bucket_fill(destination, grads, offsets)), destination


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64,96,128,256", help="destination sizes in MiB")
    parser.add_argument("--kinds", default="fill", help="comma-separated: fill, fill-bf16, gather")
    parser.add_argument("--cache", choices=("warm", "hot", "cold"), default="warm")
    args = parser.parse_args()
    if not ops.native_available():
        raise SystemExit("streaming_threshold: the compiled extension is not available "
                         "(python -m zero_lifetime.env_report)")
    print(f"{args.numel}-element tensors, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"default threshold {ops.streaming_store_threshold() >> 20} MiB, cache {args.cache}")
    print(f"{'kind':<10}{'destination':>12}{'cached':>10}{'streaming':>11}{'ratio':>7}{'+ read: cached':>16}"
          f"{'streaming':>11}{'ratio':>7}")
    scratch = torch.zeros(1 << 28) if args.cache == "cold" else None
    for mib in (int(size) for size in args.sizes.split(",")):
        for kind in args.kinds.split(","):
            fused, destination = _fused_op(kind, mib << 20, args.numel)

            def then_read(fn):
                def run():
                    fn()
                    destination.sum()
                return run

            cached, streaming = _with_threshold(NEVER, fused), _with_threshold(0, fused)
            methods = {"cached": cached, "streaming": streaming,
                       "cached+read": then_read(cached), "streaming+read": then_read(streaming)}
            if args.cache == "warm":
                samples = interleave(methods, "cpu", args.rounds, warmup=1, calls_per_round=5)
            else:
                source = torch.zeros_like(destination)
                prepare = (lambda: scratch.add_(1.0)) if args.cache == "cold" else (lambda: destination.copy_(source))
                samples = interleave(methods, "cpu", args.rounds, warmup=1, setup={name: prepare for name in methods})
            m = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
            print(f"{kind:<10}{mib:>8} MiB{m['cached']:>8.3f} ms{m['streaming']:>8.3f} ms"
                  f"{m['streaming'] / m['cached']:>6.2f}x{m['cached+read']:>13.3f} ms{m['streaming+read']:>8.3f} ms"
                  f"{m['streaming+read'] / m['cached+read']:>6.2f}x", flush=True)
            del fused, destination, methods


if __name__ == "__main__":
    main()
