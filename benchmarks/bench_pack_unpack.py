"""Micro-benchmark: cost of pack + unpack (+ handle death) per saved tensor.

    python benchmarks/bench_pack_unpack.py [--iters N] [--repeats R]

Compares the compiled tracker (zero_lifetime._C, loaded or JIT-built through
_native.load()) with the pure-Python one (zero_lifetime.tracker_py) on the cases the
saved-tensor hooks see: a registered param, an autograd view of one (W.t(), what linear
saves), a detached view found by address, and non-params (an activation with a grad_fn,
which is detached, and a leaf, which is returned as is). 128 params are registered with
address ranges, so non-params pay for a real range lookup. Reports the median over
repeats of the mean ns per pack+unpack.
"""

import argparse
import enum
import statistics
import time

import torch

from zero_lifetime import _native, tracker_py


class Status(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2


def make_tracker(tracker_cls, policy):
    tr = tracker_cls(policy, -1)
    noop = lambda p: None  # noqa: E731
    tr.set_callbacks(noop, noop, noop)
    tr.set_available_status(Status.AVAILABLE)
    params = []
    for i in range(128):
        p = torch.nn.Parameter(torch.randn(64, 64))
        p.ds_id, p.ds_numel, p.ds_persist, p.ds_status = i, p.numel(), False, Status.AVAILABLE
        tr.register_param(p)
        tr.note_gathered(p)
        params.append(p)
    return tr, params


def time_case(tr, t, iters):
    pack, unpack = tr.pack, tr.unpack
    start = time.perf_counter_ns()
    for _ in range(iters):
        unpack(pack(t))  # the handle dies at the end of the statement: release included
    return (time.perf_counter_ns() - start) / iters


def cases(params):
    w = params[17]
    x = torch.randn(64, 64, requires_grad=True)
    return {
        "param itself": w,
        "param view (W.t())": w.t(),
        "detached view (address lookup)": w.data[3:],
        "non-param with grad_fn": x * 2,
        "non-param leaf": x,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    impls = {"python": tracker_py.Tracker}
    module = _native.load()
    if module is None:
        print(f"compiled tracker unavailable: {_native.status()['error']}")
    else:
        impls["compiled"] = module.Tracker
        print(f"compiled: {_native.status()['so_path']}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{args.iters} iters x {args.repeats} repeats, median of per-call means\n")

    results = {}
    for policy in ("regather", "pin"):
        for impl_name, tracker_cls in impls.items():
            tr, params = make_tracker(tracker_cls, policy)
            for case_name, t in cases(params).items():
                if policy == "pin" and not case_name.startswith("param"):
                    continue  # pin only changes the param path (pin + unpin per call)
                time_case(tr, t, 1000)  # warm-up
                runs = [time_case(tr, t, args.iters) for _ in range(args.repeats)]
                results[(policy, case_name, impl_name)] = statistics.median(runs)
            assert tr.stats()["live_handles"] == 0

    header = f"{'policy':<9} {'case':<32} {'python ns':>10} {'compiled ns':>12} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    for (policy, case_name, impl_name), ns in results.items():
        if impl_name != "python":
            continue
        compiled = results.get((policy, case_name, "compiled"))
        speedup = f"{ns / compiled:.1f}x" if compiled else "-"
        compiled_s = f"{compiled:.0f}" if compiled else "-"
        print(f"{policy:<9} {case_name:<32} {ns:>10.0f} {compiled_s:>12} {speedup:>8}")


if __name__ == "__main__":
    main()
