"""Rank process for tests/test_pipeline.py: DeepSpeed's PipelineEngine with ZeRO-1, 2 ranks.

A ``PipelineModule`` of five layers trains three batches of two micro-batches through
``train_batch``: split over two pipeline stages (one per rank; activations and their gradients
go rank to rank, and the backward runs through ``torch.autograd.backward`` inside the
pipeline's schedule, not ``engine.backward``), or as one stage data-parallel over both ranks.
The oracle is plain torch in one process: the same layers, each micro-batch's loss divided by
the micro-batch count. Every rank compares the params it holds.
"""

import two_rank_worker as base

WORLD = base.WORLD
STEPS = 3
MICRO_BATCHES = 2
LR = 0.1

SCENARIOS = [dict(id=f"{'installed' if install else 'stock'}-stages{stages}", stages=stages, install=install)
             for stages in (2, 1) for install in (True, False)]


def _layers():
    import torch
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)]


def _micro_batches():
    import torch
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(STEPS * MICRO_BATCHES)]


def _oracle_params():
    import torch
    model = torch.nn.Sequential(*_layers())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = _micro_batches()
    for step in range(STEPS):
        for x, y in batches[step * MICRO_BATCHES:(step + 1) * MICRO_BATCHES]:
            (torch.nn.functional.mse_loss(model(x), y) / MICRO_BATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {f"{index}.{name}": p.detach() for index, layer in enumerate(model) for name, p in layer.named_parameters()}


def _run(sc, rank):
    import deepspeed
    import torch
    import zero_lifetime
    from deepspeed.pipe import PipelineModule
    from zero_lifetime.adapters import UnsupportedDeepSpeedError

    module = PipelineModule(layers=_layers(), num_stages=sc["stages"], loss_fn=torch.nn.MSELoss(),
                            partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 4 if sc["stages"] == 2 else 2,
              "gradient_accumulation_steps": MICRO_BATCHES, "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=list(module.parameters()))
    if sc["install"]:
        try:
            zero_lifetime.install(engine)
        except UnsupportedDeepSpeedError as refused:  # DeepSpeed 0.17.6, several stages
            engine.destroy()
            return {"engine": type(engine).__name__, "refused": str(refused)}
    batches = _micro_batches()
    if sc["stages"] == 1:  # data parallel: each rank half of every micro-batch
        batches = [(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]) for x, y in batches]
    data = iter(batches)
    for _ in range(STEPS):
        engine.train_batch(data_iter=data)
    want = _oracle_params()
    record = {"engine": type(engine).__name__, "refused": None,
              "weights": {name: p.detach().flatten().tolist() for name, p in engine.module.named_parameters()},
              "abs_diff": {name: (p.detach() - want[name]).abs().max().item()
                           for name, p in engine.module.named_parameters()}}
    if sc["install"]:
        record["filled_grads"] = zero_lifetime.stats(engine)["filled_grads"]
        zero_lifetime.uninstall(engine)
    engine.destroy()
    return record


def main(rank, out_dir, port):
    """torch.multiprocessing entry point: this rank runs every scenario."""
    base.run_rank(rank, out_dir, port, SCENARIOS, _run)
