"""Rank process for tests/test_frozen_engine.py: a policy engine trained data-parallel on 2
gloo ranks through a frozen reward model in a ZeRO-3 engine without optimizer, whose params
each rank holds only half of. Two backwards over each forward.

The oracle is plain torch in one process: the same policy and reward, each step one backward
of the mean over the ranks of each rank's two losses on its own batch, and an SGD step. Every
rank computes it and compares its policy's weights with the oracle's.
"""

import two_rank_worker as base

WORLD = base.WORLD
ATOL = base.ATOL
STEPS = 3
LR = 0.1


def _scenario(sid, stage, forward, policy="regather", install=True):
    return dict(id=sid, stage=stage, forward=forward, policy=policy, install=install)


SCENARIOS = [_scenario(f"stage{stage}-{forward}", stage, forward) for stage in (1, 2, 3)
             for forward in ("engine", "module")]
SCENARIOS += [
    _scenario("stage3-module-pin", 3, "module", policy="pin"),
    # Control: the reward engine not installed (the policy's is): its second backward fails.
    _scenario("stock-module", 3, "module", install=False),
]


def _oracle_weights():
    import torch
    from frozen_reward import batch, losses, policy_and_reward
    policy, reward = policy_and_reward()
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    for step in range(STEPS):
        total = sum(sum(losses(reward(policy(batch(step, rank))))) for rank in range(WORLD)) / WORLD
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in policy.parameters()]


def _run(sc, rank):
    import gc

    import deepspeed
    import torch
    import zero_lifetime
    from frozen_reward import engine_without_optimizer, gathered_weights, policy_and_reward, reward_steps
    from harness import ds_config, full_weights, released_state

    policy_model, reward_model = policy_and_reward()
    initial_reward = [p.detach().clone() for p in reward_model.parameters()]
    policy_engine, *_ = deepspeed.initialize(model=policy_model, config=ds_config(sc["stage"], lr=LR),
                                             model_parameters=policy_model.parameters())
    zero_lifetime.install(policy_engine, policy=sc["policy"])
    reward_engine = engine_without_optimizer(reward_model)
    if sc["install"]:
        zero_lifetime.install(reward_engine, policy=sc["policy"])
    forward = reward_engine if sc["forward"] == "engine" else reward_engine.module
    record = {"failed_with": None}
    try:
        reward_steps(policy_engine, forward, policy_engine.backward, policy_engine.step, steps=STEPS, rank=rank)
    except RuntimeError as error:
        if sc["install"]:
            raise
        record["failed_with"] = str(error)[:300]
        return record  # stock: the engines are left as the failure left them
    initial_policy = policy_and_reward()[0]
    got = full_weights(policy_engine)
    record["abs_diff"] = {name: (g - w).abs().max().item() for (name, _), g, w in
                          zip(policy_engine.module.named_parameters(), got, _oracle_weights())}
    record["moved"] = max((g - w.detach()).abs().max().item() for g, w in zip(got, initial_policy.parameters()))
    record["reward_partitioned"] = any(p.ds_tensor.numel() < p.ds_numel for p in reward_engine.module.parameters())
    record["reward_unchanged"] = all(torch.equal(g, w) for g, w in zip(gathered_weights(reward_engine),
                                                                       initial_reward))
    gc.collect()
    record["reward_released"] = released_state(reward_engine) == ([], [])
    record["reward_stats"] = base.end_engine(reward_engine, {}, True)["stats"]
    return base.end_engine(policy_engine, record, True)


def main(rank, out_dir, port):
    """torch.multiprocessing entry point: this rank runs every scenario."""
    base.run_rank(rank, out_dir, port, SCENARIOS, _run)
