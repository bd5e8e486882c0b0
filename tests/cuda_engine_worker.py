"""Process for tests/test_cuda_engine.py: real DeepSpeed engines on the CUDA accelerator.

DeepSpeed picks its accelerator once per process (DS_ACCELERATOR), and the rest of the
suite runs on the CPU one, so the CUDA scenarios run here, in a child process, over nccl
with one rank. Oracle: the same model trained by plain torch on the same GPU. Prints one
JSON object per scenario (``ZL_RESULT {...}``) for the parent test to check.

Scenarios:
* ``stock-zero3-retained``: stock ZeRO-3, two backwards over one forward; must fail
  (the reported crash), proving the scenario reaches the bug on CUDA too.
* ``zero3-<policy>``: install(policy), retained two-backward steps; weights vs torch,
  nothing left gathered after each step; peak device memory of a retained step next to
  a stock single-backward step of the same engine shape.
* ``zero<stage>-fused-fill``: install on ZeRO-1/2; single-backward steps with the fused
  CUDA bucket fill (counted), weights vs torch.
* ``zero3-destroyed-device-memory``: device memory a ZeRO-3 engine leaves allocated after
  three steps, ``destroy()`` and ``gc.collect()``, stock and installed.
"""

import copy
import gc
import json
import os
import sys
import traceback

os.environ["DS_ACCELERATOR"] = "cuda"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zero_lifetime.single_rank import single_rank_env  # noqa: E402

single_rank_env()

import logging  # noqa: E402

import torch  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

import zero_lifetime  # noqa: E402
from zero_lifetime import ops  # noqa: E402
from zero_lifetime.bench.step import peak_device_bytes  # noqa: E402

logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
STEPS = 3
WIDTH, DEPTH, BATCH = 1024, 4, 64


class Stack(torch.nn.Module):
    """Linear+LayerNorm blocks: big enough that gathered params show in device memory."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.Tanh())
            for _ in range(DEPTH))
        self.head = torch.nn.Linear(WIDTH, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def losses(out):
    return out.pow(2).mean(), (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum()


def config(stage, **zero):
    zero_cfg = {"stage": stage, **zero}
    if stage == 3:  # eager release: stock frees module by module, the fair memory baseline
        zero_cfg.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                        stage3_prefetch_bucket_size=0)
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0, "zero_optimization": zero_cfg}


def make_pair(stage, **zero):
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model).cuda()
    engine, *_ = deepspeed.initialize(model=model, config=config(stage, **zero), model_parameters=model.parameters())
    return engine, reference, torch.optim.SGD(reference.parameters(), lr=0.05)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g).cuda()


def max_weight_error(engine, reference):
    return max((safe_get_full_fp32_param(p).detach().float() - r.detach().float()).abs().max().item()
               for p, r in zip(engine.module.parameters(), reference.parameters()))


def left_gathered(engine):
    return [n for n, p in engine.module.named_parameters()
            if not getattr(p, "ds_persist", False) and p.ds_status != ZeroParamStatus.NOT_AVAILABLE]


def retained_step(engine, x):
    l1, l2 = losses(engine(x))
    engine.backward(l1, retain_graph=True)
    engine.backward(l2)
    engine.step()


def single_step(engine, x):
    engine.backward(losses(engine(x))[0])
    engine.step()


def stock_zero3_retained():
    engine, _, _ = make_pair(3)
    try:
        l1, l2 = losses(engine(batch(0)))
        engine.backward(l1, retain_graph=True)
        engine.backward(l2)
        torch.cuda.synchronize()
        return {"failed": False}
    except Exception as exc:  # the reported crash is a RuntimeError from the second backward
        return {"failed": True, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        engine.destroy()


def zero3_retained(policy):
    engine, reference, ref_opt = make_pair(3)
    zero_lifetime.install(engine, policy=policy)
    errors, leftovers = [], []
    for step in range(STEPS):
        x = batch(step)
        retained_step(engine, x)
        l1, l2 = losses(reference(x))
        l1.backward(retain_graph=True)
        l2.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        errors.append(max_weight_error(engine, reference))
        leftovers.append(left_gathered(engine))
    # Peak device memory: the installed retained step next to a stock single backward
    # of an identical engine (same shapes, same eager release).
    stock, _, _ = make_pair(3)
    single_step(stock, batch(0))  # warm-up: trace recording, allocator
    stock_peak = peak_device_bytes(lambda: single_step(stock, batch(1)))
    retained_peak = peak_device_bytes(lambda: retained_step(engine, batch(STEPS)))
    stats = zero_lifetime.stats(engine)
    stock.destroy()
    engine.destroy()
    return {"max_weight_error": max(errors), "left_gathered": leftovers, "stock_single_peak_bytes": stock_peak,
            "retained_peak_bytes": retained_peak, "stats": {k: v for k, v in stats.items()
                                                            if isinstance(v, (int, float, str))}}


def zero12_fused_fill(stage):
    fills = {"n": 0}
    original = ops.bucket_fill

    def counting(*args, **kwargs):
        fills["n"] += 1
        return original(*args, **kwargs)

    ops.bucket_fill = counting
    try:
        engine, reference, ref_opt = make_pair(stage, reduce_bucket_size=WIDTH * WIDTH + 4 * WIDTH)
        zero_lifetime.install(engine)
        errors = []
        for step in range(STEPS):
            x = batch(step)
            single_step(engine, x)
            losses(reference(x))[0].backward()
            ref_opt.step()
            ref_opt.zero_grad()
            errors.append(max_weight_error(engine, reference))
        stats = zero_lifetime.stats(engine)
        engine.destroy()
    finally:
        ops.bucket_fill = original
    return {"max_weight_error": max(errors), "bucket_fill_calls": fills["n"],
            "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}}


def device_bytes_left_by_engine(installed):
    """torch.cuda.memory_allocated() after building, training and destroying one ZeRO-3
    engine, minus before it (the caller's references to it dropped, gc run)."""
    gc.collect()
    before = torch.cuda.memory_allocated()
    engine = make_pair(3)[0]  # not the torch reference, which a name would keep alive here
    if installed:
        zero_lifetime.install(engine)
    for step in range(STEPS):
        single_step(engine, batch(step))
    engine.destroy()
    del engine
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def zero3_destroyed_device_memory():
    device_bytes_left_by_engine(installed=True)  # warm-up: one-time allocations (cuBLAS workspace, ...)
    model_bytes = sum(p.numel() * p.element_size() for p in Stack().parameters())
    return {"model_bytes": model_bytes, "stock_left_bytes": device_bytes_left_by_engine(installed=False),
            "installed_left_bytes": device_bytes_left_by_engine(installed=True)}


SCENARIOS = {
    "stock-zero3-retained": stock_zero3_retained,
    "zero3-regather": lambda: zero3_retained("regather"),
    "zero3-pin": lambda: zero3_retained("pin"),
    "zero1-fused-fill": lambda: zero12_fused_fill(1),
    "zero2-fused-fill": lambda: zero12_fused_fill(2),
    "zero3-destroyed-device-memory": zero3_destroyed_device_memory,
}


def main(names):
    assert torch.cuda.is_available(), "cuda_engine_worker needs a GPU"
    for name in names or SCENARIOS:
        try:
            result = {"scenario": name, "ok": True, **SCENARIOS[name]()}
        except Exception:
            result = {"scenario": name, "ok": False, "traceback": traceback.format_exc()}
        print("ZL_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
