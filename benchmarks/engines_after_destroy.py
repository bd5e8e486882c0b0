"""What a process keeps of ZeRO-3 engines after ``engine.destroy()``, stock next to installed.

    python3 -m benchmarks.engines_after_destroy [--engines 4]

Builds engines one after another in one process, as a hyperparameter search does (the
bench's 4-layer transformer, 1 rank, CPU): first the stock ones, then the installed ones. Each
trains three single-backward steps, is destroyed and dropped. After each kind, with
``gc.collect()``: how many of its models are still alive, the bytes of their param partitions,
and how many bytes of tensor storage the process holds more than before that kind's first
engine (the partitions are views of DeepSpeed's flat buffers, which stay with them; on a GPU
this is device memory).
"""

import argparse
import gc
import weakref

import torch

from zero_lifetime.bench.engines import TinyTransformer, make_engine, prepare_process, quiet_deepspeed

MiB = 2 ** 20


def train_and_destroy(model, tokens, installed):
    """Weak references to the engine's model and its params, once the engine is destroyed."""
    import zero_lifetime
    from zero_lifetime.bench.step import single_backward_step
    engine = make_engine(model, 3)
    if installed:
        zero_lifetime.install(engine)
    for _ in range(3):
        single_backward_step(engine, tokens)
    module = weakref.ref(engine.module)
    params = [weakref.ref(p) for p in engine.module.parameters()]
    engine.destroy()
    return module, params


def live_storage_bytes() -> int:
    """Bytes of the distinct tensor storages the garbage collector tracks."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def partition_bytes(params) -> int:
    alive = [p() for p in params]
    return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in alive if p is not None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=4, help="engines of each kind")
    args = parser.parse_args()
    prepare_process("cpu")
    quiet_deepspeed()
    import deepspeed
    torch.manual_seed(0)
    model = TinyTransformer(layers=4, width=256)
    tokens = torch.randint(0, 512, (8, 64))
    train_and_destroy(model, tokens, installed=True)  # warm-up: DeepSpeed's one-time state
    rows = []
    for installed in (False, True):  # stock first: installed destroys would clear its cache entries
        gc.collect()
        before = live_storage_bytes()
        kept = [train_and_destroy(model, tokens, installed) for _ in range(args.engines)]
        gc.collect()
        alive = [params for module, params in kept if module() is not None]
        rows.append(("installed" if installed else "stock", len(kept), len(alive),
                     sum(partition_bytes(params) for params in alive), live_storage_bytes() - before))
    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, 1 rank, CPU; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
          f"({sum(p.numel() * p.element_size() for p in model.parameters()) / MiB:.2f} MiB) per model")
    print(f"{'engines':<10} {'built and destroyed':>20} {'models alive':>13} {'their partitions':>17} "
          f"{'storage held since':>19}")
    for name, built, alive, partitions, held in rows:
        print(f"{name:<10} {built:>20} {alive:>13} {partitions / MiB:>13.2f} MiB {held / MiB:>15.2f} MiB")


if __name__ == "__main__":
    main()
