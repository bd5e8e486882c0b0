"""fp16 with dynamic loss scaling: overflow found, the step skipped, the scale halved, 1 rank.

Two backwards over one forward; in chosen steps one of the two losses is blown up so its
scaled fp16 gradients overflow. The oracle is plain torch doing what DeepSpeed's fp16 mode
promises: an fp16 model, fp32 master weights, the loss scaled before backward, a step skipped
(and the scale halved) when any summed gradient is not finite, otherwise SGD on the
unscaled gradient. An overflow that zero_grad() dropped before the second backward must not
skip the step, as with torch.

DeepSpeed's CPU accelerator allows fp16 only where oneDNN has fp16 kernels (AVX512-FP16 /
AMX CPUs). This machine has none, so the tests tell DeepSpeed it does: torch computes fp16 on
any CPU, only slower, and every line of DeepSpeed's and zero_lifetime's fp16 path still runs.
"""

import copy

import deepspeed
import pytest
import torch
from deepspeed.accelerator import get_accelerator

import multitask as mt
import zero_lifetime
from harness import DS_VERSION, TORCH_STYLE_BACKWARD
from multitask import STAGE_IDS, STAGES_OFFLOAD

INITIAL_SCALE_POWER = 8
BOOST = 1e6  # times the loss: scaled fp16 gradients far past 65504
# Which loss is blown up in each step (None: neither).
SCHEDULE = [None, "second", None, "first", None, "both", None]
# reduce_bucket_size: several flushes per backward with trunk.weight (128) bypassing the
# bucket, or every gradient through one fused fill.
BUCKETS = [100, 1000]
# engine.backward(loss), or the torch-style engine.scale(loss).backward() of DeepSpeed 0.18+.
PATHS = ["engine", "scale"] if TORCH_STYLE_BACKWARD else ["engine"]


@pytest.fixture(autouse=True)
def cpu_fp16(monkeypatch):
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)


def _config(stage, offload, bucket):
    cfg = mt.config(stage, "zero_grad_between", offload, "fp32", bucket=bucket)
    cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_SCALE_POWER,
                   "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
    return cfg


def _losses(out, step):
    first, second = mt.zero_grad_between_losses(out)
    boost = SCHEDULE[step]
    return (first * (BOOST if boost in ("first", "both") else 1),
            second * (BOOST if boost in ("second", "both") else 1))


def _train_engine(engine, path, zero_grad):
    for step in range(len(SCHEDULE)):
        first, second = _losses(engine(mt.batches(step)[0].half(), (0, 1)), step)
        if path == "engine":
            engine.backward(first, retain_graph=True)
        else:
            engine.scale(first).backward(retain_graph=True)
        if zero_grad:
            engine.zero_grad()
        if path == "engine":
            engine.backward(second)
        else:
            engine.scale(second).backward()
        engine.step()


def _train_reference(model, zero_grad):
    """Returns fp32 master weights, final loss scale and the number of skipped steps."""
    half = copy.deepcopy(model).half()
    master = {name: p.detach().float().clone() for name, p in half.named_parameters()}
    scale, skipped = 2.0 ** INITIAL_SCALE_POWER, 0
    for step in range(len(SCHEDULE)):
        first, second = _losses(half(mt.batches(step)[0].half(), (0, 1)), step)
        (first * scale).backward(retain_graph=True)
        if zero_grad:
            half.zero_grad()
        (second * scale).backward()
        grads = {name: p.grad for name, p in half.named_parameters() if p.grad is not None}
        if not all(torch.isfinite(g).all() for g in grads.values()):
            scale, skipped = scale / 2, skipped + 1
        else:
            with torch.no_grad():
                for name, p in half.named_parameters():
                    if name in grads:
                        master[name] -= mt.LR * grads[name].float() / scale
                        p.copy_(master[name])
        half.zero_grad()
    return master, scale, skipped


def _run(stage, offload, path, zero_grad, bucket, install=True):
    model, reference = mt.make_models()
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage, offload, bucket),
                                      model_parameters=model.parameters())
    if install:
        zero_lifetime.install(engine)
    _train_engine(engine, path, zero_grad)
    master, scale, skipped = _train_reference(reference, zero_grad)
    got = mt.engine_weights(engine)
    diffs = {name: (got[name] - want).abs().max().item() for name, want in master.items()}
    return diffs, (engine.optimizer.cur_scale, engine.skipped_steps), (scale, skipped)


# ZeRO-1/2 with offload refuse a second backward without zero_grad()
# (test_retain_graph::test_offloaded_stage12_refuses_a_second_backward_without_zero_grad).
SUMMING = [(s, o) for s, o in STAGES_OFFLOAD if s == 3 or not o]


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage,offload", SUMMING, ids=[STAGE_IDS[STAGES_OFFLOAD.index(c)] for c in SUMMING])
def test_overflow_in_either_backward_skips_the_step(stage, offload, path, bucket):
    diffs, got, want = _run(stage, offload, path, zero_grad=False, bucket=bucket)
    assert want[1] == 3, "the oracle should skip the three boosted steps"
    assert got == want, f"(loss scale, skipped steps): engine {got}, torch {want}"
    assert max(diffs.values()) <= 1e-4, diffs


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage,offload", STAGES_OFFLOAD, ids=STAGE_IDS)
def test_overflow_dropped_by_zero_grad_does_not_skip(stage, offload, path, bucket):
    """The "first" step's overflow is gone with zero_grad(): that step is taken."""
    diffs, got, want = _run(stage, offload, path, zero_grad=True, bucket=bucket)
    assert want[1] == 2, "only the steps whose second loss is boosted skip"
    assert got == want, f"(loss scale, skipped steps): engine {got}, torch {want}"
    assert max(diffs.values()) <= 1e-4, diffs


@pytest.mark.parametrize("stage", [1, 2])
def test_stock_offload_skips_steps_torch_takes(stage):
    """Negative control, per release: stock ZeRO-1/2 with CPU offload and zero_grad() between
    the two backwards. 0.17.6 skips the step whose dropped first backward overflowed (the
    overflow flag outlives zero_grad()). 0.19.8 also leaves the overflowed gradient in its CPU
    accumulator after the skipped step, and the second backward of every later step adds to
    it (its zero_grad() starts no new window): every step after the first overflow skips."""
    _, got, want = _run(stage, True, "engine", zero_grad=True, bucket=1000, install=False)
    assert want[1] == 2
    assert got[1] == (3 if DS_VERSION == "0.17.6" else len(SCHEDULE) - 1), (got, want)
