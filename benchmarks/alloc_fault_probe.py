"""What a fresh CPU buffer costs: ``torch.empty(n).fill_(1)`` per size, in the order given.

    python benchmarks/alloc_fault_probe.py 8 16 31.9 32 48 64 [--calls 12]

One thread, each size ``--calls`` times in a row, the buffer dropped after each call; prints
the median per size in ms and ms per MiB. Order matters: whether glibc reuses a freed block or
maps fresh pages (faulted in on first write) depends on what ran before, and from 32 MiB it
maps fresh every time. This is why the installed ZeRO-3 wait reuses its CPU gather buffers
(``ops.gather_buffer``, docs/benchmarks.md "CPU ZeRO-3 gathers: released buffers reused").
Run it in a fresh process per history you want to see.
"""

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes_mib", type=float, nargs="+", help="buffer sizes in MiB, run in this order")
    parser.add_argument("--calls", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for mib in args.sizes_mib:
        numel = int(mib * 2**20) // 4
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            buffer = torch.empty(numel)
            buffer.fill_(1.0)
            del buffer
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(f"{mib:7.1f} MiB: median {median * 1e3:7.2f} ms ({median * 1e3 / mib:.3f} ms/MiB), "
              f"min {min(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
