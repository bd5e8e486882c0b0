"""A policy trained through a frozen, differentiable reward model (ReFL/DRaFT-style), for the
tests of a ZeRO-3 engine built without an optimizer (tests/test_frozen_engine.py, its 2-rank
worker) and of the reward as a frozen submodule (tests/test_chained_engines.py).

Each step: ``reward = R(P(x))``, then two backwards over that one forward (the first retains
the graph) and one optimizer step. The reward's LayerNorm saves its weight itself for backward:
a second backward needs that param gathered again.
"""

import deepspeed
import torch

IN, FEATURES, HIDDEN = 4, 8, 16
BATCH = 4


def policy_and_reward():
    """The policy (trained) and the reward (frozen), the same for one seed on every rank."""
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, FEATURES))
    reward = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.LayerNorm(HIDDEN), torch.nn.Tanh(),
                                 torch.nn.Linear(HIDDEN, 1))
    reward.requires_grad_(False)
    return policy, reward


def batch(step, rank=0, part=0):
    return torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(100 + 10 * step + rank + 1000 * part))


def losses(reward):
    return -reward.mean(), 0.1 * (reward - 1).pow(2).mean()


def reward_steps(policy, reward, backward, optimizer_step, steps=3, rank=0, forwards=1):
    """``steps`` steps of ``policy`` through ``reward``: two retained backwards of one forward
    (``backward(loss, retain_graph=...)``), then ``optimizer_step()``. ``forwards`` > 1: the
    reward of that many batches, each its own forward of both models, joined."""
    for step in range(steps):
        rewards = torch.cat([reward(policy(batch(step, rank, part))) for part in range(forwards)])
        first, second = losses(rewards)
        backward(first, retain_graph=True)
        backward(second)
        optimizer_step()


def engine_without_optimizer(model, gas=1, stage=3, bf16=False):
    """An engine over ``model`` with no optimizer, as TRL and DeepSpeed-Chat build reward and
    reference models: ZeRO-3 (DeepSpeed then only partitions its params) or stage 0 (TRL's
    choice beside a ZeRO-1/2 model). ``bf16``: DeepSpeed's bf16 mode (pass a bf16 model)."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": gas, "zero_optimization": zero}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine


def gathered_weights(engine):
    """The full weights of an engine without optimizer (it keeps no fp32 masters)."""
    weights = []
    for param in engine.module.parameters():
        with deepspeed.zero.GatheredParameters([param]):
            weights.append(param.detach().clone())
    return weights
