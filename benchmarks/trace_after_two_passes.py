"""Gathered params of single-backward ZeRO-3 steps after a first (recorded) two-pass step.

    python benchmarks/trace_after_two_passes.py

DeepSpeed records its ZeRO-3 trace in the first step; recorded with two backwards, it expects
a second backward in every later step and keeps params for it. For the bench's 4-layer
transformer (1 rank), gradient accumulation 1 and 2, DeepSpeed's default windows and windows
of a quarter of the model: per step, the peak of gathered params (every module forward and
gradient), what stays gathered from the end of the backward until step(), and the params
all-gathered (each param of each ``all_gather_coalesced``), stock (single
backwards only) next to installed (two backwards in the first two steps, then single ones).
"""

import torch

from zero_lifetime.bench.engines import TinyTransformer, make_engine, prepare_process, quiet_deepspeed

MiB = 2 ** 20


def run(model, tokens, installed, schedule, gas, window):
    import zero_lifetime
    from zero_lifetime.bench.step import PeakGathered, count_param_fetches, gathered_bytes
    windows = {} if window is None else dict(stage3_max_reuse_distance=window, stage3_prefetch_bucket_size=window,
                                             stage3_max_live_parameters=window)
    engine = make_engine(model, 3, gas, **windows)
    if installed:
        zero_lifetime.install(engine)
    fetched = count_param_fetches(engine)
    cells = []
    with PeakGathered(engine) as probe:  # leaving it removes its hooks, which keep the engine alive
        for passes in schedule:
            probe.reset()
            before = fetched[0]
            logits = engine(tokens)
            if passes == 2:
                engine.backward(logits.pow(2).mean(), retain_graph=True)
                engine.backward(logits.mean())
            else:
                engine.backward(logits.pow(2).mean())
            held = gathered_bytes(engine)
            engine.step()
            cells.append(f"{passes}: {probe.peak / MiB:.2f}/{held / MiB:.2f}/{fetched[0] - before}")
    engine.destroy()
    return cells


def main():
    prepare_process("cpu")
    quiet_deepspeed()
    torch.manual_seed(0)
    model = TinyTransformer(4, 256)
    numel = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 512, (8, 64))
    print(f"# {numel / 1e6:.2f}M params ({numel * 4 / MiB:.2f} MiB); per step 'backwards: peak/held MiB/params fetched'")
    for gas in (1, 2):
        for window in (None, numel // 4):
            label = "default windows" if window is None else f"windows {window} elements"
            for name, installed, schedule in (("stock", False, [1] * 8), ("installed", True, [2, 2] + [1] * 6)):
                cells = run(model, tokens, installed, schedule, gas, window)
                print(f"gas {gas}, {label}, {name:9s}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
