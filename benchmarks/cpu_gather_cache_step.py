"""ZeRO-3 training steps on the CPU, 2 ranks over gloo: time and peak memory of installed
gathers with the gather-buffer cache on and off, against stock DeepSpeed.

Each rank builds a stock and an installed ZeRO-3 engine over the same MLP (``--layers``
blocks of Linear(W, 4W) and Linear(4W, W); 16 MB per Linear at W=1024) and runs, in every
round: an installed step with the cache off (limit 0, which also frees what it held), a
stock step (so it runs with an empty cache), then two installed steps with the cache at its
default limit, the first from empty ("cold") and the second with what the first left
("warm": steady-state training). With DeepSpeed's default reuse distance a small model keeps
its params gathered from forward to the end of backward, so reuse happens across steps.
Per config, rank 0 prints the median step time and the median peak resident memory of the
process during a step (VmHWM, reset through /proc/self/clear_refs before each step): for the
warm step that includes the blocks the cache held.

With ``--trace``, rank 0 also prints one line per installed gather of the warm steps: the
buffer size, whether the cache served it, and resident memory at the start of the fused wait
and when the output buffer is requested, with the peak in between (DeepSpeed's all-gather).
The peak is reset at every wait, so the step peaks printed then include only the last gather.

    python benchmarks/cpu_gather_cache_step.py [--width 1024] [--layers 4] [--rounds 8]
                                               [--reduce-bucket-size ELEMENTS] [--trace]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

CONFIGS = ("installed, cache off", "stock", "installed, cache cold", "installed, cache warm")


def _peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rss_bytes() -> int:
    return _status_bytes("VmHWM")


def _trace_gathers(ops, enabled, lines) -> None:
    """Append to ``lines`` resident memory around each fused wait while ``enabled()``."""
    from zero_lifetime.zero3_fused import Zero3FusedCopies

    wait, gather_buffer = Zero3FusedCopies._wait, ops.gather_buffer
    at_wait_start = []

    def traced_wait(self, handle, handle_dependency):
        if enabled():
            _peak_rss_reset()
            at_wait_start.append(_status_bytes("VmRSS"))
        return wait(self, handle, handle_dependency)

    def traced_gather_buffer(numel, dtype, device):
        if not (enabled() and at_wait_start):
            return gather_buffer(numel, dtype, device)
        peak, rss = _peak_rss_bytes(), _status_bytes("VmRSS")
        hits = ops.cpu_buffer_cache_info()["hits"]
        out = gather_buffer(numel, dtype, device)
        served = "hit " if ops.cpu_buffer_cache_info()["hits"] > hits else "miss"
        mib = 2**20
        start = at_wait_start.pop()
        lines.append(f"buffer {out.numel() * out.element_size() / mib:6.1f} MiB {served}  RSS at wait start "
                     f"{start / mib:6.0f} MiB, at buffer request {rss / mib:6.0f} MiB, peak in between "
                     f"{peak / mib:6.0f} MiB ({(peak - start) / mib:+.0f})")
        return out

    Zero3FusedCopies._wait = traced_wait
    ops.gather_buffer = traced_gather_buffer


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zero_lifetime
    from zero_lifetime import ops
    from zero_lifetime.bench.engines import make_engine, quiet_deepspeed

    quiet_deepspeed()
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.ReLU(),
                                                      torch.nn.Linear(4 * w, w)) for _ in range(args.layers)])
    zero = {"reduce_bucket_size": args.reduce_bucket_size} if args.reduce_bucket_size else {}
    stock, installed = make_engine(model, **zero), make_engine(model, **zero)
    zero_lifetime.install(installed)
    default_limit = ops.set_cpu_buffer_cache_limit(0)
    rank = dist.get_rank()
    x = torch.randn(8, w, generator=torch.Generator().manual_seed(rank))
    traced = args.trace and rank == 0
    tracing, trace_lines = [], []  # tracing: non-empty during a traced step
    if traced:
        _trace_gathers(ops, lambda: bool(tracing), trace_lines)

    def step(engine):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()

    # In round order; each cache limit is set before its step (limit 0 frees what was held).
    engines = {CONFIGS[0]: (installed, 0), CONFIGS[1]: (stock, 0), CONFIGS[2]: (installed, default_limit),
               CONFIGS[3]: (installed, default_limit)}
    for name, (engine, limit) in engines.items():  # warm-up: first-step allocations, JIT, hooks
        ops.set_cpu_buffer_cache_limit(limit)
        step(engine)
    times = {name: [] for name in CONFIGS}
    peaks = {name: [] for name in CONFIGS}
    hits_before = ops.cpu_buffer_cache_info()["hits"]
    for _ in range(args.rounds):
        for name, (engine, limit) in engines.items():
            if name != CONFIGS[3]:  # the warm step keeps what the cold one left
                ops.set_cpu_buffer_cache_limit(0)
            ops.set_cpu_buffer_cache_limit(limit)
            dist.barrier()
            _peak_rss_reset()
            if traced and name == CONFIGS[3]:
                tracing.append(name)
                trace_lines.append(f"{name} step")
            start = time.perf_counter()
            step(engine)
            tracing.clear()
            times[name].append(time.perf_counter() - start)
            peaks[name].append(_peak_rss_bytes())
    ops.set_cpu_buffer_cache_limit(default_limit)
    stats = zero_lifetime.stats(installed)
    result = {"times": times, "peaks": peaks, "cache_hits": ops.cpu_buffer_cache_info()["hits"] - hits_before,
              "fused_gathers": stats["fused_gathers"], "stock_gathers": stats["stock_gathers"], "trace": trace_lines}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    zero_lifetime.uninstall(installed)


def _launch(args) -> dict:
    from zero_lifetime.bench.rank_launch import run_ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        run_ranks([sys.executable, __file__, "--worker", "--out", out, "--width", str(args.width),
                   "--layers", str(args.layers), "--rounds", str(args.rounds),
                   "--reduce-bucket-size", str(args.reduce_bucket_size)] + (["--trace"] if args.trace else []),
                  2, "cpu", 1800, "cpu_gather_cache_step")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reduce-bucket-size", type=int, default=0,
                        help="ZeRO-3 reduce_bucket_size in elements (default: DeepSpeed's)")
    parser.add_argument("--trace", action="store_true",
                        help="rank 0 prints resident memory around every gather of the warm steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        return _worker(args)
    result = _launch(args)
    w = args.width
    print(f"ZeRO-3, 2 ranks (gloo), {args.layers} x [Linear({w}, {4 * w}), Linear({4 * w}, {w})], "
          f"{8 * w * w * 4 / 2**20:.0f} MiB per block's weights, {args.rounds} interleaved rounds, "
          f"reduce_bucket_size {args.reduce_bucket_size or 'default'}")
    stock_time = statistics.median(result["times"]["stock"])
    stock_peak = statistics.median(result["peaks"]["stock"])
    print(f"{'config':<24}{'median step':>14}{'vs stock':>10}{'peak RSS (median)':>20}{'vs stock':>12}")
    for name in CONFIGS:
        t = statistics.median(result["times"][name])
        peak = statistics.median(result["peaks"][name])
        print(f"{name:<24}{t * 1e3:>11.1f} ms{t / stock_time:>9.2f}x{peak / 2**20:>16.0f} MiB"
              f"{(peak - stock_peak) / 2**20:>+8.0f} MiB")
    for line in result["trace"]:
        print(f"trace: {line}")
    print(f"rank 0: {result['fused_gathers']} fused gathers, {result['stock_gathers']} stock waits, "
          f"{result['cache_hits']} gathers served from the cache")


if __name__ == "__main__":
    main()
