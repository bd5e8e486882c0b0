"""Where an installed ZeRO-3 gather round's time goes, 2 ranks on the CPU (one shape).

    python benchmarks/gather_two_ranks_parts.py [--n 2] [--numel 4194304] [--rounds 15]

Two ranks (gloo, one thread each, as ``bench gather --ranks 2`` runs them) build a stock and
an installed ZeRO-3 engine over ``ParamBlock(n, numel)`` and time interleaved gather rounds
(``all_gather_coalesced(...).wait()``, params released untimed before each). Inside the
installed wait it times waiting on the collective, taking the buffer, the fused copy-out and
handing out the params, and reports the CPU gather-buffer cache's hits and misses. Medians
of rank 0, in ms.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time


def _time_calls(owner, name: str, into: list) -> None:
    """Record the duration of every call of ``owner.name`` (a static method stays one)."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return result

    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    setattr(owner, name, staticmethod(timed) if static else timed)


def _worker(n: int, numel: int, rounds: int, out_path: str) -> None:
    from zero_lifetime.bench.engines import ParamBlock, make_engine, prepare_process, quiet_deepspeed
    prepare_process("cpu")
    import torch
    import torch.distributed as dist

    import zero_lifetime
    from zero_lifetime import ops
    from zero_lifetime.adapters.zero3_buckets import Zero3GatherHandles
    from zero_lifetime.bench.timing import interleave

    quiet_deepspeed()
    torch.manual_seed(0)
    block = ParamBlock(n, numel)
    stock, installed = make_engine(block), make_engine(block)
    zero_lifetime.install(installed)
    stock_params, our_params = list(stock.module.parameters()), list(installed.module.parameters())
    parts = {"wait on the collective": [], "gather buffer": [], "fused copy-out": [], "hand out": []}
    _time_calls(Zero3GatherHandles, "wait_collective", parts["wait on the collective"])
    _time_calls(Zero3GatherHandles, "hand_out", parts["hand out"])
    _time_calls(ops, "gather_buffer", parts["gather buffer"])
    _time_calls(ops, "gather_copy_out", parts["fused copy-out"])

    def release(params):
        for p in params:
            if p.ds_status.name == "AVAILABLE":
                p.partition()

    rounds_s = interleave({"stock round": lambda: stock_params[0].all_gather_coalesced(stock_params).wait(),
                           "installed round": lambda: our_params[0].all_gather_coalesced(our_params).wait()},
                          "cpu", rounds, setup={"stock round": lambda: release(stock_params),
                                                "installed round": lambda: release(our_params)})
    if dist.get_rank() == 0:
        medians = {k: statistics.median(v) * 1e3 for k, v in {**rounds_s, **parts}.items() if v}
        with open(out_path, "w") as f:
            json.dump({"medians_ms": medians, "cache": ops.cpu_buffer_cache_info()}, f)
    dist.barrier()
    for engine in (stock, installed):
        engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.n, args.numel, args.rounds, args.worker)
    from zero_lifetime.bench.rank_launch import run_ranks
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        run_ranks([sys.executable, __file__, "--n", str(args.n), "--numel", str(args.numel), "--rounds",
                   str(args.rounds), "--worker", out.name], 2, "cpu", 600, "gather_two_ranks_parts")
        with open(out.name) as f:
            result = json.load(f)
    print(f"{args.n} x {args.numel} fp32, 2 ranks, {args.rounds} rounds, medians of rank 0:")
    for name, ms in result["medians_ms"].items():
        print(f"  {name:<24}{ms:8.2f} ms")
    rounds = result["medians_ms"]
    print(f"  installed / stock       {rounds['installed round'] / rounds['stock round']:8.2f}x")
    print(f"  gather-buffer cache     {result['cache']}")


if __name__ == "__main__":
    main()
