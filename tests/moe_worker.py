"""Rank process for tests/test_moe.py: DeepSpeed's native MoE layer on ZeRO-1/2, 2 ranks.

The engine trains a model whose middle is ``deepspeed.moe.layer.MoE`` (2 experts, top-1
gating, no token dropped), with its expert params in their own optimizer groups as DeepSpeed
asks (``split_params_into_different_moe_groups_for_optimizer``). With ``ep`` 2 each rank holds
one expert, tokens reach it through all-to-all, and its gradient must not be averaged with the
other rank's expert: the bucket of an expert param goes to the expert-data-parallel group.

The oracle is plain torch in one process: the same model with both experts (``ep`` 1 holds both
on every rank), each step the mean over the ranks of each rank's losses on its own batch (the
gating's auxiliary loss is per rank's tokens, so not the loss of the joined batch). Every rank
computes it and compares its own params (its expert under ``ep`` 2) with the oracle's.
"""

import two_rank_worker as base

WORLD = base.WORLD
STEPS = 3
LR = 0.1
IN, HIDDEN, OUT, TOKENS = 8, 16, 4, 4


def _scenario(sid, stage, ep, install=True, backwards="two", path="engine"):
    """``backwards``: "two" (l1 retained, then l2, no zero_grad between) or "summed" (one
    backward of l1 + l2, what the two define: the stock oracle's check)."""
    return dict(id=sid, stage=stage, ep=ep, install=install, backwards=backwards, path=path)


SCENARIOS = [_scenario(f"moe-stage{stage}-ep{ep}", stage, ep) for stage in (1, 2) for ep in (1, 2)]
if base._torch_style_backward():  # 0.17.6: zero_lifetime refuses loss.backward()
    SCENARIOS.append(_scenario("moe-stage2-ep2-manual", 2, 2, path="manual"))
SCENARIOS += [
    # Controls: stock gets the summed loss right (the oracle agrees with DeepSpeed) and the two
    # backwards wrong (what install fixes).
    _scenario("stock-moe-stage2-ep1-summed", 2, 1, install=False, backwards="summed"),
    _scenario("stock-moe-stage2-ep2-summed", 2, 2, install=False, backwards="summed"),
    _scenario("stock-moe-stage2-ep2-two", 2, 2, install=False),
]


def _model(ep):
    import torch
    from deepspeed.moe.layer import MoE

    class MoEModel(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(IN, HIDDEN)
            expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
            # Capacity for every token: which tokens a full expert drops would depend on the batch.
            self.moe = MoE(hidden_size=HIDDEN, expert=expert, num_experts=2, ep_size=ep, k=1, capacity_factor=4.0,
                           eval_capacity_factor=4.0, min_capacity=0, use_rts=False, drop_tokens=False)
            self.out = torch.nn.Linear(HIDDEN, OUT)

        def forward(self, x):
            hidden, aux_loss, _ = self.moe(torch.relu(self.inp(x)))
            return self.out(hidden), aux_loss

    torch.manual_seed(0)  # every local expert is a deep copy of `expert`: all start equal
    return MoEModel()


def _losses(out, aux_loss):
    import torch
    return out.pow(2).mean() + 0.01 * aux_loss, (out * torch.linspace(-1, 1, OUT)).sum()


def _batch(step, rank):
    import torch
    return torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(100 * step + rank))


def _oracle_weights(steps):
    import torch
    model = _model(1)  # both experts here; outside an engine ep 1 needs no collective
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        total = sum(sum(_losses(*model(_batch(step, rank)))) for rank in range(WORLD)) / WORLD
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def _oracle_name(name, ep, rank):
    # Under ep 2 this rank's only expert (local index 0) is expert `rank` of the whole layer.
    local = "deepspeed_experts.0."
    return name.replace(local, f"deepspeed_experts.{rank}.") if ep == 2 and local in name else name


def _run(sc, rank):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from harness import backward_both, install_or_let_stock_step

    model = _model(sc["ep"])
    config = {"train_micro_batch_size_per_gpu": TOKENS, "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": sc["stage"]}}
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=groups)
    install_or_let_stock_step(engine, sc["install"])
    for step in range(STEPS):
        first, second = _losses(*engine(_batch(step, rank)))
        if sc["backwards"] == "summed":
            engine.backward(first + second)
        else:  # "engine" or "manual" (loss.backward())
            backward_both(engine, first, second, sc["path"], zero_grad=False)
        engine.step()
    want = _oracle_weights(STEPS)
    record = {"abs_diff": {name: (p.detach() - want[_oracle_name(name, sc["ep"], rank)]).abs().max().item()
                           for name, p in engine.module.named_parameters()},
              "weights": {name: p.detach().flatten().tolist() for name, p in engine.module.named_parameters()},
              "expert_params": [name for name, p in engine.module.named_parameters()
                                if not getattr(p, "allreduce", True)]}
    return base.end_engine(engine, record, sc["install"])


def main(rank, out_dir, port):
    """torch.multiprocessing entry point: this rank runs every scenario."""
    base.run_rank(rank, out_dir, port, SCENARIOS, _run)
