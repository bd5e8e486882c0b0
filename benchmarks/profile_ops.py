"""Where the time of one fused-op call goes: host cost, kernel time, synced wall time.

    python benchmarks/profile_ops.py [--device cuda|cpu] [--json PATH]

For each case and each way to call (the public API's direct entry, the dispatcher op through
torch.ops, and the roofline ``dst.copy_(src)`` of the same bytes), side by side in one run:

* wall: one call between two ``torch.cuda.synchronize()``, median (what ``bench`` reports);
* host: 200 calls back to back without a sync, divided by 200 (the CPU cost of a call,
  as long as the GPU keeps up);
* kernel: the device time of the call's kernels from ``torch.profiler`` (CUDA activity),
  median over 20 calls.

On CUDA, a same-dtype case of at most 64 segments also runs a fourth way, "memcpy": the
direct entry with ``ops.set_cuda_memcpy_segment_bytes(0)``, so the plan runs as one
``cudaMemcpyAsync`` per segment instead of the kernel (the A/B that decides that setting's
default). Each fused way sets the route it needs before its call (one setter call, ~0.5 us
of host time, for "direct", "memcpy" and "dispatcher" alike).

On CUDA (the default) it needs a GPU and the extension's CUDA kernels. On CPU there is no
separate kernel time, and host time is the whole time of a call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from zero_lifetime import _native, ops

CASES = [  # (kind, tensors, elements each, source dtype)
    ("fill", 2, 1 << 22, torch.float32), ("fill", 16, 1 << 20, torch.float32),
    ("fill", 16, 1 << 22, torch.float32), ("fill", 16, 1 << 20, torch.bfloat16),
    ("fill", 65, 1 << 18, torch.float32), ("fill", 2000, 4096, torch.float32),
    ("fill", 8192, 1024, torch.float32),
    ("gather", 16, 1 << 20, torch.float32), ("gather", 16, 1 << 22, torch.float32),
    ("gather", 2000, 4096, torch.float32),
]


def routed(fn, memcpy_segment_bytes):
    """``fn`` after setting the CUDA memcpy route it is measured with."""
    def call():
        ops.set_cuda_memcpy_segment_bytes(memcpy_segment_bytes)
        fn()
    return call


def make_case(kind, n, numel, dtype, device):
    if kind == "fill":
        grads = [torch.randn(numel, device=device).to(dtype) for _ in range(n)]
        offsets = [i * numel for i in range(n)]
        buffer = torch.empty(n * numel, device=device)
        flat = torch.randn(n * numel, device=device).to(dtype)
        fused = lambda: ops.bucket_fill(buffer, grads, offsets)
        dispatcher = lambda: torch.ops.zero_lifetime.bucket_fill(buffer, grads, offsets, 1.0)
        roofline = lambda: buffer.copy_(flat)
        nbytes, segments, same_dtype = n * numel * (dtype.itemsize + 4), n, dtype == torch.float32
        segment_bytes = numel * dtype.itemsize
    else:
        world = 2
        shard = -(-numel // world)
        gathered = torch.randn(world * shard * n, device=device).to(dtype)
        out = torch.empty(n * numel, device=device, dtype=dtype)
        shards, numels = [shard] * n, [numel] * n
        src = gathered.narrow(0, 0, out.numel())
        fused = lambda: ops.gather_copy_out(gathered, out, shards, numels, world)
        dispatcher = lambda: torch.ops.zero_lifetime.gather_copy_out(gathered, out, shards, numels, world)
        roofline = lambda: out.copy_(src)
        nbytes, segments, same_dtype = 2 * out.numel() * out.element_size(), world * n, True
        segment_bytes = (numel - (world - 1) * shard) * out.element_size()  # the last rank's part, the shortest
    shape = {"bytes": nbytes, "segments": segments, "segment_bytes": segment_bytes}
    if device != "cuda":  # the route is CUDA's only
        return {"direct": fused, "dispatcher": dispatcher, "roofline": roofline}, shape
    calls = {"direct": routed(fused, ops.CUDA_MEMCPY_NEVER)}
    if same_dtype and segments <= ops.cuda_memcpy_max_segments():
        calls["memcpy"] = routed(fused, 0)
    calls.update(dispatcher=routed(dispatcher, ops.CUDA_MEMCPY_NEVER), roofline=roofline)
    return calls, shape


def wall_times(calls, sync, rounds=30):
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def host_time(fn, sync, calls=200):
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls


def kernel_time(fn, calls=20):
    """Median over calls of the summed device time of the kernels and copies each call ran."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events:
        return float("nan"), []
    names = sorted({e.name[:60] for e in events})
    per_call = sum(e.time_range.elapsed_us() for e in events) / calls
    return per_call * 1e-6, names


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json")
    args = parser.parse_args()
    module = _native.load()
    if module is None:
        raise SystemExit("profile_ops: the compiled extension is not available (python -m zero_lifetime.env_report)")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("profile_ops: --device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
        if not module.cuda_kernels_compiled():
            raise SystemExit("profile_ops: the compiled extension has no CUDA kernels "
                             "(build it with a CUDA torch: python setup.py build_ext --inplace)")
        sync, device_name = torch.cuda.synchronize, torch.cuda.get_device_name()
    else:
        sync, device_name = (lambda: None), f"CPU, {torch.get_num_threads()} threads"
    print(f"{device_name}, torch {torch.__version__}")
    default_route = ops.cuda_memcpy_segment_bytes()
    rows = []
    header = f"{'case':<34}{'way':<11}{'wall us':>9}{'host us':>9}{'kernel us':>10}{'GB/s':>8}{'vs roof':>8}"
    print(header)
    for kind, n, numel, dtype in CASES:
        calls, shape = make_case(kind, n, numel, dtype, args.device)
        nbytes = shape["bytes"]
        for fn in calls.values():  # warm-up: allocator, lazy module loading
            fn()
        wall = wall_times(calls, sync)
        case = f"{kind} {n} x {numel} {str(dtype)[6:]}"
        for name, fn in calls.items():
            host = host_time(fn, sync, calls=200 if args.device == "cuda" else 10)
            kernel, names = kernel_time(fn) if args.device == "cuda" else (float("nan"), [])
            row = {"case": case, "way": name, "wall_s": wall[name], "host_s": host, "kernel_s": kernel,
                   "kernels": names, **shape, "wall_vs_roofline": wall[name] / wall["roofline"]}
            rows.append(row)
            print(f"{case:<34}{name:<11}{wall[name] * 1e6:>9.1f}{host * 1e6:>9.1f}{kernel * 1e6:>10.1f}"
                  f"{nbytes / wall[name] / 1e9:>8.0f}{row['wall_vs_roofline']:>7.2f}x")
        if args.device == "cuda":
            for row in rows[-len(calls):]:
                if row["way"] in ("direct", "memcpy"):
                    print(f"{'':<34}{row['way']}: {row['kernels']}")
            torch.cuda.empty_cache()
    ops.set_cuda_memcpy_segment_bytes(default_route)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
