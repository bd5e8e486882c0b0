"""A backward through a graph saved before the last optimizer step, on real engines (1 rank).

torch refuses it (the step modified saved params in place). Stock DeepSpeed does not:
ZeRO-1/2 write the new weights through ``.data``, which torch's version check does not see,
so the old graph runs with the new weights, silently; ZeRO-3 crashes on the released params.
Installed, every stage refuses it as torch does, and training goes on from the next forward.
"""

import gc

import pytest
import torch

import zero_lifetime
from harness import (TORCH_STYLE_BACKWARD, assert_weights_match, losses, make_input, make_pair, reference_two_backwards,
                     released_state, two_backwards)

INPLACE = "modified by an inplace operation"  # torch's words; zero_lifetime's ZeRO-3 message quotes them
ACCELERATE_STEPPED = "accelerate's backward() also calls engine.step()"
EAGER_RELEASE = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def _stale_backward_raises(backward_l1, step, backward_l2):
    backward_l1()
    step()
    with pytest.raises(RuntimeError, match=INPLACE) as refused:
        backward_l2()
    assert not getattr(refused.value, "__notes__", None)  # the caller's own step(): nothing to explain


def _both_losses_through_accelerate(engine, accelerator, out):
    """A plain-torch habit: both losses through accelerator.backward, the first retained."""
    from test_hf_trainer import second_loss
    accelerator.backward(out.loss, retain_graph=True)
    accelerator.backward(second_loss(out.logits))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stale_graph_after_accelerates_own_step_says_so(stage):
    """accelerate's backward() steps the engine when gradients sync (every backward at GAS 1):
    the refusal of the second backward says that the step was accelerate's, and what to do."""
    pytest.importorskip("accelerate")
    from test_accumulation_boundary_by_hand import _accelerate_run
    with pytest.raises(RuntimeError, match=INPLACE) as refused:
        _accelerate_run(stage, 1, _both_losses_through_accelerate, install=True)
    assert _times_said(refused.value) == 1  # in the note, or in ZeRO-3's refusal itself


def _times_said(error) -> int:
    return "\n".join([str(error), *getattr(error, "__notes__", [])]).count(ACCELERATE_STEPPED)


def _second_loss_by_torch(engine, accelerator, out):
    from test_hf_trainer import second_loss
    accelerator.backward(out.loss, retain_graph=True)
    second_loss(out.logits).backward()


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="this DeepSpeed refuses loss.backward() installed")
def test_stale_graph_after_accelerates_own_step_says_so_under_loss_backward():
    """ZeRO-3's refusal is raised inside autograd, where no wrapper of ours can add a note to
    what loss.backward() raises: the tracker's message itself says whose step it was."""
    pytest.importorskip("accelerate")
    from test_accumulation_boundary_by_hand import _accelerate_run
    with pytest.raises(RuntimeError, match=INPLACE) as refused:
        _accelerate_run(3, 1, _second_loss_by_torch, install=True)
    assert _times_said(refused.value) == 1


@pytest.mark.parametrize("stage, policy", [(1, "regather"), (2, "regather"), (3, "regather"), (3, "pin")])
def test_backward_through_a_graph_from_before_step_is_refused_like_torch(stage, policy):
    engine, reference, ref_opt = make_pair("mlp_norm", stage, **(EAGER_RELEASE if stage == 3 else {}))
    zero_lifetime.install(engine, policy=policy)
    x = make_input("mlp_norm", 0)

    r1, r2 = losses(reference(x))  # the oracle refuses it first
    _stale_backward_raises(lambda: r1.backward(retain_graph=True), ref_opt.step, r2.backward)
    e1, e2 = losses(engine(x))
    _stale_backward_raises(lambda: engine.backward(e1, retain_graph=True), engine.step,
                           lambda: engine.backward(e2))

    # Training goes on: the refused backward's partial gradients are dropped on both sides.
    del r1, r2, e1, e2
    ref_opt.zero_grad()
    engine.zero_grad()
    for step in range(1, 3):
        x = make_input("mlp_norm", step)
        two_backwards(engine, engine(x), "engine", zero_grad=False)
        engine.step()
        reference_two_backwards(reference, ref_opt, x, zero_grad=False)
    assert_weights_match(engine, reference)
    if stage == 3:
        gc.collect()
        assert zero_lifetime.stats(engine)["live_handles"] == 0
        assert released_state(engine) == ([], [])


@pytest.mark.parametrize("stage", [1, 2])
def test_stock_zero12_runs_the_stale_graph_silently(stage):
    """Negative control: what install changes (stock trains on with a gradient torch refuses)."""
    engine, *_ = make_pair("mlp_norm", stage)
    l1, l2 = losses(engine(make_input("mlp_norm", 0)))
    engine.backward(l1, retain_graph=True)
    engine.step()
    engine.backward(l2)  # no error
    engine.step()


def test_a_step_that_changed_nothing_keeps_the_graph():
    """Only a step that updated the weights invalidates: a step() at a non-boundary micro
    step of gradient accumulation applies nothing (DeepSpeed's was_step_applied())."""
    engine, *_ = make_pair("mlp_norm", 2, gas=2)
    zero_lifetime.install(engine)
    x = make_input("mlp_norm", 0).requires_grad_()
    l1, l2 = losses(engine(x))
    engine.backward(l1, retain_graph=True)
    engine.step()
    assert not engine.was_step_applied()
    (x_grad, ) = torch.autograd.grad(l2, [x])  # through every layer: unpacks the saved params
    assert x_grad.abs().sum() > 0


@pytest.mark.parametrize("stage", [2, 3])
def test_a_step_skipped_on_fp16_overflow_keeps_the_graph(stage):
    """An fp16 step skipped on overflow changed no weight: the retained graph stays usable,
    as torch's GradScaler leaves the params untouched when it skips."""
    import fp16_scaling
    import multitask as mt
    model, _ = mt.make_models()
    engine = fp16_scaling.build_engine(model.half(), stage, offload=False, bucket=100)
    zero_lifetime.install(engine)
    out = engine(mt.batches(0)[0].half(), (0, 1))
    first, second = mt.zero_grad_between_losses(out)
    engine.backward(first * fp16_scaling.BOOST, retain_graph=True)  # overflows
    engine.step()
    assert not engine.was_step_applied()
    engine.backward(second)  # through the same graph: no refusal
    engine.step()
    assert engine.was_step_applied()
