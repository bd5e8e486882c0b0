"""Re-pointing gradients at their bucket slices: the Python loop DeepSpeed (and zero_lifetime up
to 861f0d9) runs after each bucket fill, against the compiled ``ops.repoint_to_slices``.

    python benchmarks/repoint_cost.py [--rounds 9]

Per case, both ways run on fresh gradients (a new tensor per gradient, as autograd hands
them over) in every round, interleaved; medians reported, with the time per tensor and the
fused fill of the same gradients for scale.
"""

import argparse
import statistics
import time

import torch

from zero_lifetime import ops, ops_reference

SHAPES = [(8192, 1024), (2000, 4096), (128, 65536), (16, 1 << 20)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if not ops.native_available():
        raise SystemExit("needs the compiled extension (python setup.py build_ext --inplace)")
    ways = {"python loop": ops_reference.repoint_to_slices, "compiled": ops.repoint_to_slices}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds, medians")
    print("| gradients | fused fill | python loop | compiled | loop / compiled |")
    print("|---|---:|---:|---:|---:|")
    for n, numel in SHAPES:
        buffer = torch.empty(n * numel)
        offsets = [i * numel for i in range(n)]
        times = {name: [] for name in ("fill", *ways)}
        for _ in range(args.rounds):
            for name, repoint in ways.items():
                grads = [torch.randn(numel) for _ in range(n)]
                start = time.perf_counter()
                ops.bucket_fill(buffer, grads, offsets)
                filled = time.perf_counter()
                repoint(buffer, grads, offsets)
                times[name].append(time.perf_counter() - filled)
                times["fill"].append(filled - start)
                if grads[-1].data_ptr() != buffer.data_ptr() + offsets[-1] * 4:
                    raise SystemExit(f"{name} did not re-point the gradients")
        med = {name: statistics.median(values) for name, values in times.items()}
        per = lambda name: f"{med[name] * 1e3:.2f} ms ({med[name] / n * 1e6:.2f} us each)"  # noqa: E731
        print(f"| {n} x {numel} | {med['fill'] * 1e3:.2f} ms | {per('python loop')} | {per('compiled')} | "
              f"{med['python loop'] / med['compiled']:.1f}x |")


if __name__ == "__main__":
    main()
