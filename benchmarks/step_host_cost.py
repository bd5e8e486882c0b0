"""Where install's host time per ZeRO-3 step goes, measured on its parts, side by side.

    python benchmarks/step_host_cost.py [--rounds N]

On a GPU a small model's step is bound by host (Python) time, so install's overhead there is
its added host time per step. A whole-step A/B on shared CPUs cannot resolve a few hundred
microseconds (stock steps of one run vary by milliseconds), so this times the parts:

1. Saved-tensor hooks. A forward + backward of the benchmark's 4-layer transformer without
   hooks, with identity hooks (torch's machinery alone: every saved tensor, activations
   included, is wrapped into a Python object and passed to Python callables), and with the
   tracker's pack/unpack. The difference to "none" is what the lifetime design costs.
2. Per-step walks over the module tree, on a real installed engine: the per-module
   pre-forward hooks that note where gathered params live, the unmanaged-param check after
   each backward, the module counters kept after each forward. For each, the way used up to
   commit fcef173 (re-created here: ``parameters()`` walked on every call) next to the
   current one.
3. The same pre-forward hooks inside real training steps: a timer around every call. Caches
   are cold there (a whole backward ran since the last forward), so a call costs several
   times what it costs in the loop of part 2.

Rounds interleave every variant; medians reported. Single-threaded (``torch.set_num_threads(1)``).
"""

import argparse
import os
import statistics
import time
import timeit


def saved_hook_rows(rounds: int):
    import torch

    from zero_lifetime.bench.engines import TinyTransformer
    from zero_lifetime.tracker import make_tracker

    torch.manual_seed(0)
    model = TinyTransformer(4, 32)
    tokens = torch.randint(0, 512, (8, 8))
    tracker = make_tracker("regather", 0)
    saved = []

    def step(hooks):
        if hooks is None:
            model(tokens).pow(2).mean().backward()
            return
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            model(tokens).pow(2).mean().backward()

    step((lambda t: saved.append(1) or t, lambda t: t))
    variants = {"no hooks": None, "identity hooks": (lambda t: t, lambda t: t),
                "tracker pack/unpack": (tracker.pack, tracker.unpack)}
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, hooks in variants.items():
            start = time.thread_time()
            step(hooks)
            samples[name].append(time.thread_time() - start)
    base = statistics.median(samples["no hooks"])
    print(f"1. forward + backward, {len(saved)} saved tensors per step, median of {rounds} rounds (thread time)")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"   {name:22s} {median * 1e3:7.3f} ms  (+{(median - base) * 1e6:6.0f} us, "
              f"{(median - base) * 1e6 / len(saved):.1f} us per saved tensor)")


def walk_rows(rounds: int):
    import torch

    import zero_lifetime
    from zero_lifetime.adapters import zero3_params
    from zero_lifetime.bench.engines import TinyTransformer, make_engine, quiet_deepspeed
    from zero_lifetime.bench.step import single_backward_step

    quiet_deepspeed()
    engine = make_engine(TinyTransformer(4, 32), 3)
    installation = zero_lifetime.install(engine)
    single_backward_step(engine, torch.randint(0, 512, (8, 8)))
    lifetime, guard = installation.lifetime, installation.grad_guard
    tracker, available = lifetime.tracker, lifetime.zparams.AVAILABLE
    for param in engine.module.parameters():  # every param gathered: each hook does its full work
        if param.ds_status != available:
            param.all_gather()
    modules = list(engine.module.modules())
    counters = zero3_params._MODULE_BACKWARD_COUNTERS

    def note_walking():
        for module in modules:
            for param in module.parameters(recurse=False):
                if param.ds_status == available:
                    tracker.note_gathered(param)

    hooks = [(m, lifetime._note_gathered_hook(own)) for m in modules if (own := tuple(m.parameters(recurse=False)))]

    def note_now():
        for module, hook in hooks:
            hook(module, ())

    def check_walking():
        return [p for p in engine.module.parameters() if p.grad is not None and id(p) not in guard._managed]

    def check_now():
        return [p for p in guard._unmanaged if p.grad is not None]

    def counters_walking():
        return [(m, tuple(m.__dict__.get(n) for n in counters)) for m in modules
                if "applied_pre_backward_ref_cnt" in m.__dict__]

    def counters_now():
        return zero3_params.Zero3Params.module_counters(modules)

    assert check_walking() == check_now() and counters_walking() == counters_now()
    rows = [("pre-forward hooks noting gathered params", note_walking, note_now),
            ("unmanaged-param check after backward", check_walking, check_now),
            ("module counters after forward", counters_walking, counters_now)]
    samples = {}
    for _ in range(rounds):
        for name, before, now in rows:
            for tag, fn in (("walking", before), ("now", now)):
                samples.setdefault((name, tag), []).append(timeit.timeit(fn, number=200) / 200)
    print(f"2. per-step walks, {len(modules)} modules ({len(hooks)} own params), median of {rounds} rounds")
    total_before = total_now = 0.0
    for name, _, _ in rows:
        before = statistics.median(samples[(name, "walking")])
        now = statistics.median(samples[(name, "now")])
        total_before, total_now = total_before + before, total_now + now
        print(f"   {name:42s} {before * 1e6:6.1f} us -> {now * 1e6:6.1f} us")
    print(f"   {'per step':42s} {total_before * 1e6:6.1f} us -> {total_now * 1e6:6.1f} us")
    engine.destroy()


def hooks_in_steps(steps: int):
    import torch

    import zero_lifetime
    from zero_lifetime import zero3_lifetime
    from zero_lifetime.bench.engines import TinyTransformer, make_engine, quiet_deepspeed
    from zero_lifetime.bench.step import single_backward_step

    quiet_deepspeed()
    spent = [0, 0]
    make_hook = zero3_lifetime.Zero3Lifetime._note_gathered_hook

    def timed_hook(self, params):
        hook = make_hook(self, params)

        def timed(module, inputs):
            start = time.perf_counter_ns()
            hook(module, inputs)
            spent[0] += time.perf_counter_ns() - start
            spent[1] += 1

        return timed

    zero3_lifetime.Zero3Lifetime._note_gathered_hook = timed_hook
    try:
        engine = make_engine(TinyTransformer(4, 32), 3)
        zero_lifetime.install(engine)
    finally:
        zero3_lifetime.Zero3Lifetime._note_gathered_hook = make_hook
    tokens = torch.randint(0, 512, (8, 8))
    for _ in range(5):
        single_backward_step(engine, tokens)
    spent[:] = [0, 0]
    start = time.perf_counter()
    for _ in range(steps):
        single_backward_step(engine, tokens)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    print(f"3. pre-forward hooks inside {steps} real steps (step {step_ms:.1f} ms): "
          f"{spent[0] / steps / 1e3:.1f} us per step, {spent[1] // steps} calls, "
          f"{spent[0] / max(spent[1], 1) / 1e3:.2f} us per call")
    engine.destroy()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args()
    from zero_lifetime.single_rank import single_rank_env
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    single_rank_env()
    import torch
    torch.set_num_threads(1)
    saved_hook_rows(args.rounds)
    walk_rows(max(3, args.rounds // 20))
    hooks_in_steps(max(20, args.rounds))


if __name__ == "__main__":
    main()
