"""What the fused all-gather copy-out saves a frozen ZeRO-3 engine without optimizer (not run in
CI): the figures behind docs/reliability.md, "Frozen engines, continued".

2 gloo ranks (or RANKS), each holding its part of a frozen model of many small params (BLOCKS
blocks of Linear WIDTHxWIDTH and LayerNorm: 4 params a block) in two ZeRO-3 engines built
without an optimizer over identical models, one installed (its all-gathers copied out by one
fused ``gather_copy_out`` each), one stock (one ``torch.cat`` per param). Timed, alternating
which engine every round: a scoring forward under ``torch.no_grad()`` (how TRL scores samples
with reward and reference models), and a forward of ``engine.module`` plus one backward into
its input (a differentiable reward; stock ``engine(x)`` raises at that backward on
0.18.9/0.19.8). Each rank runs one thread. Rank 0 prints the medians and installed/stock
ratios. On 1 rank nothing is gathered: what is left is the installation's per-module cost.
Measured 2026-12-07 on the 2-vCPU EPYC VM: no gain from the fused copy-out on 2 ranks (a
scoring forward, 170-230 ms against ~35 ms on 1 rank, waits on gloo's 128 all-gathers, not on
the copies); installed/stock 0.96-1.04 scoring, 1.06-1.12 with the backward, and on 1 rank
1.05-1.06 and 1.06-1.09 (the installation's per-module hooks, which modules this small
magnify; docs/reliability.md; trimmed at stop 70, ``per_module_hooks.py``).

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.frozen_engine_gathers [ROUNDS [RANKS]]
"""
import os
import statistics
import sys
import time
import warnings

import torch
import torch.multiprocessing as mp

WIDTH, BLOCKS, BATCH, ROUNDS = 64, 64, 8, 30
PORT = int(os.environ.get("MASTER_PORT", "29636"))


def _frozen_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH)]
    return torch.nn.Sequential(*layers).requires_grad_(False)


def _engine(model):
    import deepspeed
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": BATCH,
                                                           "zero_optimization": zero})
    return engine


def _score(engine, x):
    with torch.no_grad():
        engine(x)


def _differentiable(engine, x):
    # engine.module: stock engine(x) raises at the backward on 0.18.9 and 0.19.8 (no optimizer)
    x = x.clone().requires_grad_()
    engine.module(x).sum().backward()


def _rank(rank, rounds, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import logging

    import deepspeed
    import zero_lifetime
    deepspeed.init_distributed("gloo")
    torch.set_num_threads(1)  # one core per rank: two ranks on this 2-core VM would fight for both
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's deprecated collective names
    engines = {"stock": _engine(_frozen_model()), "installed": _engine(_frozen_model())}
    zero_lifetime.install(engines["installed"])
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    samples = {(work.__name__, name): [] for work in (_score, _differentiable) for name in engines}
    for round_ in range(rounds + 2):  # the first two rounds warm up
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for work in (_score, _differentiable):
            for name in order:
                start = time.perf_counter()
                work(engines[name], x)
                if round_ >= 2:
                    samples[(work.__name__, name)].append(time.perf_counter() - start)
    stats = zero_lifetime.stats(engines["installed"])
    if rank == 0:
        params = sum(1 for _ in engines["stock"].module.parameters())
        print(f"{world} gloo ranks, {params} frozen params ({BLOCKS} x Linear {WIDTH}x{WIDTH} + LayerNorm), "
              f"batch {BATCH}, {rounds} rounds; installed: {stats['fused_gathers']} fused gathers, "
              f"{stats['stock_gathers']} stock")
        for work in ("_score", "_differentiable"):
            stock, ours = (statistics.median(samples[(work, name)]) for name in ("stock", "installed"))
            print(f"{work.lstrip('_'):>15}: stock {stock * 1e3:7.2f} ms, installed {ours * 1e3:7.2f} ms, "
                  f"installed/stock {ours / stock:.3f}")


def main(rounds: int = ROUNDS, ranks: int = 2) -> None:
    mp.spawn(_rank, args=(rounds, ranks), nprocs=ranks)


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:3]))
