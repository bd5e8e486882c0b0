"""The figures behind docs/reliability.md's "CI time" section: how often DeepSpeed collects
garbage while it builds an engine, and what one collection costs before and after gc.freeze().
Not collected by pytest; run with the Python of the release to probe:

    DS_ACCELERATOR=cpu python3 tests/probe_engine_gc.py                  # 0.19.8
    DS_ACCELERATOR=cpu .venv-ds0176/bin/python tests/probe_engine_gc.py  # 0.17.6 (or .venv-ds0189)
"""

import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zero_lifetime.single_rank as single_rank  # noqa: E402

single_rank.single_rank_env()

import deepspeed  # noqa: E402

from harness import make_pair  # noqa: E402


def main():
    collect, calls = gc.collect, [0]

    def counting_collect(*args, **kwargs):
        calls[0] += 1
        return collect(*args, **kwargs)

    make_pair("mlp_norm", 1)  # the first engine builds or loads DeepSpeed's CPU comm op
    gc.collect = counting_collect
    for stage in (1, 2, 3):
        calls[0] = 0
        started = time.perf_counter()
        make_pair("mlp_norm", stage)
        print(f"DeepSpeed {deepspeed.__version__}, ZeRO-{stage} engine: {calls[0]} gc.collect() calls, "
              f"built in {time.perf_counter() - started:.2f} s")
    gc.collect = collect
    tracked = len(gc.get_objects())
    started = time.perf_counter()
    gc.collect()
    before = time.perf_counter() - started
    gc.freeze()
    started = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - started
    print(f"tracked objects {tracked}; one gc.collect() {before * 1e3:.1f} ms, after gc.freeze() {after * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
