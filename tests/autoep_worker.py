"""Rank process for tests/test_autoep.py: DeepSpeed's AutoEP (automatic expert parallelism,
0.19+) on ZeRO-2 and ZeRO-3, 2 ranks.

A model of two Mixtral-style sparse blocks (a softmax router, top-2 of 4 experts, the weights
renormalised, SwiGLU experts stored as fused 3-D tensors) and a head. AutoEP replaces each block
with its ``AutoEPMoELayer``: the router becomes ``router.gate``, the fused ``gate_up_proj`` splits
into ``w1``/``w3`` and ``down_proj`` becomes ``w2``. With ``ep`` 2 each rank holds two of the
four experts, tokens reach them through all-to-all, and an expert param is reduced and, on
ZeRO-3, partitioned over its own expert-data-parallel group, not over all ranks; with ``ep`` 1
every rank holds all four.

The oracle is the original model in plain torch in one process: each step the mean over the
ranks of each rank's two losses on its own batch. Every rank compares its params (its own
experts under ``ep`` 2) with the oracle's, mapped through AutoEP's layout.
"""

import two_rank_worker as base

WORLD = base.WORLD
STEPS = 3
LR = 0.1
HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 8, 16, 4, 2, 6


def _scenario(stage, ep, install=True, backwards="two", policy="regather", gas=1):
    """``backwards``: "two" (first loss retained, then the second) or "summed" (one backward of
    their sum: the stock check that the oracle and its mapping agree with DeepSpeed). ``gas``:
    micro-batches per step (gradient accumulation)."""
    kind = "installed" if install else "stock"
    sid = (f"{kind}-autoep-stage{stage}-ep{ep}-{backwards}" + (f"-{policy}" if install and stage == 3 else "")
           + (f"-gas{gas}" if gas > 1 else ""))
    return dict(id=sid, stage=stage, ep=ep, install=install, backwards=backwards, policy=policy, gas=gas)


SCENARIOS = [_scenario(stage, ep) for stage in (3, 2) for ep in (2, 1)] + [
    _scenario(3, 2, policy="pin"),
    _scenario(3, 2, gas=2),
    _scenario(2, 2, gas=2),
    _scenario(3, 2, install=False, backwards="summed", gas=2),
    _scenario(3, 2, install=False, backwards="summed"),
    _scenario(3, 1, install=False, backwards="summed"),
    _scenario(2, 2, install=False, backwards="summed"),
    # What install fixes: ZeRO-3 released the gathered params after the first backward.
    _scenario(3, 2, install=False),
]

AUTOEP_CONFIG = {"enabled": True, "moe_layer_pattern": r"model\.layers\.\d+\.mlp", "router_pattern": "gate",
                 "expert_pattern": "experts", "expert_w1": "gate_up_proj", "expert_w2": "down_proj",
                 "num_experts_attr": "num_local_experts", "top_k_attr": "num_experts_per_tok",
                 "score_func": "softmax", "route_norm": True, "use_grouped_mm": False}


# Every param released right after its module (none persistent, none kept for reuse): the
# retained graph outlives every gather, so the second backward needs each param again.
ZERO3_EAGER_RELEASE = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                       "stage3_prefetch_bucket_size": 0}


def _model():
    import types

    import torch
    import torch.nn.functional as F

    class Experts(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN) * 0.3)
            self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.3)

    class SparseBlock(torch.nn.Module):  # Mixtral's sparse MoE block, in plain torch

        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
            self.experts = Experts()

        def forward(self, x):
            tokens = x.reshape(-1, HIDDEN)
            weights, chosen = F.softmax(self.gate(tokens), dim=-1).topk(TOP_K, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            out = torch.zeros_like(tokens)
            for e in range(EXPERTS):
                gate, up = F.linear(tokens, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
                expert_out = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
                out = out + (weights * (chosen == e)).sum(-1, keepdim=True) * expert_out
            return out.reshape(x.shape)

    class Layer(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.mlp = SparseBlock()

    class MoEModel(torch.nn.Module):

        def __init__(self):
            super().__init__()
            # What AutoEP reads for the expert count and top-k.
            self.config = types.SimpleNamespace(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([Layer(), Layer()])
            self.head = torch.nn.Linear(HIDDEN, 3)

        def forward(self, x):
            for layer in self.model.layers:
                x = x + layer.mlp(x)
            return self.head(x)

    torch.manual_seed(0)
    return MoEModel()


def _losses(out):
    import torch
    return out.pow(2).mean(), (out * torch.linspace(-1, 1, out.shape[-1])).sum() / out.shape[0]


def _batch(micro_batch, rank):
    import torch
    return torch.randn(2, TOKENS // 2, HIDDEN, generator=torch.Generator().manual_seed(100 * micro_batch + rank))


def _oracle_weights(gas):
    import torch
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        micro_batches = range(step * gas, (step + 1) * gas)
        total = sum(sum(_losses(model(_batch(m, rank)))) for m in micro_batches for rank in range(WORLD))
        (total / (WORLD * gas)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return dict(model.named_parameters())


def _oracle_of(name, want, local_experts):
    """The oracle's tensor for one AutoEP param: its slice of the fused experts."""
    block, _, leaf = name.rpartition(".experts.")
    if not block:
        return want[name.replace(".mlp.router.gate.", ".mlp.gate.")].detach()
    gate_up, down = want[f"{block}.experts.gate_up_proj"], want[f"{block}.experts.down_proj"]
    full = {"w1": gate_up[:, :FFN], "w3": gate_up[:, FFN:], "w2": down}[leaf]
    return full[list(local_experts[block])].detach()


def _params(engine):
    """Each param's full value on this rank (gathered on ZeRO-3)."""
    import contextlib

    import deepspeed
    params = list(engine.module.parameters())
    gathered = deepspeed.zero.GatheredParameters(params) if hasattr(params[0], "ds_id") else contextlib.nullcontext()
    with gathered:
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def _run(sc, rank):
    import deepspeed
    import zero_lifetime
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank
    from harness import backward_separately_or_summed

    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": sc["gas"],
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": dict(ZERO3_EAGER_RELEASE if sc["stage"] == 3 else {}, stage=sc["stage"]),
              "expert_parallel": dict(AUTOEP_CONFIG, autoep_size=sc["ep"])}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    blocks = {f"model.layers.{i}.mlp": layer.mlp for i, layer in enumerate(engine.module.model.layers)}
    assert all(type(block).__name__ == "AutoEPMoELayer" for block in blocks.values()), blocks
    local_experts = {name: autoep_experts_for_rank(block.expert_placement_descriptor, block.ep_rank)
                     for name, block in blocks.items()}
    if sc["install"]:
        zero_lifetime.install(engine, policy=sc["policy"] if sc["stage"] == 3 else None)
    for micro_batch in range(STEPS * sc["gas"]):  # engine.step() steps at each gas-th call
        backward_separately_or_summed(engine, *_losses(engine(_batch(micro_batch, rank))),
                                      separately=sc["backwards"] != "summed")
        engine.step()
    want = _oracle_weights(sc["gas"])
    got = _params(engine)
    record = {"abs_diff": {name: (p - _oracle_of(name, want, local_experts)).abs().max().item()
                           for name, p in got.items()},
              "local_experts": {name: list(experts) for name, experts in local_experts.items()},
              "expert_params": [name for name, p in engine.module.named_parameters()
                                if getattr(p, "ds_zero_placement_family", None) == "autoep_expert"]}
    return base.end_engine(engine, record, sc["install"])


def main(rank, out_dir, port):
    """torch.multiprocessing entry point: this rank runs every scenario."""
    base.run_rank(rank, out_dir, port, SCENARIOS, _run)
