"""fp16 with a dynamic loss scale: the training loop and its plain-torch oracle.

Two backwards over one forward of the multi-task model (``multitask``); in chosen steps one
or both losses are blown up so their scaled fp16 gradients overflow. The oracle does what
DeepSpeed's fp16 mode promises: an fp16 model, fp32 master weights, the loss scaled before
backward, a step skipped (and the scale halved) when any summed gradient is not finite,
otherwise SGD on the unscaled gradient. With world > 1 the gradients are averaged over the
ranks first, so an overflow on one rank skips the step everywhere. Used by the 1-rank tests
and by the 2-rank worker.

DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels (AVX512-FP16 /
AMX CPUs). ``cpu_fp16_allowed`` tells it yes: torch computes fp16 on any CPU, only slower,
and every line of DeepSpeed's and zero_lifetime's fp16 path still runs.
"""

import contextlib
import copy

import torch

import deepspeed
import multitask as mt
from deepspeed.accelerator import get_accelerator
from harness import backward_both

INITIAL_SCALE_POWER = 8
BOOST = 1e6  # times the loss: scaled fp16 gradients far past 65504
# Which loss is blown up in each step (None: neither).
SCHEDULE = [None, "second", None, "first", None, "both", None]


# A dynamic loss scale that halves at the first overflow and does not grow back in these runs.
FP16_SECTION = {"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_SCALE_POWER,
                "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}


@contextlib.contextmanager
def cpu_fp16_allowed():
    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    try:
        yield
    finally:
        del accelerator.is_fp16_supported  # the class's own answer again


def config(stage: int, offload: bool, bucket: int, clip: float = 0.0, zero: dict = None):
    cfg = mt.config(stage, "zero_grad_between", offload, "fp32", bucket=bucket, clip=clip)
    cfg["zero_optimization"].update(zero or {})
    cfg["fp16"] = dict(FP16_SECTION)
    return cfg


def build_engine(model, stage: int, offload: bool, bucket: int, clip: float = 0.0, zero: dict = None):
    with cpu_fp16_allowed():
        engine, *_ = deepspeed.initialize(model=model, config=config(stage, offload, bucket, clip, zero),
                                          model_parameters=model.parameters())
    return engine


def losses(out, step: int, schedule):
    first, second = mt.zero_grad_between_losses(out)
    boost = schedule[step]
    return (first * (BOOST if boost in ("first", "both") else 1),
            second * (BOOST if boost in ("second", "both") else 1))


def train_engine(engine, path: str, zero_grad: bool, schedule=SCHEDULE, rank: int = 0):
    """path: engine.backward(loss), or the torch-style engine.scale(loss).backward() (0.18+)."""
    for step in range(len(schedule)):
        first, second = losses(engine(mt.batches(step, rank)[0].half(), (0, 1)), step, schedule)
        backward_both(engine, first, second, path, zero_grad)
        engine.step()


def train_reference(model, zero_grad: bool, schedule=SCHEDULE, rank: int = 0, world: int = 1, clip: float = 0.0):
    """Returns the fp32 master weights by name, the final loss scale, the skipped steps and
    the steps whose gradient clipping (of the unscaled gradients, as torch's) scaled them down."""
    half = copy.deepcopy(model).half()
    master = {name: p.detach().float().clone() for name, p in half.named_parameters()}
    scale, skipped, clipped = 2.0 ** INITIAL_SCALE_POWER, 0, 0
    for step in range(len(schedule)):
        first, second = losses(half(mt.batches(step, rank)[0].half(), (0, 1)), step, schedule)
        (first * scale).backward(retain_graph=True)
        if zero_grad:
            half.zero_grad()
        (second * scale).backward()
        # Every rank reaches the same params here, so all ranks all-reduce the same list.
        grads = {name: p.grad for name, p in half.named_parameters() if p.grad is not None}
        if world > 1:
            for grad in grads.values():
                torch.distributed.all_reduce(grad)
                grad /= world
        if not all(torch.isfinite(g).all() for g in grads.values()):
            scale, skipped = scale / 2, skipped + 1
        else:
            unscaled = {name: grad.float() / scale for name, grad in grads.items()}
            coefficient = 1.0
            if clip > 0:  # torch.nn.utils.clip_grad_norm_'s rule
                norm = torch.sqrt(sum(g.pow(2).sum() for g in unscaled.values())).item()
                coefficient = min(1.0, clip / (norm + 1e-6))
                clipped += coefficient < 1.0
            with torch.no_grad():
                for name, p in half.named_parameters():
                    if name in unscaled:
                        master[name] -= mt.LR * coefficient * unscaled[name]
                        p.copy_(master[name])
        half.zero_grad()
    return master, scale, skipped, clipped


def compare(engine, master):
    """Max abs difference per param between the engine's fp32 master weights and the oracle's."""
    got = mt.engine_weights(engine)
    return {name: (got[name] - want).abs().max().item() for name, want in master.items()}


def scale_and_skips(engine):
    return engine.optimizer.cur_scale, engine.skipped_steps
