"""The CPU gather copy-out's ratio to the roofline right after `bench release` in one process, as
`bench all` runs them (not run in CI): the figures behind docs/benchmarks.md, "The engines a
bench run leaves alive". Since the bench frees its engines (1b40146) the 8192 x 1K case read
higher in `bench all`; run this on two checkouts, alternating, to compare.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.gather_after_release [--no-release]
"""
import contextlib
import io
import statistics
import sys


def main(argv) -> None:
    from zero_lifetime.bench.cli import main as bench_main
    if "--no-release" not in argv:
        with contextlib.redirect_stdout(io.StringIO()):
            bench_main(["release"])
    from zero_lifetime.bench import kernels
    for n, numel in [(8192, 1024), (2000, 4096)]:
        samples = kernels.gather_copy_out_samples(n, numel, 2, repeats=15)["samples"]
        fused, roofline = (statistics.median(samples[m]) for m in ("fused gather_copy_out", "roofline dst.copy_(src)"))
        print(f"gather copy-out {n} x {numel} world 2: fused {fused * 1e3:.2f} ms, roofline "
              f"{roofline * 1e3:.2f} ms, fused / roofline {fused / roofline:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
