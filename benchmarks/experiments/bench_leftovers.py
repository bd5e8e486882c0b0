"""What a `python -m zero_lifetime.bench` run leaves alive in its process (not run in CI): the
figures behind docs/benchmarks.md, "The engines a bench run leaves alive".

Runs one sub-command in this process, as `python -m zero_lifetime.bench` would, then collects
garbage and counts the DeepSpeed engines still alive and the bytes of the tensor storages
still reachable from Python. Each bench case discards its engines when it ends; DeepSpeed
keeps every destroyed ZeRO-3 engine alive unless it is released after its ``destroy()``.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.bench_leftovers all [bench options]
"""
import gc
import sys
import warnings


def main(argv) -> None:
    from zero_lifetime.bench.cli import main as bench_main
    bench_main(argv)
    gc.collect()
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    with warnings.catch_warnings():  # isinstance on torch's deprecated reduce_op object warns
        warnings.simplefilter("ignore", FutureWarning)
        engines, tensors = [], []
        for obj in gc.get_objects():  # one pass: the run leaves hundreds of thousands
            if isinstance(obj, DeepSpeedEngine):
                engines.append(obj)
            elif isinstance(obj, torch.Tensor):
                tensors.append(obj)
    stages = sorted(int(engine.zero_optimization_stage()) for engine in engines)
    storages = {}
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage of its own (sparse, wrappers)
            continue
        if storage.data_ptr():
            storages[storage.data_ptr()] = storage.nbytes()
    print(f"engines alive after the run: {len(stages)} (ZeRO stages {stages}); tensor storage still "
          f"reachable: {sum(storages.values()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
