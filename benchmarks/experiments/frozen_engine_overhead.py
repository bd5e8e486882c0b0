"""What install() on a ZeRO-3 engine without optimizer costs a training step (not run in CI):
the figures behind docs/reliability.md, "A frozen model in an engine of its own".

A policy (4 blocks of Linear 256x256, LayerNorm, GELU; ZeRO-3, installed) trained through a
frozen reward model of the same shape plus a head, in a ZeRO-3 engine built without an
optimizer, 1 gloo rank. Two reward engines over identical models, one installed, one stock;
each step ``policy_engine.backward(-reward_engine.module(policy_engine(x)).mean())`` and
``step()`` (one backward: stock runs it; through ``module`` because stock ``engine(x)`` raises on
0.18.9 and 0.19.8), alternating which reward engine every round for 30 rounds each, in one
process. Prints the median step time of each and their ratio, and the installed step with two
retained backwards (stock fails it) for scale.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.frozen_engine_overhead
"""
import os
import statistics
import time
import warnings

import torch

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29635"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")

WIDTH, BLOCKS, BATCH = 256, 4, 32


def _blocks():
    layers = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.GELU()]
    return layers


def main(rounds: int = 30) -> None:
    import logging

    import deepspeed
    import zero_lifetime
    deepspeed.init_distributed("gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's deprecated collective names
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    torch.manual_seed(0)
    policy = torch.nn.Sequential(*_blocks())
    policy_engine, *_ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config={
        "train_micro_batch_size_per_gpu": BATCH, "optimizer": {"type": "SGD", "params": {"lr": 1e-4}},
        "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "zero_optimization": zero})
    zero_lifetime.install(policy_engine)
    rewards = {}
    for way in ("stock", "installed"):
        torch.manual_seed(1)
        reward = torch.nn.Sequential(*_blocks(), torch.nn.Linear(WIDTH, 1)).requires_grad_(False)
        rewards[way], *_ = deepspeed.initialize(model=reward, config={"train_micro_batch_size_per_gpu": BATCH,
                                                                      "zero_optimization": zero})
    zero_lifetime.install(rewards["installed"])
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(0))

    def step(way, backwards=1):
        reward = rewards[way].module(policy_engine(x))
        if backwards == 2:
            policy_engine.backward(-reward.mean(), retain_graph=True)
        policy_engine.backward(reward.pow(2).mean() if backwards == 2 else -reward.mean())
        policy_engine.step()

    for way in rewards:
        for _ in range(3):
            step(way)
    times = {"stock": [], "installed": [], "installed, two backwards": []}
    for round_ in range(rounds):
        for way in (("stock", "installed") if round_ % 2 == 0 else ("installed", "stock")):
            start = time.perf_counter()
            step(way)
            times[way].append(time.perf_counter() - start)
        start = time.perf_counter()
        step("installed", backwards=2)
        times["installed, two backwards"].append(time.perf_counter() - start)
    medians = {way: statistics.median(samples) for way, samples in times.items()}
    for way, median in medians.items():
        print(f"{way:26} median step {median * 1e3:.2f} ms")
    print(f"installed / stock (one backward): {medians['installed'] / medians['stock'] - 1:+.2%}")


if __name__ == "__main__":
    main()
