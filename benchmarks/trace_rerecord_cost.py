"""What stale release decisions after a re-recorded ZeRO-3 trace cost, on 2 gloo ranks.

    python benchmarks/trace_rerecord_cost.py [--runs 2] [--steps 12]

An installed ZeRO-3 engine (the bench's 4-layer transformer, policy regather, DeepSpeed's
default windows) trains one step with a single backward, then steps with two backwards over
one forward. With the release decisions left stale (``ReleaseDecisionsFollowTrace`` disabled
in that process) DeepSpeed reuses the first trace's decisions and the second backward fetches
again what the first released. Per variant, in separate 2-rank runs alternating off / on:
rank 0's median time of a two-backward step (after the new trace is complete) and the
params all-gathered per step.
"""

import argparse
import statistics
import time

from zero_lifetime.bench.rank_launch import run_worker, worker_main


def _work(spec):
    import torch

    import zero_lifetime
    from zero_lifetime.adapters.zero3_trace import ReleaseDecisionsFollowTrace
    from zero_lifetime.bench.engines import TinyTransformer, make_engine, quiet_deepspeed
    from zero_lifetime.bench.step import count_param_fetches, retained_step, single_backward_step
    quiet_deepspeed()
    if not spec["clear"]:
        ReleaseDecisionsFollowTrace._before_forward = lambda self, module, inputs: None
    torch.manual_seed(0)
    engine = make_engine(TinyTransformer(4, 256), 3)
    zero_lifetime.install(engine)
    fetched = count_param_fetches(engine)
    tokens = torch.randint(0, 512, (8, 64))
    times, fetches = [], []
    for step in range(3 + spec["steps"]):
        before, start = fetched[0], time.perf_counter()
        (single_backward_step if step == 0 else retained_step)(engine, tokens)
        if step >= 3:  # step 1 invalidates the first trace, step 2 records the new one
            times.append(time.perf_counter() - start)
            fetches.append(fetched[0] - before)
    return [{"median_ms": 1e3 * statistics.median(times), "fetches": statistics.median(fetches),
             "traces_recorded": zero_lifetime.stats(engine)["traces_recorded"]}]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    rows = {False: [], True: []}
    for _ in range(args.runs):
        for clear in (False, True):
            spec = {"clear": clear, "steps": args.steps}
            rows[clear].append(run_worker("benchmarks.trace_rerecord_cost", spec, 2, "cpu", 900, "trace")[0])
    for clear, runs in rows.items():
        label = "decisions follow the trace" if clear else "stale decisions (DeepSpeed)"
        print(f"{label:28s}: two-backward step " + ", ".join(f"{r['median_ms']:.1f} ms" for r in runs)
              + f"; params all-gathered a step {runs[0]['fetches']:.0f}; traces recorded {runs[0]['traces_recorded']}")


if __name__ == "__main__":
    worker_main(_work) if "--worker" in __import__("sys").argv else main()
