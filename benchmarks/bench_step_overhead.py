"""Overhead of zero_lifetime.install on a ZeRO-3 (or ZeRO-2) training step, side by side with stock.

One process, 1 rank (gloo, CPU). A small transformer; stock and installed engines
are built from the same weights and their steps are interleaved, so machine noise
hits both alike. Reports medians and the ratio, plus gathered bytes (params held
gathered beyond persistence) after forward and at peak during a retained
two-backward step under each policy.

    python benchmarks/bench_step_overhead.py [--stage 3] [--steps 30] [--layers 4] [--width 256]

With --stage 2 only the step time is compared (the gathered-bytes part is ZeRO-3's).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from zero_lifetime.single_rank import single_rank_env  # noqa: E402

single_rank_env()

import torch  # noqa: E402
import deepspeed  # noqa: E402
import zero_lifetime  # noqa: E402
# The model, engines and steps of `python -m zero_lifetime.bench step`, so both measure the same thing.
from zero_lifetime.bench.engines import TinyTransformer, make_engine  # noqa: E402
from zero_lifetime.bench.step import PeakGathered, gathered_bytes, single_backward_step  # noqa: E402


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(2, 3), default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyTransformer(args.layers, args.width)
    stock = make_engine(model, args.stage)
    installed = make_engine(model, args.stage)
    zero_lifetime.install(installed)
    tokens = torch.randint(0, 512, (8, args.seq))

    for engine in (stock, installed):  # warm-up: trace recording, first gathers
        for _ in range(3):
            single_backward_step(engine, tokens)
    times = {"stock": [], "installed": []}
    for _ in range(args.steps):
        times["stock"].append(timed(single_backward_step, stock, tokens))
        times["installed"].append(timed(single_backward_step, installed, tokens))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in stock.module.parameters())
    print(f"ZeRO-{args.stage} single-backward step, {n_params / 1e6:.2f}M params, {args.steps} interleaved steps, "
          f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}")
    print(f"  stock      median {med['stock']:8.2f} ms")
    print(f"  installed  median {med['installed']:8.2f} ms   overhead {100 * (med['installed'] / med['stock'] - 1):+.2f}%")

    if args.stage != 3:
        return
    # Memory: gathered bytes after forward and at peak (stock single backward vs retained windows).
    # Release eagerly (no reuse window, no prefetch) so that stock frees module by module.
    eager = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    rows = []
    stock = make_engine(model, **eager)
    for _ in range(3):
        single_backward_step(stock, tokens)
    with PeakGathered(stock) as probe:  # leaving it removes its hooks, which keep the engine alive
        logits = stock(tokens)
        after_forward = gathered_bytes(stock)
        stock.backward(logits.pow(2).mean())
        stock.step()
    rows.append(("stock, single backward", after_forward, probe.peak))
    for policy in ("regather", "pin"):
        engine = make_engine(model, **eager)
        zero_lifetime.install(engine, policy=policy)
        for _ in range(3):  # same warm-up as the stock engine: a recorded trace
            single_backward_step(engine, tokens)
        with PeakGathered(engine) as probe:
            logits = engine(tokens)
            after_forward = gathered_bytes(engine)
            engine.backward(logits.pow(2).mean(), retain_graph=True)
            engine.backward(logits.mean())
            engine.step()
            del logits
        rows.append((f"installed {policy}, retained two backwards", after_forward, probe.peak))
    base_peak = rows[0][2]
    print("Gathered (non-persistent) param bytes, stage3_max_reuse_distance=0, no prefetch:")
    for name, after, peak in rows:
        print(f"  {name:42s} after forward {after / 2**20:7.2f} MiB   peak {peak / 2**20:7.2f} MiB "
              f"({100 * (peak / base_peak - 1):+.1f}% vs stock)")


if __name__ == "__main__":
    main()
