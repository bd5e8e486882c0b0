"""What the selective-checkpoint wrapper costs a ZeRO-3 step (not run in CI): the bench's
4-layer transformer (width 256, 44 modules) on 1 gloo rank, installed, one forward and one
backward per step; DeepSpeed's per-module gather and release called through install's wrapper
(zero_lifetime.selective_checkpoint) or directly, alternating every step for 30 rounds each,
in one process. Prints the median step time of each and their ratio. Outside a selective
checkpoint the wrapper only looks at torch's dispatch-mode stack (about 1 us a call, two calls
per module per forward): the ratio is within the machine's noise.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.selective_checkpoint_wrapper_cost
"""
import os
import statistics
import time
import warnings

import torch

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29633"), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")


def main(rounds: int = 30) -> None:
    import logging

    import deepspeed
    import zero_lifetime
    from zero_lifetime.bench.engines import TinyTransformer
    deepspeed.init_distributed("gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's deprecated collective names
    torch.manual_seed(0)
    model = TinyTransformer(4, 256)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    zero_lifetime.install(engine)
    tokens = torch.randint(0, 100, (4, 64))

    def step():
        engine.backward(engine(tokens).float().pow(2).mean())
        engine.step()

    for _ in range(3):
        step()
    offload = engine.optimizer.parameter_offload
    names = ("pre_sub_module_forward_function", "post_sub_module_forward_function")
    ways = {"wrapped": [getattr(offload, name) for name in names],
            "direct": [getattr(type(offload), name).__get__(offload) for name in names]}
    times = {way: [] for way in ways}
    for round_ in range(rounds):
        for way in (("wrapped", "direct") if round_ % 2 == 0 else ("direct", "wrapped")):
            for name, function in zip(names, ways[way]):
                setattr(offload, name, function)
            start = time.perf_counter()
            step()
            times[way].append(time.perf_counter() - start)
    for name, function in zip(names, ways["wrapped"]):
        setattr(offload, name, function)
    medians = {way: statistics.median(samples) for way, samples in times.items()}
    for way, median in medians.items():
        print(f"{way:8} median step {median * 1e3:.2f} ms")
    print(f"wrapped / direct: {medians['wrapped'] / medians['direct'] - 1:+.2%}")


if __name__ == "__main__":
    main()
