"""What the installation's per-module hooks cost, now and as they were up to stop 69 (not run in
CI): the figures behind docs/reliability.md, "Per-module hooks: cheaper outside compilation
and under no_grad".

1 gloo rank (nothing is gathered: what is left is per-module work), the model of many small
modules of ``frozen_engine_gathers`` (64 blocks of Linear 64x64 and LayerNorm, 129 modules),
ZeRO-3. Three engines over identical models in one process: stock, installed, and installed as
up to stop 69. The last is rebuilt here by two patches held during its install() only: every
module that wraps a hook in ``never_traced`` gets ``torch.compiler.disable`` instead (a frame
switch at every call), and ``torch.is_grad_enabled`` reads True, which the tracker's per-module
note captures at install, so it notes the params under no_grad too. Timed, rotating the engines'
order every round: a scoring forward under ``torch.no_grad()`` and a forward of
``engine.module`` plus one backward into its input, on engines without optimizer (a frozen
reward); and a training step (``engine(x)``, ``engine.backward``, ``engine.step()``) on engines
with one. Prints medians and each installed engine's ratio to stock.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.per_module_hooks [ROUNDS]
"""
import contextlib
import importlib
import os
import statistics
import sys
import time
import warnings

import torch

from .frozen_engine_gathers import BATCH, BLOCKS, WIDTH, _differentiable, _engine, _frozen_model, _score

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29637"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")

ROUNDS = 100
ENGINES = ("stock", "installed", "as_before")


def _trained_engine():
    import deepspeed
    model = _frozen_model().requires_grad_(True)
    config = {"train_micro_batch_size_per_gpu": BATCH,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


@contextlib.contextmanager
def _hooks_as_before():
    # zero_lifetime.install is also the function's name: the modules are looked up by path.
    users = [importlib.import_module(f"zero_lifetime.{name}") for name in (
        "adapters.zero3_trace", "frozen_engine", "hooks_after_deepspeed", "install", "selective_checkpoint",
        "zero3_bypassing_forward", "zero3_lifetime")]
    saved = [(module, module.never_traced) for module in users]
    grad_enabled = torch.is_grad_enabled
    try:
        for module in users:
            module.never_traced = torch.compiler.disable
        torch.is_grad_enabled = lambda: True
        yield
    finally:
        torch.is_grad_enabled = grad_enabled
        for module, original in saved:
            module.never_traced = original


def _install(engines):
    import zero_lifetime
    zero_lifetime.install(engines["installed"])
    with _hooks_as_before():
        zero_lifetime.install(engines["as_before"])


def _train(engine, x):
    engine.backward(engine(x).square().mean())
    engine.step()


def main(rounds: int = ROUNDS) -> None:
    import logging

    import deepspeed
    deepspeed.init_distributed("gloo")
    torch.set_num_threads(1)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    frozen = {name: _engine(_frozen_model()) for name in ENGINES}
    trained = {name: _trained_engine() for name in ENGINES}
    _install(frozen)
    _install(trained)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0))
    works = ((_score, frozen), (_differentiable, frozen), (_train, trained))
    samples = {(work.__name__, name): [] for work, _ in works for name in ENGINES}
    for round_ in range(rounds + 2):  # the first two rounds warm up
        order = ENGINES[round_ % 3:] + ENGINES[:round_ % 3]
        for work, engines in works:
            for name in order:
                start = time.perf_counter()
                work(engines[name], x)
                if round_ >= 2:
                    samples[(work.__name__, name)].append(time.perf_counter() - start)
    print(f"1 gloo rank, {BLOCKS} x (Linear {WIDTH}x{WIDTH} + LayerNorm), batch {BATCH}, {rounds} rounds")
    for work, _ in works:
        name = work.__name__
        stock, ours, before = (statistics.median(samples[(name, engine)]) for engine in ENGINES)
        print(f"{name.lstrip('_'):>15}: stock {stock * 1e3:7.2f} ms; installed/stock {ours / stock:.3f}, "
              f"as before/stock {before / stock:.3f}")


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:2]))
