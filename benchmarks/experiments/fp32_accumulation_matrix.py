"""DeepSpeed's fp32 accumulation of other-dtype params, stock against installed, over the
configurations docs/reliability.md ("Gradients accumulated in fp32 for params in another dtype")
quotes (a check wider than the kept tests, not run in CI). 1 gloo rank, mlp_norm, 3 steps, one or
two retained backwards a step, GAS 1 and 2; prints the largest weight difference from torch in
fp64 per run (or what was raised). Then split_heads on ZeRO-1 with overlap_comm, its head_b
reached only in each window's first micro-step.

    DS_ACCELERATOR=cpu python3 -m benchmarks.experiments.fp32_accumulation_matrix
"""
import contextlib
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
import conftest  # noqa: E402,F401  (one gloo rank on the CPU, as the tests run)
import deepspeed  # noqa: E402
import torch  # noqa: E402

import zero_lifetime  # noqa: E402
from fp16_scaling import cpu_fp16_allowed  # noqa: E402
from harness import MLPNorm, SplitHeads, ds_config, full_weights, in_float64, losses, make_input  # noqa: E402

OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
# name: (model dtype, top-level config, stages, zero_optimization extras)
CASES = {
    "fp64": (torch.float64, {}, (1, 2, 3), {}),
    "bf16+fp32_accum": (torch.bfloat16, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, (2, 3),
                        {}),
    "bf16+fp32_accum+offload": (torch.bfloat16, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
                                (1, 2), OFFLOAD),
    "fp16+fp32_accum": (torch.float16, {"fp16": {"enabled": True, "initial_scale_power": 8},
                                        "data_types": {"grad_accum_dtype": "fp32"}}, (1, 2), {}),
}


def _engine(model, stage, gas, config, zero, install):
    cfg = {**ds_config(stage, lr=0.01, gas=gas, **zero), **config}
    with cpu_fp16_allowed() if "fp16" in config else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    if install:
        zero_lifetime.install(engine)
    return engine


def _off_torch(engine, reference):
    return max(float((got.double() - want.detach().double()).abs().max())
               for got, want in zip(full_weights(engine), reference.parameters()))


def mlp_norm_run(dtype, config, stage, zero, backwards, gas, install):
    torch.manual_seed(0)
    model = in_float64(MLPNorm)() if dtype == torch.float64 else MLPNorm()
    reference = copy.deepcopy(model).double()
    engine = _engine(model, stage, gas, config, zero, install)
    engine_dtype = torch.float32 if dtype == torch.float64 else dtype
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    for step in range(3 * gas):
        x = make_input("mlp_norm", step)
        first, second = losses(engine(x.to(engine_dtype)).float())
        ref_first, ref_second = losses(reference(x.double()).float())
        if backwards == 2:
            engine.backward(first, retain_graph=True)
            engine.backward(second)
            (ref_first / gas).backward(retain_graph=True)
            (ref_second / gas).backward()
        else:
            engine.backward(first + second)
            ((ref_first + ref_second) / gas).backward()
        engine.step()
        if (step + 1) % gas == 0:
            ref_opt.step()
            ref_opt.zero_grad()
    return _off_torch(engine, reference)


def split_heads_run(dtype, config, zero, install):
    torch.manual_seed(0)
    model = in_float64(SplitHeads)() if dtype == torch.float64 else SplitHeads()
    reference = copy.deepcopy(model).double()
    engine = _engine(model, 1, 2, config, {"overlap_comm": True, **zero}, install)
    engine_dtype = torch.float32 if dtype == torch.float64 else dtype
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    for step in range(6):
        x = make_input("split_heads", step)
        first, second = losses(tuple(o.float() for o in engine(x.to(engine_dtype))))
        ref_first, ref_second = losses(tuple(o.float() for o in reference(x.double())))
        engine.backward(first if step % 2 else first + second)
        ((ref_first if step % 2 else ref_first + ref_second) / 2).backward()
        engine.step()
        if step % 2:
            ref_opt.step()
            ref_opt.zero_grad()
    return _off_torch(engine, reference)


def _shown(run, *args):
    try:
        return f"{run(*args):.1e}"
    except Exception as exc:  # what stock or installed raised is the result here
        return f"raised {type(exc).__name__}: {str(exc)[:80]}"


if __name__ == "__main__":
    print(f"DeepSpeed {deepspeed.__version__}; largest weight difference from torch (fp64), stock | installed")
    for name, (dtype, config, stages, zero) in CASES.items():
        for stage in stages:
            for backwards, gas in ((1, 1), (2, 1), (2, 2)):
                stock, installed = (_shown(mlp_norm_run, dtype, config, stage, zero, backwards, gas, install)
                                    for install in (False, True))
                print(f"mlp_norm    {name:24s} stage {stage} backwards {backwards} gas {gas}: {stock} | {installed}",
                      flush=True)
    for name in ("fp64", "fp16+fp32_accum", "bf16+fp32_accum+offload"):
        dtype, config, _, zero = CASES[name]
        stock, installed = (_shown(split_heads_run, dtype, config, zero, install) for install in (False, True))
        print(f"split_heads {name:24s} stage 1 overlap_comm gas 2, head_b in first micro-steps: {stock} | {installed}",
              flush=True)
