"""Several engine forwards, one backward through all their outputs: 1 rank, against torch.

Multi-task code often calls the model once per task and backpropagates the summed
losses. DeepSpeed 0.19.8 runs its backward prologue from hooks on each forward's
outputs, so such a backward runs it once per forward; its backward depth then ends
at 2 and it skips the epilogue: nothing is reduced and step() fails (`KeyError`,
pinned below). Installed, one prologue runs per backward. The engine path
(engine.backward) works on stock and must keep working.
"""

import pytest
import torch

import multitask as mt
import zero_lifetime
from harness import BACKWARD_PATHS as PATHS, DS_VERSION, TORCH_STYLE_BACKWARD, backward_both, reference_step_both
from multitask import STAGE_IDS, STAGES_OFFLOAD

STEPS = 3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage,offload", STAGES_OFFLOAD, ids=STAGE_IDS)
def test_one_backward_over_a_forward_per_task(stage, offload, path):
    model, reference = mt.make_models()
    engine = mt.build_engine(model, stage, "summed", offload, "fp32")
    zero_lifetime.install(engine)
    mt.train_engine(engine, "summed", STEPS, path=path)
    mt.train_reference(reference, "summed", STEPS)
    diffs = mt.max_differences(engine, reference)
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


def _two_forward_losses(model, xs):
    return mt.zero_grad_between_losses((model(xs[0], 0), model(xs[1], 1)))


@pytest.mark.parametrize("zero_grad", [True, False], ids=["zero_grad", "no_zero_grad"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_retained_backwards_over_two_forwards(stage, path, zero_grad):
    """Two backwards over two forwards; with zero_grad() the second never reaches head 0."""
    model, reference = mt.make_models()
    engine = mt.build_engine(model, stage, "summed", False, "fp32")
    zero_lifetime.install(engine)
    opt = torch.optim.SGD(reference.parameters(), lr=mt.LR)
    for step in range(STEPS):
        xs = mt.batches(step)
        backward_both(engine, *_two_forward_losses(engine, xs), path, zero_grad)
        engine.step()
        reference_step_both(opt, *_two_forward_losses(reference, xs), zero_grad)
    diffs = mt.max_differences(engine, reference)
    assert max(diffs.values()) <= mt.tolerance("fp32"), diffs


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="DeepSpeed 0.17.6 has no loss.backward() path")
@pytest.mark.parametrize("stage", [1, 3])
def test_stock_never_reduces_a_plain_backward_over_two_forwards(stage):
    """Negative control: stock 0.19.8 skips the epilogue; step() finds no reduced gradients.
    Stock 0.18.9 runs one prologue and one epilogue there and trains as torch does (measured)."""
    model, reference = mt.make_models()
    engine = mt.build_engine(model, stage, "summed", False, "fp32")
    if DS_VERSION == "0.18.9":
        mt.train_engine(engine, "summed", 2, path="manual")
        mt.train_reference(reference, "summed", 2)
        assert max(mt.max_differences(engine, reference).values()) <= mt.tolerance("fp32")
        return
    with pytest.raises(KeyError):
        mt.train_engine(engine, "summed", 1, path="manual")
