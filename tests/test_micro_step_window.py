"""No gradient lost across micro-steps: the multi-task loop on 1 rank, against torch.

Stages 1/2/3, with and without CPU optimizer offload, one backward per task (GAS 3)
and one summed backward (GAS 1), fp32 and bf16. The negative controls pin down what
stock DeepSpeed does (0.19.8 and 0.17.6 alike), so the fix is shown to matter.
"""

import pytest
import torch

import multitask as mt
import zero_lifetime
from harness import BACKWARD_PATHS, assert_weights_match, losses, make_input, make_pair

STEPS = 3


def _train(stage, mode, offload, dtype, install=True, path="engine"):
    model, reference = mt.make_models()
    engine = mt.build_engine(model, stage, mode, offload, dtype)
    if install:
        zero_lifetime.install(engine)
    mt.train_engine(engine, mode, STEPS, dtype=dtype, path=path)
    mt.train_reference(reference, mode, STEPS)
    return engine, reference


@pytest.mark.parametrize("mode", ["per_task", "summed"])
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_matches_torch(stage, offload, mode):
    engine, reference = _train(stage, mode, offload, "fp32")
    diffs = mt.max_differences(engine, reference)
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_offload_equals_no_offload_and_tracks_torch(stage):
    with_offload, reference = _train(stage, "per_task", True, "bf16")
    without_offload, _ = _train(stage, "per_task", False, "bf16")
    got, want = mt.engine_weights(with_offload), mt.engine_weights(without_offload)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)
    diffs = mt.max_differences(with_offload, reference)
    assert max(diffs.values()) <= mt.tolerance("bf16"), diffs


@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("stage,offload", mt.STAGES_OFFLOAD, ids=mt.STAGE_IDS)
def test_head_first_reached_by_a_later_backward_of_the_step(stage, offload, path):
    """GAS 1, one retained backward per head. With ZeRO-1/2 CPU offload a head first reached by
    the second or third backward was stepped with its previous step's gradient added (the fp32
    gradient place kept across the backwards held it)."""
    engine, reference = _train(stage, "head_per_backward", offload, "fp32", path=path)
    diffs = mt.max_differences(engine, reference)
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_head_moves(stage):
    """The reported symptom: heads 0 and 1 never updated under offload."""
    model, _ = mt.make_models()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = mt.build_engine(model, stage, "per_task", True, "fp32")
    zero_lifetime.install(engine)
    mt.train_engine(engine, "per_task", 1)
    moved = {n: (w - initial[n]).abs().max().item() for n, w in mt.engine_weights(engine).items()}
    assert all(m > 1e-4 for m in moved.values()), moved


def test_stock_offload_loses_early_heads():
    """Negative control: stock ZeRO-2 + offload never updates the heads of tasks 0 and 1."""
    model, _ = mt.make_models()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = mt.build_engine(model, 2, "per_task", True, "fp32")
    mt.train_engine(engine, "per_task", 1)
    moved = {n: (w - initial[n]).abs().max().item() for n, w in mt.engine_weights(engine).items()}
    assert moved["heads.0.weight"] == 0 and moved["heads.1.weight"] == 0, moved
    assert moved["heads.2.weight"] > 1e-4 and moved["trunk.weight"] > 1e-4, moved


def test_stock_stage3_adds_stale_gradients():
    """Negative control: stock ZeRO-3 adds the previous window's gradient to a head first
    seen in a later micro-step, from the second step on."""
    engine, reference = _train(3, "per_task", False, "fp32", install=False)
    diffs = mt.max_differences(engine, reference)
    assert diffs["heads.0.weight"] <= 1e-5, diffs  # first micro-step: DeepSpeed copies
    assert diffs["heads.1.weight"] > 1e-3, diffs


def test_uninstall_restores_stock_window():
    model, _ = mt.make_models()
    engine = mt.build_engine(model, 1, "per_task", True, "fp32")
    optimizer = engine.optimizer
    # DeepSpeed 0.17.6 sets its buckets up in backward_prologue (setup_buckets from 0.18.3).
    setup = "setup_buckets" if hasattr(optimizer, "setup_buckets") else "backward_prologue"
    before = {name: getattr(optimizer, name) for name in
              ("independent_gradient_partition_epilogue", "reduce_gradients", setup)}
    zero_lifetime.install(engine)
    assert all(getattr(optimizer, n) != f for n, f in before.items())
    zero_lifetime.uninstall(engine)
    for name, function in before.items():
        assert getattr(optimizer, name) == function, name
        assert name not in optimizer.__dict__, name


@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_inside_a_window_then_a_head_only_its_micro_step_reaches(stage, offload):
    """GAS 2, split_heads: a backward, zero_grad() inside the window, then head_b's loss in that
    micro-step and head_a's in the closing one. ZeRO-1 readies its buckets once a window and
    releases them only at the closing epilogue; zero_grad() reset the micro step but left them
    ready, so no later backward advanced it and each looked like the window's first. With
    offload, step() then took head_b for a param with no gradient in the window and zeroed it
    (0.09-0.2 off torch on every supported release). Oracle: torch, each loss divided by 2."""
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    engine, reference, ref_opt = make_pair("split_heads", stage, gas=2, **zero)
    zero_lifetime.install(engine)
    for seed, which in enumerate(["head_a", "zero_grad", "head_b", "step", "head_a", "step"]):
        if which == "zero_grad":
            engine.zero_grad()
            ref_opt.zero_grad()
        elif which == "step":
            engine.step()
        else:
            x = make_input("split_heads", seed)
            loss = 0 if which == "head_a" else 1
            engine.backward(losses(engine(x))[loss])
            (losses(reference(x))[loss] / 2).backward()
    ref_opt.step()
    assert_weights_match(engine, reference)
