"""ZeRO-1 whose gradients accumulate in another dtype than the params' (kept in param.grad_accum)
on 2 gloo ranks, against torch DDP's average (not run in CI): the figures behind install()'s
refusal on DeepSpeed 0.17.6 and 0.18.9 (docs/reliability.md, "Found by CI: ZeRO-1 with such
gradients over 2 ranks"). mlp_norm in fp16 with data_types.grad_accum_dtype "fp32" (and, for
comparison, fp16 accumulation), 2 steps; prints stock's and installed's largest weight
difference, or what they raised. Run with each release's interpreter, and with a JIT cache of
its own for the older ones (DeepSpeed's shm comm op differs between releases):

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.zero1_grad_accum_two_ranks
    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$HOME/.cache/torch_extensions/deepspeed-0176 \
        .venv-ds0176/bin/python -m benchmarks.experiments.zero1_grad_accum_two_ranks
"""
import copy
import os
import sys

import torch
import torch.multiprocessing as mp

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests")


def _rank(rank, port, accumulation, install, results):
    sys.path.insert(0, TESTS)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed
    import zero_lifetime
    from fp16_scaling import cpu_fp16_allowed
    from harness import MLPNorm, ds_config, full_weights, losses, make_input

    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    model = MLPNorm()
    reference = copy.deepcopy(model)
    config = {**ds_config(1, lr=0.1), "fp16": {"enabled": True, "initial_scale_power": 8}}
    if accumulation:
        config["data_types"] = {"grad_accum_dtype": accumulation}
    try:
        with cpu_fp16_allowed():
            engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        if install:
            zero_lifetime.install(engine)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(2):
            engine.backward(sum(losses(engine(make_input("mlp_norm", 10 * step + rank).half()).float())))
            engine.step()
            for each in range(2):  # DDP's average of the two ranks' gradients
                (sum(losses(reference(make_input("mlp_norm", 10 * step + each)))) / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        off = max(float((got - want.detach()).abs().max()) for got, want in zip(full_weights(engine), reference.parameters()))
        result = f"{off:.2e} off DDP"
    except Exception as exc:  # what stock or installed raised is the result here
        result = f"raised {type(exc).__name__}: {str(exc)[:100]}"
    if rank == 0:
        results.put(result)


if __name__ == "__main__":
    import deepspeed
    print(f"DeepSpeed {deepspeed.__version__}, ZeRO-1, fp16 params, 2 gloo ranks, 2 steps")
    context = mp.get_context("spawn")
    for port, (accumulation, install) in enumerate(((a, i) for a in ("fp32", None) for i in (False, True)), 29710):
        results = context.Queue()
        mp.spawn(_rank, args=(port, accumulation, install, results), nprocs=2)
        print(f"accumulation {accumulation or 'fp16'}, {'installed' if install else 'stock'}: {results.get()}", flush=True)
