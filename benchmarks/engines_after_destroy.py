"""What a process keeps of ZeRO-3 engines after ``engine.destroy()``, stock next to installed.

    python3 -m benchmarks.engines_after_destroy [--engines 4]

Builds engines one after another in one process, as a hyperparameter search does (the
bench's 4-layer transformer, 1 rank, CPU), alternating stock and installed; each trains three
single-backward steps, is destroyed and dropped. Then, after ``gc.collect()``: how many of
each kind are still alive, and the bytes of their param partitions (what ZeRO-3 keeps of the
weights: on a GPU, device memory).
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
    engine = make_engine(model, 3)
    if installed:
        zero_lifetime.install(engine)
    for _ in range(3):
        engine.backward(engine(tokens).pow(2).mean())
        engine.step()
    module = weakref.ref(engine.module)
    params = [weakref.ref(p) for p in engine.module.parameters()]
    engine.destroy()
    return module, params


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
    kept = {False: [], True: []}
    for _ in range(args.engines):
        for installed in (False, True):
            kept[installed].append(train_and_destroy(model, tokens, installed))
            gc.collect()
    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, 1 rank, CPU; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params per model")
    print(f"{'engines':<10} {'built and destroyed':>20} {'models alive':>13} {'partitions alive':>17}")
    for installed in (False, True):
        alive = [(m, ps) for m, ps in kept[installed] if m() is not None]
        held = sum(partition_bytes(ps) for _, ps in alive)
        print(f"{'installed' if installed else 'stock':<10} {len(kept[installed]):>20} {len(alive):>13} "
              f"{held / MiB:>13.2f} MiB")


if __name__ == "__main__":
    main()
