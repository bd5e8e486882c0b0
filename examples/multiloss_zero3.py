"""Two losses over one forward on ZeRO-3, with zero_lifetime: a runnable launcher example.

    torchrun --nproc_per_node 2 examples/multiloss_zero3.py --steps 5
    DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 examples/multiloss_zero3.py   # CPU, gloo
    deepspeed --num_gpus 2 examples/multiloss_zero3.py --steps 5                   # GPUs, nccl
    python examples/multiloss_zero3.py                                             # one process

Each rank trains on its own data; the second backward runs over the retained graph of
the first, which stock ZeRO-3 cannot do. zero_lifetime's options come from the DeepSpeed
config's "zero_lifetime" section, as a launcher-driven run would set them.
"""

import argparse
import os

import torch

import deepspeed
import zero_lifetime


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_lifetime": {"policy": "regather"},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = parser.parse_args(argv)

    if "RANK" not in os.environ:  # plain `python`: a one-process group on this machine
        from zero_lifetime.single_rank import single_rank_env
        single_rank_env()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # The backend follows DeepSpeed's accelerator (nccl on CUDA, gloo on the CPU one), not
    # torch.cuda.is_available(): DS_ACCELERATOR=cpu on a GPU machine must still use gloo.
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()

    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    engine, *_ = deepspeed.initialize(model=model, config=config(args.stage), model_parameters=model.parameters())
    zero_lifetime.install(engine)

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for step in range(args.steps):
        x = torch.randn(4, 16, generator=generator).to(engine.device)
        out = engine(x)
        engine.backward(out.pow(2).mean(), retain_graph=True)  # first loss keeps the graph
        engine.backward(out.abs().mean())                       # second loss reuses it
        engine.step()
    stats = zero_lifetime.stats(engine)
    print(f"rank {rank}/{torch.distributed.get_world_size()}: {args.steps} two-loss steps on ZeRO-{args.stage} "
          f"OK; pinned {stats['pinned_params']}, live handles {stats['live_handles']}", flush=True)
    # Tidy teardown. It does not remove one rare abort after this line on CPU (exit code -6,
    # "terminate called without an active exception"): a gloo worker thread still letting go of
    # a tensor as the interpreter finalizes, torch issue 117762; see docs/reliability.md.
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
