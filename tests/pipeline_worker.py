"""Rank process for tests/test_pipeline.py: DeepSpeed's PipelineEngine with ZeRO-1, 2 ranks.

A ``PipelineModule`` of five layers trains three batches of two micro-batches through
``train_batch``: split over two pipeline stages (one per rank; activations and their gradients
go rank to rank, and the backward runs through ``torch.autograd.backward`` inside the
pipeline's schedule, not ``engine.backward``), or as one stage data-parallel over both ranks.
The oracle is plain torch in one process: the same layers, each micro-batch's loss divided by
the micro-batch count. Every rank compares the params it holds.

Models: ``plain`` (five layers); ``tied``, one ``TiedLayerSpec`` layer used first and last (on
two stages each stage holds a copy, and the pipeline all-reduces the copies' gradients between
the stages before the step; the oracle uses one module twice); ``tied-checkpointed``, the same
with every layer's activations recomputed in backward (``activation_checkpoint_interval`` 1).
"""

import two_rank_worker as base

WORLD = base.WORLD
STEPS = 3
MICRO_BATCHES = 2
LR = 0.1

MODELS = ("plain", "tied", "tied-checkpointed")
# DeepSpeed 0.17.6/0.18.9's activation checkpointing asks the accelerator for a Stream, which
# the CPU accelerator lacks: the forward raises, stock and installed alike. Only the one-stage
# runs show it there: a stage that raises leaves the other stage waiting on its send.
CHECKPOINTING_NEEDS_A_STREAM = base.deepspeed_release() in ("0.17.6", "0.18.9")
SCENARIOS = [dict(id=f"{'installed' if install else 'stock'}-{model}-stages{stages}", model=model, stages=stages,
                  install=install)
             for model in MODELS for stages in (2, 1) for install in (True, False)
             if not (model == "tied-checkpointed" and stages == 2 and CHECKPOINTING_NEEDS_A_STREAM)]
TIED_ATTRS = ["weight", "bias"]


def _seeded_linear_class():
    """A Linear whose initial values do not depend on the RNG state when the pipeline builds it
    (each stage builds its own copy of a tied layer; TiedLayerSpec wants a class)."""
    import torch

    class SeededLinear(torch.nn.Linear):

        def __init__(self, seed, n_in, n_out):
            super().__init__(n_in, n_out)
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    return SeededLinear


def _layers(model):
    """(pipeline layers, oracle layers): the same modules, a tied layer's spec replaced by one
    shared module in the oracle."""
    import torch
    from deepspeed.pipe import TiedLayerSpec
    torch.manual_seed(0)
    if model == "plain":
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                  torch.nn.Linear(16, 4)]
        return layers, layers
    middle = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.Tanh()]
    seeded_linear = _seeded_linear_class()
    tied = seeded_linear(7, 8, 8)
    spec = TiedLayerSpec("tied", seeded_linear, 7, 8, 8, tied_weight_attr=TIED_ATTRS)
    return [spec, *middle, spec], [tied, *middle, tied]


def param_names(model):
    """The names under which the pipeline module holds the model's params, on some stage."""
    _, oracle_layers = _layers(model)
    return sorted(_oracle_names(model, oracle_layers))


def _oracle_names(model, layers):
    """Pipeline param name -> the oracle param: layer index, or the tied module's key."""
    names = {}
    for index, layer in enumerate(layers):
        prefix = "tied_modules.tied" if model != "plain" and index in (0, len(layers) - 1) else str(index)
        for name, p in layer.named_parameters():
            names[f"{prefix}.{name}"] = p
    return names


def _micro_batches(model):
    import torch
    g = torch.Generator().manual_seed(0)
    out_features = 4 if model == "plain" else 8
    return [(torch.randn(4, 8, generator=g), torch.randn(4, out_features, generator=g))
            for _ in range(STEPS * MICRO_BATCHES)]


def _oracle_params(model):
    import torch
    _, layers = _layers(model)
    net = torch.nn.Sequential(*layers)  # a tied module listed twice is applied twice
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    batches = _micro_batches(model)
    for step in range(STEPS):
        for x, y in batches[step * MICRO_BATCHES:(step + 1) * MICRO_BATCHES]:
            (torch.nn.functional.mse_loss(net(x), y) / MICRO_BATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in _oracle_names(model, layers).items()}


def _run(sc, rank):
    import deepspeed
    import torch
    import zero_lifetime
    from deepspeed.pipe import PipelineModule
    from zero_lifetime.adapters import UnsupportedDeepSpeedError

    layers, _ = _layers(sc["model"])
    module = PipelineModule(layers=layers, num_stages=sc["stages"], loss_fn=torch.nn.MSELoss(),
                            partition_method="uniform",
                            activation_checkpoint_interval=1 if sc["model"] == "tied-checkpointed" else 0)
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
    batches = _micro_batches(sc["model"])
    if sc["stages"] == 1:  # data parallel: each rank half of every micro-batch
        batches = [(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]) for x, y in batches]
    data = iter(batches)
    forward_calls = []  # how often this rank's Linear layers ran: twice per micro-batch when checkpointed
    hooks = [layer.register_forward_hook(lambda *_: forward_calls.append(1))
             for layer in engine.module.modules() if isinstance(layer, torch.nn.Linear)]
    for _ in range(STEPS):
        engine.train_batch(data_iter=data)
    for hook in hooks:
        hook.remove()
    want = _oracle_params(sc["model"])
    linear_uses = sum(isinstance(layer, torch.nn.Linear) for layer in engine.module.forward_funcs)
    record = {"engine": type(engine).__name__, "refused": None,
              "forwards_per_linear_use": len(forward_calls) / (linear_uses * STEPS * MICRO_BATCHES),
              "weights": {name: p.detach().flatten().tolist() for name, p in engine.module.named_parameters()},
              "abs_diff": {name: (p.detach() - want[name]).abs().max().item()
                           for name, p in engine.module.named_parameters()}}
    return base.end_engine(engine, record, sc["install"])


def main(rank, out_dir, port):
    """torch.multiprocessing entry point: this rank runs every scenario."""
    base.run_rank(rank, out_dir, port, SCENARIOS, _run)
