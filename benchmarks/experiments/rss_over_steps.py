"""Resident memory and the objects gc tracks over a long one-rank ZeRO-3 run, stock against
installed (not run in CI): the figures behind docs/reliability.md, "Nothing kept per step".

The soak's RSS grows a few MiB over 300 steps (docs/reliability.md, "Soak"). This samples RSS
and the number of objects gc tracks every 200 micro-batches of the soak's model (MLPNorm,
GAS 2, every param partitioned), for a stock engine (single backwards: stock cannot run a
second one over a ZeRO-3 graph), an installed one on single backwards, and an installed one
cycling single / two over a retained graph / a retained graph dropped. A leak grows without
end; warm-up of the allocator levels off, and stock shares it.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.rss_over_steps [MICRO_BATCHES [RUN]]
"""
import gc
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
import conftest  # noqa: E402,F401  (one gloo rank on the CPU, as the tests run)

RUNS = (("stock", ("single", )), ("installed", ("single", )), ("installed", ("single", "two", "dropped")))
SAMPLE_EVERY = 200
RESULT = "rss_over_steps result: "  # the child's last line; DeepSpeed prints on stdout too


def run(installed: bool, kinds, micro_batches: int):
    import zero_lifetime
    from harness import engine_micro_batch, make_input, make_pair
    from soak_worker import rss_bytes
    engine, _, _ = make_pair("mlp_norm", 3, gas=2)
    if installed:
        zero_lifetime.install(engine, policy="pin")
    samples = []
    for i in range(micro_batches):
        engine_micro_batch(engine, kinds[i % len(kinds)], make_input("mlp_norm", seed=i))
        if i % SAMPLE_EVERY == 0:
            gc.collect()
            samples.append((i, rss_bytes() / 2**20, len(gc.get_objects())))
    return samples  # the child process exits: nothing to tear down


def main(micro_batches: int = 2001, only=None) -> None:
    """Each run in a process of its own: a run after another would find the allocator warm."""
    if only is not None:
        mode, kinds = RUNS[only]
        print(RESULT + json.dumps(run(mode == "installed", kinds, micro_batches)))
        return
    for index, (mode, kinds) in enumerate(RUNS):
        child = subprocess.run([sys.executable, "-m", "benchmarks.experiments.rss_over_steps", str(micro_batches),
                                str(index)], check=True, capture_output=True, text=True)
        samples = json.loads(child.stdout.split(RESULT)[-1])
        _, rss0, objects0 = samples[0]
        print(f"{mode} {'/'.join(kinds)}:")
        print("  micro-batch " + " ".join(f"{i:6d}" for i, _, _ in samples))
        print("  RSS MiB +   " + " ".join(f"{rss - rss0:6.1f}" for _, rss, _ in samples))
        print("  objects +   " + " ".join(f"{n - objects0:6d}" for _, _, n in samples))


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3]))
