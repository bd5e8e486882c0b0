"""A plain ``loss.backward()`` over a forward that bypassed the engine (``engine.module(x)``,
or a method of the model called directly); 1 rank, against torch.

DeepSpeed runs its backward prologue and the division by gradient_accumulation_steps from hooks
that engine.forward puts on the outputs. Stock, such a backward reduces nothing and step() fails
(KeyError: 0). Installed, with GAS 1 it trains like torch; with GAS > 1, where nothing divides
it, it is refused after the backward and the window's gradients dropped (before the refusal the
installed engine trained on them undivided, without a word).
"""

import pytest
import torch

import zero_lifetime
from deepspeed.runtime.engine import DeepSpeedEngine
from harness import (TORCH_STYLE_BACKWARD, assert_weights_match, losses, make_input, make_pair,
                     released_state)
from zero_lifetime.plain_backward import GradientsNotDividedError

pytestmark = pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="this DeepSpeed refuses loss.backward() "
                                "outside engine.backward (tests/test_retain_graph.py)")


def _layers_by_hand(model, x):
    """MLPNorm's forward, written out: the root module's forward (and its hooks) never runs."""
    return model.l2(model.ln(torch.relu(model.l1(x))))


FORWARDS = {
    "module": lambda engine, x: engine.module(x),
    "method": lambda engine, x: _layers_by_hand(engine.module, x),
    # What a PipelineEngine stage (or any engine subclass) does: DeepSpeed's forward, not the
    # instance's. DeepSpeed's output hooks run its prologue and divide: nothing more must.
    "deepspeed_forward": lambda engine, x: DeepSpeedEngine.forward(engine, x),
}


def _backward(out, backwards: int) -> None:
    l1, l2 = losses(out)
    if backwards == 2:
        l1.backward(retain_graph=True)
        l2.backward()
    else:
        (l1 + l2).backward()


def _reference_micro_step(reference, x, gas: int) -> None:
    (sum(losses(reference(x))) / gas).backward()


@pytest.mark.parametrize("backwards", [1, 2], ids=["one_backward", "two_backwards"])
@pytest.mark.parametrize("forward", ["module", "method", "deepspeed_forward"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plain_backward_trains_like_torch_at_gas_1(stage, forward, backwards):
    engine, reference, ref_opt = make_pair("mlp_norm", stage)
    zero_lifetime.install(engine)
    for step in range(3):
        x = make_input("mlp_norm", step)
        _backward(FORWARDS[forward](engine, x), backwards)
        engine.step()
        _reference_micro_step(reference, x, 1)
        ref_opt.step()
        ref_opt.zero_grad()
        assert_weights_match(engine, reference)
        if stage == 3:
            assert released_state(engine) == ([], [])


@pytest.mark.parametrize("gas", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_own_forward_divides_like_torch_at_gas_above_1(stage, gas):
    """Negative control for the refusal below: DeepSpeed's forward without the instance's
    wrapper (a pipeline stage's) still divides, so nothing is refused."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage, gas=gas)
    zero_lifetime.install(engine)
    for micro in range(2 * gas):
        x = make_input("mlp_norm", micro)
        _backward(FORWARDS["deepspeed_forward"](engine, x), 1)
        engine.step()
        _reference_micro_step(reference, x, gas)
        if (micro + 1) % gas == 0:
            ref_opt.step()
            ref_opt.zero_grad()
    assert_weights_match(engine, reference)


@pytest.mark.parametrize("forward", ["module", "method"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stock_fails_at_step_with_nothing_reduced(stage, forward):
    """Why: stock DeepSpeed never ran its prologue or epilogue for this backward."""
    engine, _, _ = make_pair("mlp_norm", stage)
    _backward(FORWARDS[forward](engine, make_input("mlp_norm", 0)), 1)
    with pytest.raises(KeyError):
        engine.step()


@pytest.mark.parametrize("refused_micro_step", [0, 1], ids=["first_of_window", "after_a_good_one"])
@pytest.mark.parametrize("forward", ["module", "method"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_undivided_backward_at_gas_2_is_refused_and_its_window_dropped(stage, forward, refused_micro_step):
    """The refused window applies nothing (not even the good micro-step before the refused
    one); the windows after it train like torch."""
    gas = 2
    engine, reference, ref_opt = make_pair("mlp_norm", stage, gas=gas)
    zero_lifetime.install(engine)
    for micro in range(3 * gas):
        x = make_input("mlp_norm", micro)
        if micro == refused_micro_step:
            with pytest.raises(GradientsNotDividedError, match="gradient_accumulation_steps=2"):
                _backward(FORWARDS[forward](engine, x), 1)
        else:
            engine.backward(sum(losses(engine(x))))
            if micro > refused_micro_step:  # what came before the refusal was dropped
                _reference_micro_step(reference, x, gas)
        engine.step()
        if (micro + 1) % gas == 0:
            ref_opt.step()
            ref_opt.zero_grad()
            # At boundaries only: after a forward without the root's hooks, DeepSpeed's module
            # trace spans two micro-steps and keeps some params gathered up to the next
            # boundary, stock too (docs/reliability.md).
            if stage == 3:
                assert released_state(engine) == ([], [])
    assert_weights_match(engine, reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_backward_over_the_module_forward_is_not_refused(stage):
    """engine.backward(loss) divides the loss itself on this DeepSpeed (0.19.8), or divides
    nothing as stock does (0.18.9, tests/test_module_forward.py): DeepSpeed's call either way."""
    engine, _, _ = make_pair("mlp_norm", stage, gas=2)
    zero_lifetime.install(engine)
    for micro in range(2):
        engine.backward(sum(losses(engine.module(make_input("mlp_norm", micro)))))
        engine.step()
