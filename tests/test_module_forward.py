"""Forwards through the user's own module (``engine.module(x)``, or the model object passed to
``deepspeed.initialize``) instead of the engine, then ``engine.backward``; 1 rank, against torch.

engine.forward resets DeepSpeed's per-forward backward state (and on ZeRO-3 advances the micro
step); a forward that bypasses it resets nothing, and engine.backward over it runs DeepSpeed's
epilogue but no prologue. Stock ZeRO-3 then never advances its micro step: each backward of an
accumulation window overwrote the one before, without an error (and two retained backwards fail
on the released params). Installed, a backward that follows an ended one starts a new micro step
however the forward ran.
"""

import pytest
import torch

import zero_lifetime
from harness import (DS_VERSION, assert_weights_match, losses, make_input, make_pair, released_state,
                     two_backwards_step_like_torch)


def _bypassing_forward(engine, through):
    """A forward that bypasses engine.forward: the module itself, or torch.func.functional_call
    with the module's own params."""
    module = engine.module
    if through == "module":
        return module
    return lambda x: torch.func.functional_call(module, dict(module.named_parameters()), (x,))


def _steps(engine, reference, ref_opt, stage, gas, backwards, steps=2, forward=None, divided=True):
    """engine.backward divides the loss by gradient_accumulation_steps, as torch's
    ``(loss / gas).backward()`` (stock 0.18.9 divides only at engine.forward's outputs,
    so nothing over these forwards: test below; ``divided=False`` for its oracle)."""
    forward = forward or engine.module
    for step in range(steps):
        for micro in range(gas):
            x = make_input("mlp_norm", 10 * step + micro)
            l1, l2 = losses(forward(x))
            if backwards == 2:
                engine.backward(l1, retain_graph=True)
                engine.backward(l2)
            else:
                engine.backward(l1 + l2)
            engine.step()
            r1, r2 = losses(reference(x))
            ((r1 + r2) / (gas if divided else 1)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_weights_match(engine, reference)
        if stage == 3:
            assert released_state(engine) == ([], [])


@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize("gas", [1, 2], ids=["gas1", "gas2"])
@pytest.mark.parametrize("backwards", [1, 2], ids=["one_backward", "two_backwards"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_forward_through_the_module_trains_like_torch(stage, backwards, gas, offload):
    if offload and stage == 2 and gas > 1 and backwards == 2 and DS_VERSION != "0.19.8":
        pytest.skip("this release's offload accumulators keep one backward per micro-step: a second "
                    "is refused (README, Limitations)")
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    engine, reference, ref_opt = make_pair("mlp_norm", stage, gas=gas, **zero)
    zero_lifetime.install(engine)
    _steps(engine, reference, ref_opt, stage, gas, backwards)


@pytest.mark.parametrize("backwards", [1, 2], ids=["one_backward", "two_backwards"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_functional_call_trains_like_torch(stage, backwards):
    engine, reference, ref_opt = make_pair("mlp_norm", stage, gas=2)
    zero_lifetime.install(engine)
    _steps(engine, reference, ref_opt, stage, 2, backwards, forward=_bypassing_forward(engine, "functional_call"))


@pytest.mark.skipif(DS_VERSION != "0.18.9", reason="0.19.8 and 0.17.6 divide the loss in engine.backward")
@pytest.mark.parametrize("through", ["module", "functional_call"])
@pytest.mark.parametrize("stage", [1, 2])
def test_stock_0_18_9_engine_backward_over_such_a_forward_divides_nothing(stage, through):
    """Why installed 0.18.9 divides the loss itself: stock trains on GAS times torch's
    gradient there, without an error. (ZeRO-3 stock overwrites micro steps: test above.)"""
    engine, reference, ref_opt = make_pair("mlp_norm", stage, gas=2)
    with pytest.raises(AssertionError, match="l1.weight"):
        _steps(engine, reference, ref_opt, stage, 2, backwards=1, steps=1, forward=_bypassing_forward(engine, through))
    # Against torch's undivided loss it matches: the whole difference is the missing division.
    engine, reference, ref_opt = make_pair("mlp_norm", stage, gas=2)
    _steps(engine, reference, ref_opt, stage, 2, backwards=1, steps=1, forward=_bypassing_forward(engine, through),
           divided=False)


@pytest.mark.skipif(DS_VERSION == "0.17.6", reason="0.17.6 advances ZeRO-3's micro step in its epilogue, "
                    "not at engine.forward: stock accumulates over such forwards like torch")
def test_stock_zero3_accumulation_over_forwards_through_the_module_keeps_only_the_last_micro_step():
    """Why: stock gives no error there, and wrong weights."""
    engine, reference, ref_opt = make_pair("mlp_norm", 3, gas=2)
    with pytest.raises(AssertionError, match="l1.weight"):
        _steps(engine, reference, ref_opt, 3, gas=2, backwards=1, steps=1)


@pytest.mark.parametrize("model_name", ["mlp_norm", "tied_lm", "ckpt_nonreentrant", "raw_alias"])
def test_pin_over_forwards_through_the_module_pins_as_over_the_engines_forward(model_name):
    """Such a forward runs under install's saved-tensor hooks too (pushed by its outermost
    module): it pins what the engine's forward pins, gathers nothing again, and the weights
    follow torch."""
    figures = {}
    for through in ("module", "engine"):
        engine, reference, ref_opt = make_pair(model_name, 3)
        zero_lifetime.install(engine, policy="pin")
        forward = engine.module if through == "module" else engine
        for step in range(2):
            x = make_input(model_name, step)
            two_backwards_step_like_torch(engine, forward(x), reference, ref_opt, reference(x))
        stats = zero_lifetime.stats(engine)
        figures[through] = (stats["peak_pinned_bytes"], stats["regathers"])
    assert figures["module"] == figures["engine"]
    assert figures["module"][0] > 0
