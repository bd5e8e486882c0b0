"""A gradient from before the last step or zero_grad() must not be applied: 1 rank, against torch.

torch leaves such a param's .grad None and SGD skips it. Stock DeepSpeed (0.19.8 and
0.17.6) keeps what its gradient stores held from an earlier step and applies it again:
on ZeRO-3, and on ZeRO-1/2 with CPU optimizer offload. Two ways to get there:
"sampled" (a head used in one step and not the next) and "zero_grad_between" (two
backwards over one forward, zero_grad() between them, the second loss never reaching
a head). And zero_grad() between the micro-steps of a window drops the earlier ones,
as torch's does. The negative controls pin the stock behaviour, so the fix is shown to matter.
"""

import deepspeed
import pytest
import torch

import multitask as mt
import zero_lifetime
from harness import BACKWARD_PATHS as PATHS
from harness import assert_weights_match, losses, make_input, make_pair
from multitask import STAGE_IDS, STAGES_OFFLOAD
from zero_lifetime.adapters import UnsupportedDeepSpeedError, grad_window

STEPS = len(mt.SAMPLED_TASKS)
COMPACT_BUFFER = hasattr(deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer,
                         "_use_compact_grad_partition_buffer")


def _train(stage, offload, mode, install=True, path="engine", clip=0.0):
    model, reference = mt.make_models()
    engine = mt.build_engine(model, stage, mode, offload, "fp32", clip=clip)
    if install:
        zero_lifetime.install(engine)
    mt.train_engine(engine, mode, STEPS, path=path)
    mt.train_reference(reference, mode, STEPS, clip=clip)
    return mt.max_differences(engine, reference)


@pytest.mark.parametrize("stage,offload", STAGES_OFFLOAD, ids=STAGE_IDS)
def test_head_left_out_of_a_step_stays_put(stage, offload):
    diffs = _train(stage, offload, "sampled")
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage,offload", STAGES_OFFLOAD, ids=STAGE_IDS)
def test_zero_grad_drops_the_first_backward_of_an_unreached_head(stage, offload, path):
    diffs = _train(stage, offload, "zero_grad_between", path=path)
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


@pytest.mark.parametrize("stage,offload", STAGES_OFFLOAD, ids=STAGE_IDS)
def test_zero_grad_inside_a_window_drops_its_earlier_micro_steps(stage, offload):
    """As torch: what came before zero_grad() is gone, reduced or not."""
    diffs = _train(stage, offload, "zero_grad_mid_window")
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


@pytest.mark.skipif(not COMPACT_BUFFER, reason="DeepSpeed 0.17.6 has no fp32 compact gradient buffer")
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
def test_zero_grad_inside_a_window_with_fp32_accumulation_of_bf16(offload):
    """ZeRO-2 bf16 with grad_accum_dtype fp32 sums micro-steps in a flat fp32 buffer: zero_grad()
    must empty it. Oracle: the same engine whose first micro-step has a zero loss (and no
    zero_grad()), and torch within bf16 tolerance."""

    def train(zero_first_loss):
        model, reference = mt.make_models()
        cfg = mt.config(2, "zero_grad_mid_window", offload, "bf16")
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        zero_lifetime.install(engine)
        assert engine.optimizer._use_compact_grad_partition_buffer(0)
        for step in range(STEPS):
            xs = [x.bfloat16() for x in mt.batches(step)]
            first = mt.task_loss(engine(xs[0], 0)) + mt.task_loss(engine(xs[0], 1))
            engine.backward(first * 0 if zero_first_loss else first)
            engine.step()
            if not zero_first_loss:
                engine.zero_grad()
            engine.backward(mt.task_loss(engine(xs[1], 1)))
            engine.step()
        mt.train_reference(reference, "zero_grad_mid_window", STEPS)
        return engine, reference

    engine, reference = train(False)
    twin, _ = train(True)
    got, want = mt.engine_weights(engine), mt.engine_weights(twin)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)
    diffs = mt.max_differences(engine, reference)
    assert max(diffs.values()) <= mt.tolerance("bf16"), diffs


@pytest.mark.parametrize("stage,offload", [(3, False), (3, True), (2, True)], ids=lambda v: str(v))
def test_gradient_norm_for_clipping_leaves_stale_gradients_out(stage, offload):
    """A stale gradient must not count in the norm that gradient clipping divides by."""
    unclipped, clipped = mt.make_models()[1], mt.make_models()[1]
    mt.train_reference(unclipped, "sampled", STEPS)
    mt.train_reference(clipped, "sampled", STEPS, clip=0.05)
    assert max((a - b).abs().max().item() for a, b in zip(unclipped.parameters(), clipped.parameters())) > 1e-3
    diffs = _train(stage, offload, "sampled", clip=0.05)
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


@pytest.mark.parametrize("stage,offload", [(3, False), (2, True)], ids=["stage3", "stage2-offload"])
def test_install_after_steps_were_taken(stage, offload):
    """The first step after install also clears what stock steps left behind."""
    model, reference = mt.make_models()
    engine = mt.build_engine(model, stage, "sampled", offload, "fp32")
    mt.train_engine(engine, "sampled", 1)  # stock: head 0 gets a gradient
    zero_lifetime.install(engine)
    for step in range(1, STEPS):  # heads 1 and 2 only
        x = mt.batches(step)
        engine.backward(sum(mt.task_loss(engine(x[t], t)) for t in mt.sampled_tasks(step)))
        engine.step()
    mt.train_reference(reference, "sampled", STEPS)
    diffs = mt.max_differences(engine, reference)
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


def test_nvme_offload_refuses_a_stale_gradient_before_clearing_anything(monkeypatch):
    """NVMe offload cannot run here (no aio), so its one question to DeepSpeed is faked: every
    fp32 subgroup swapped out. A step that would need a stale gradient cleared refuses, with
    the stores as they were, rather than clear half of them or apply the stale value."""
    model, _ = mt.make_models()
    engine = mt.build_engine(model, 3, "sampled", True, "fp32")
    zero_lifetime.install(engine)
    mt.train_engine(engine, "sampled", 1)  # head 0 gets a gradient, then none in step 1
    optimizer = engine.optimizer
    monkeypatch.setattr(optimizer, "_swappable_optimizer_subgroup", lambda group: True)
    x = mt.batches(1)
    engine.backward(sum(mt.task_loss(engine(x[t], t)) for t in mt.sampled_tasks(1)))
    grads = [flat.grad.clone() for flat in optimizer.fp32_partitioned_groups_flat]
    partitions = {i: g.clone() for i, g in getattr(optimizer, grad_window._Z3_GRAD_PARTITIONS).items()}
    assert any(g.abs().sum() > 0 for g in partitions.values())
    norms = dict(optimizer.norm_for_param_grads)
    weights = {name: p.ds_tensor.clone() for name, p in engine.module.named_parameters()}
    with pytest.raises(UnsupportedDeepSpeedError, match="NVMe"):
        engine.step()
    assert all(torch.equal(g, flat.grad) for g, flat in zip(grads, optimizer.fp32_partitioned_groups_flat))
    assert optimizer.norm_for_param_grads == norms
    after = getattr(optimizer, grad_window._Z3_GRAD_PARTITIONS)
    assert after.keys() == partitions.keys() and all(torch.equal(partitions[i], after[i]) for i in after)
    assert all(torch.equal(w, p.ds_tensor) for w, (_, p) in zip(weights.values(), engine.module.named_parameters()))


def _backward_zero_grad_step(stage, offload, install):
    """A backward whose batch is then dropped (zero_grad()) and a step() with no other backward."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {}))
    if install:
        zero_lifetime.install(engine)
    engine.backward(losses(engine(make_input("mlp_norm", 5)))[0])
    engine.zero_grad()
    engine.step()
    return engine, reference, ref_opt


@pytest.mark.parametrize("stage,offload", STAGES_OFFLOAD, ids=STAGE_IDS)
def test_step_after_zero_grad_applies_nothing(stage, offload):
    """torch: no gradient, no update. Stock DeepSpeed applies the dropped backward on every
    stage; ZeRO-1/2 without offload kept it in their reduced partitions."""
    engine, reference, ref_opt = _backward_zero_grad_step(stage, offload, install=True)
    assert_weights_match(engine, reference)
    x = make_input("mlp_norm", 6)
    engine.backward(losses(engine(x))[0])
    engine.step()
    losses(reference(x))[0].backward()
    ref_opt.step()
    assert_weights_match(engine, reference)


@pytest.mark.parametrize("stage", [1, 2])
def test_stock_step_after_zero_grad_applies_the_dropped_backward(stage):
    """Negative control for the test above, where only the reduced partitions held it."""
    engine, reference, _ = _backward_zero_grad_step(stage, False, install=False)
    with pytest.raises(AssertionError):
        assert_weights_match(engine, reference)


# Stock ZeRO-3 cannot run zero_grad_between at all: its second backward fails with the
# released-param size mismatch (test_retain_graph.py pins that).
STOCK_STALE = [(3, False, "sampled"), (3, True, "sampled"), (1, True, "sampled"), (2, True, "sampled"),
               (1, True, "zero_grad_between"), (2, True, "zero_grad_between")]


@pytest.mark.parametrize("stage,offload,mode", STOCK_STALE, ids=lambda v: str(v))
def test_stock_applies_a_stale_gradient(stage, offload, mode):
    """Negative control: stock DeepSpeed moves head 0 where torch leaves it."""
    diffs = _train(stage, offload, mode, install=False)
    stale = {name for name, d in diffs.items() if d > 1e-3}
    assert {"heads.0.weight", "heads.0.bias"} <= stale, diffs
