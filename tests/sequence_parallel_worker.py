"""Rank process for tests/test_sequence_parallel.py: ZeRO under DeepSpeed's Ulysses sequence
parallelism (``sequence_parallel_size`` 2, its ``parallel_state_sp`` groups), 2 ranks.

Both ranks see the same batch and each runs its half of the sequence through a per-token model
(no token looks at another, so no attention all-to-all is needed: what is tested is how ZeRO
reduces the gradients over the sequence-parallel ranks). Each loss is a sum over the rank's
tokens divided by the batch's token count, so the two halves' gradients add up to those of the
whole sequence in plain torch, the oracle. Each scenario records its weights' distance to that
oracle and to one whose gradients are halved (what DeepSpeed's ZeRO-3 reduce-scatter path
computes: it divides by the group size whatever the sequence-parallel size), and the weights
themselves, so the parent compares an installed run with the stock one.
"""

import two_rank_worker as base

WORLD = base.WORLD
SEQUENCE_PARALLEL = 2
STEPS, LR, SEQ = 3, 0.01, 8


def _scenario(stage, install, reduce_scatter=True, offload=False, policy=None):
    sid = (f"{'installed' if install else 'stock'}-stage{stage}" + (f"-{policy}" if policy else "")
           + ("" if reduce_scatter else "-no_reduce_scatter") + ("-offload" if offload else ""))
    return dict(id=sid, stage=stage, install=install, reduce_scatter=reduce_scatter, offload=offload,
                policy=policy)


def _build_scenarios():
    out = []
    for stage, reduce_scatter, offload in ((1, True, False), (2, True, False), (2, True, True), (3, True, False),
                                           (3, False, False), (3, True, True)):
        out.append(_scenario(stage, False, reduce_scatter, offload))
        for policy in (("regather", "pin") if stage == 3 else (None, )):
            out.append(_scenario(stage, True, reduce_scatter, offload, policy))
    return out


SCENARIOS = _build_scenarios()


def _model():
    """mlp_norm: its layers act on each token alone."""
    import torch
    from harness import MODELS
    torch.manual_seed(0)
    return MODELS["mlp_norm"]()


def _batch(step):
    import torch
    from harness import IN
    return torch.randn(2, SEQ, IN, generator=torch.Generator().manual_seed(100 + step))


def _losses(out, tokens):
    import torch
    return out.pow(2).sum() / tokens, (out * torch.linspace(-1, 1, out.shape[-1])).sum() / tokens


def _oracle_weights(gradient_scale):
    import torch
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x = _batch(step)
        first, second = _losses(model(x), x.shape[0] * SEQ)
        ((first + second) * gradient_scale).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def _sequence_parallel_groups():
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=SEQUENCE_PARALLEL)
    return mpu


def _run(sc, rank):
    import deepspeed
    from harness import backward_separately_or_summed, ds_config, full_weights, install_or_let_stock_step

    mpu = _sequence_parallel_groups()
    zero = {"reduce_scatter": sc["reduce_scatter"]}
    if sc["offload"]:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = dict(ds_config(sc["stage"], 0, lr=LR, **zero), sequence_parallel_size=SEQUENCE_PARALLEL)
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(), mpu=mpu)
    assert engine.optimizer.sequence_parallel_size == SEQUENCE_PARALLEL
    install_or_let_stock_step(engine, sc["install"], policy=sc["policy"])
    for step in range(STEPS):
        x = _batch(step)
        half = SEQ // SEQUENCE_PARALLEL
        backward_separately_or_summed(engine, *_losses(engine(x[:, rank * half:(rank + 1) * half]), x.shape[0] * SEQ),
                                      separately=sc["install"])
        engine.step()
    got = full_weights(engine)
    record = {"weights": {name: w.tolist() for (name, _), w in zip(engine.module.named_parameters(), got)}}
    for key, scale in (("oracle_diff", 1.0), ("halved_oracle_diff", 1.0 / SEQUENCE_PARALLEL)):
        want = _oracle_weights(scale)
        record[key] = max((g - w).abs().max().item() for g, w in zip(got, want.values()))
    return base.end_engine(engine, record, sc["install"])


def main(rank, out_dir, port):
    """torch.multiprocessing entry point: this rank runs every scenario."""
    base.run_rank(rank, out_dir, port, SCENARIOS, _run)
