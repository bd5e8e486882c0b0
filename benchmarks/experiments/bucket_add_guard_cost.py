"""What the reduced-twice refusal costs each gradient on DeepSpeed's ZeRO-2 bucket path (not run
in CI): the figure behind docs/benchmarks.md, "The ZeRO-2 DeepSpeed-path rows since 2026-12-01".

Since e779af0 (2026-12-01) an installed ZeRO-1/2 engine refuses a param whose finished gradient
DeepSpeed buckets twice in one backward (a block applied twice under reentrant checkpointing
would otherwise be reduced twice): one wrapper around DeepSpeed's bucket add, outside every
other layer. This times `bench bucket`'s DeepSpeed-path case (an installed ZeRO-2 engine,
``ParamBlock(N, 1024)``, DeepSpeed's per-param add then the fused fill) with the wrapper in
place and with the optimizer's add pointed past it, alternating every round, in one process.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.bucket_add_guard_cost [N] [ROUNDS]
"""
import statistics
import sys
import time

from zero_lifetime.bench.engines import prepare_process, quiet_deepspeed


def main(n: int = 8192, rounds: int = 15) -> None:
    prepare_process("cpu")
    quiet_deepspeed()
    from zero_lifetime.bench import ds_paths

    bucket = ds_paths._Zero2Bucket(n, 1024, install=True)
    optimizer = bucket.optimizer
    guarded = optimizer.reduce_independent_p_g_buckets_and_remove_grads
    # wrap_method's partial(around, original): the original is zero_lifetime's reserving add.
    unguarded = guarded.args[0]
    print(f"outer layer: {guarded.func.__qualname__}; inner: {unguarded.__qualname__}")
    times = {"with the refusal": [], "without": []}
    try:
        for _ in range(3 + rounds):
            for name, add in (("with the refusal", guarded), ("without", unguarded)):
                optimizer.reduce_independent_p_g_buckets_and_remove_grads = add
                bucket.reset()
                start = time.perf_counter()
                bucket.fill()
                times[name].append(time.perf_counter() - start)
    finally:
        optimizer.reduce_independent_p_g_buckets_and_remove_grads = guarded
        bucket.close()
    for name, samples in times.items():
        median = statistics.median(samples[3:])
        print(f"{name:17s} {median * 1e3:7.2f} ms  {median / n * 1e6:.2f} us a gradient")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3]))
