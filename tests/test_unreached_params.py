"""A param with no gradient since the last step or zero_grad() must not move: 1 rank, against torch.

torch leaves such a param's .grad None and SGD skips it. Stock DeepSpeed (0.19.8 and
0.17.6) keeps what its gradient stores held from an earlier step and applies it again:
on ZeRO-3, and on ZeRO-1/2 with CPU optimizer offload. Two ways to get there:
"sampled" (a head used in one step and not the next) and "zero_grad_between" (two
backwards over one forward, zero_grad() between them, the second loss never reaching
a head). The negative controls pin the stock behaviour, so the fix is shown to matter.
"""

import pytest
import torch

import multitask as mt
import zero_lifetime
from harness import TORCH_STYLE_BACKWARD

STEPS = len(mt.SAMPLED_TASKS)
STAGES_OFFLOAD = [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
STAGE_IDS = [f"stage{s}-{'offload' if o else 'no_offload'}" for s, o in STAGES_OFFLOAD]
# DeepSpeed 0.17.6 refuses loss.backward() (test_retain_graph.py pins the refusal).
PATHS = ["engine", "manual"] if TORCH_STYLE_BACKWARD else ["engine"]


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
