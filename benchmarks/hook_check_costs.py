"""What two small per-forward costs of a ZeRO-3 install are, each next to its baseline.

    python benchmarks/hook_check_costs.py [--calls N] [--repeat R]

1. The check that DeepSpeed has not registered its module hooks again since the last forward
   (``HooksAfterDeepSpeed.keep_after_deepspeeds``, run twice per forward: in
   ``engine.forward`` and in a pre-forward hook put first on the root), on a real installed
   engine where nothing changed (the common case). Baseline: an empty Python call.
2. Pack + unpack of one saved non-param tensor (an activation) under an outer saved-tensor
   pair such as ``save_on_cpu()``: the outer pair alone, the tracker alone (no outer pair, what
   every install pays), and the two chained (``outer_saved_tensor_hooks.chained_with``, only
   paid with an outer pair in force).

``timeit``, best of ``--repeat`` runs of ``--calls`` calls, single-threaded; microseconds per
call. The figures in docs/reliability.md (2026-11-28) came from this measurement.
"""

import argparse
import os
import timeit


def check_rows(calls: int, repeat: int) -> None:
    import torch

    import zero_lifetime
    from zero_lifetime.bench.engines import TinyTransformer, make_engine, quiet_deepspeed
    from zero_lifetime.bench.step import single_backward_step

    quiet_deepspeed()
    engine = make_engine(TinyTransformer(2, 32), 3)
    installation = zero_lifetime.install(engine)
    single_backward_step(engine, torch.randint(0, 512, (8, 8)))  # DeepSpeed's hooks as in training

    def empty():
        pass

    rows = {"empty Python call": empty, "keep_after_deepspeeds()": installation.module_hooks.keep_after_deepspeeds}
    print(f"1. the hooks-registered-again check, {calls} calls, best of {repeat}")
    for name, call in rows.items():
        print(f"   {name:28s} {_best_us(call, calls, repeat):6.3f} us per call")
    if installation.module_hooks.registered_again:
        print("   (DeepSpeed registered its hooks again during the run: the check did the work too)")
    engine.destroy()


def saved_pair_rows(calls: int, repeat: int) -> None:
    import torch

    from zero_lifetime.outer_saved_tensor_hooks import chained_with
    from zero_lifetime.tracker import make_tracker

    tracker = make_tracker("regather", 0)
    activation = torch.randn(8, 32)

    def outer_pack(tensor):  # an offloading pair's shape: a wrapper around the tensor
        return (tensor.device, tensor)

    def outer_unpack(packed):
        return packed[1]

    pairs = {"outer pair alone": (outer_pack, outer_unpack),
             "tracker alone": (tracker.pack, tracker.unpack),
             "tracker chained with outer": chained_with(tracker, (outer_pack, outer_unpack))}
    print(f"2. pack + unpack of one activation, {calls} calls, best of {repeat}")
    for name, (pack, unpack) in pairs.items():
        print(f"   {name:28s} {_best_us(lambda p=pack, u=unpack: u(p(activation)), calls, repeat):6.3f} us per call")


def _best_us(call, calls: int, repeat: int) -> float:
    return min(timeit.repeat(call, number=calls, repeat=repeat)) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from zero_lifetime.single_rank import single_rank_env
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    single_rank_env()
    import torch
    torch.set_num_threads(1)
    check_rows(args.calls, args.repeat)
    saved_pair_rows(args.calls, args.repeat)


if __name__ == "__main__":
    main()
