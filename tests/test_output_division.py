"""An engine output computed from another output, with gradient accumulation, against torch.

A transformers model returns its ``loss`` and the ``logits`` it computed the loss from. DeepSpeed
0.18.9 and 0.19.8 divide the gradient arriving at each forward output by
gradient_accumulation_steps (on the torch-style path; 0.18.9's engine.backward too), and on
ZeRO-1/2 the outputs are the model's own tensors: the loss's gradient is divided at the loss and
again at the logits inside the model, so with GAS 2 the model trains on a quarter of torch's
``(loss / 2).backward()`` (DeepSpeed #7718). The oracle: the same model in plain torch,
``(loss / GAS).backward()`` per micro step and one SGD step per window.
"""

import copy
import warnings

import deepspeed
import pytest
import torch
from transformers.modeling_outputs import CausalLMOutput

import zero_lifetime
from harness import BACKWARD_PATHS, DS_VERSION, TORCH_STYLE_BACKWARD, assert_weights_match, backward_by, ds_config

GAS, WINDOWS = 2, 2

# Where the engine's division at its outputs applies (0.17.6 divides the loss in engine.backward).
OUTPUT_DIVISION_PATHS = (["manual", "scale"] if TORCH_STYLE_BACKWARD else []) + (["engine"] if DS_VERSION == "0.18.9"
                                                                                   else [])


class LossAndLogits(torch.nn.Module):
    """Returns the logits and the loss computed from them, in ``wrap`` (a dict by default)."""

    def __init__(self, wrap=lambda loss, logits: {"loss": loss, "logits": logits}):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.wrap = wrap

    def forward(self, x):
        logits = self.l2(torch.tanh(self.l1(x)))
        return self.wrap(logits.pow(2).mean(), logits)


def _loss_of(out, use):
    """The caller's loss: the model's loss, a term of its own off the logits, or both."""
    logits_term = 0.1 * (out["logits"] * torch.linspace(-1, 1, 4)).sum()
    return {"loss": out["loss"], "logits": logits_term, "both": out["loss"] + logits_term}[use]


def _train(model, stage, path, loss_of, install=True, windows=WINDOWS, backward=None):
    """(engine, torch reference) after ``windows`` windows of GAS micro steps; ``backward(engine,
    loss, window)`` instead of one on ``path``."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    cfg = ds_config(stage, gas=GAS)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    if install:
        zero_lifetime.install(engine)
    optimizer = torch.optim.SGD(reference.parameters(), lr=cfg["optimizer"]["params"]["lr"])
    for window in range(windows):
        for micro in range(GAS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * window + micro))
            if backward is None:
                backward_by(engine, loss_of(engine(x)), path)
            else:
                backward(engine, loss_of(engine(x)), window)
            engine.step()
            (loss_of(reference(x)) / GAS).backward()
        optimizer.step()
        optimizer.zero_grad()
    return engine, reference


@pytest.mark.skipif(not OUTPUT_DIVISION_PATHS, reason="this DeepSpeed divides the loss, not the outputs")
@pytest.mark.parametrize("use", ["loss", "logits", "both"])
@pytest.mark.parametrize("path", OUTPUT_DIVISION_PATHS or ["none"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_loss_computed_from_returned_logits_is_divided_once(stage, path, use):
    torch.manual_seed(0)
    engine, reference = _train(LossAndLogits(), stage, path, lambda out: _loss_of(out, use))
    assert_weights_match(engine, reference)


@pytest.mark.skipif(not OUTPUT_DIVISION_PATHS, reason="this DeepSpeed divides the loss, not the outputs")
@pytest.mark.parametrize("stage", [1, 2])
def test_stock_divides_the_loss_twice(stage):
    """Negative control: the bug this fix is for, on stock ZeRO-1/2. Each weight moves half
    as far as torch's in one window (SGD from the same start: a quarter of the gradient, not
    a half)."""
    torch.manual_seed(0)
    model = LossAndLogits()
    initial = copy.deepcopy(model)
    engine, reference = _train(model, stage, OUTPUT_DIVISION_PATHS[0], lambda out: out["loss"], install=False,
                               windows=1)
    with pytest.raises(AssertionError):
        assert_weights_match(engine, reference)
    stock_step = engine.module.l2.weight.detach() - initial.l2.weight.detach()
    torch_step = reference.l2.weight.detach() - initial.l2.weight.detach()
    torch.testing.assert_close(stock_step, torch_step / 2, atol=1e-6, rtol=2e-2)


@pytest.mark.skipif(not OUTPUT_DIVISION_PATHS, reason="this DeepSpeed divides the loss, not the outputs")
@pytest.mark.parametrize("container", ["model_output", "tuple_twice", "nested"])
@pytest.mark.parametrize("stage", [1, 3])
def test_outputs_in_other_containers(stage, container):
    """A transformers ModelOutput; one tensor returned twice (DeepSpeed hooks it twice);
    the loss and logits nested in a list inside a dict."""
    wrap, read = {
        "model_output": (lambda loss, logits: CausalLMOutput(loss=loss, logits=logits), lambda out: out),
        "tuple_twice": (lambda loss, logits: (logits, logits),
                        lambda out: {"loss": out[0].pow(2).mean(), "logits": out[1]}),
        "nested": (lambda loss, logits: {"all": [loss, {"logits": logits}]},
                   lambda out: {"loss": out["all"][0], "logits": out["all"][1]["logits"]}),
    }[container]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every container here is copied
        engine, reference = _train(LossAndLogits(wrap), stage, OUTPUT_DIVISION_PATHS[0],
                                   lambda out: _loss_of(read(out), "both"))
    assert_weights_match(engine, reference)


class _Pair(tuple):
    """A tuple type whose constructor takes two arguments, not an iterable."""

    def __new__(cls, first, second):
        return super().__new__(cls, (first, second))


@pytest.mark.skipif(not OUTPUT_DIVISION_PATHS, reason="this DeepSpeed divides the loss, not the outputs")
def test_output_container_that_cannot_be_copied_warns_once():
    model = LossAndLogits(lambda loss, logits: _Pair(loss, logits))
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(2, gas=GAS), model_parameters=model.parameters())
    zero_lifetime.install(engine)
    x = torch.randn(4, 8)
    with pytest.warns(RuntimeWarning, match="could not copy a container in this engine's output"):
        out = engine(x)
    assert type(out) is _Pair and out[1] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        engine(x)  # once per engine
        # One output in it: nothing can be divided twice, nothing to say.
        single, *_ = deepspeed.initialize(model=LossAndLogits(lambda loss, logits: _Pair(loss, None)),
                                          config=ds_config(2, gas=GAS))
        zero_lifetime.install(single)
        single(x)


@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_retained_backwards_of_loss_and_logits(stage, path):
    """Two backwards over one forward (the model's loss, then a term off its logits), GAS 2."""
    torch.manual_seed(0)
    model = LossAndLogits()
    reference = copy.deepcopy(model)
    cfg = ds_config(stage, gas=GAS)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    zero_lifetime.install(engine)
    optimizer = torch.optim.SGD(reference.parameters(), lr=cfg["optimizer"]["params"]["lr"])
    for window in range(WINDOWS):
        for micro in range(GAS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * window + micro))
            out = engine(x)
            backward_by(engine, _loss_of(out, "loss"), path, retain_graph=True)
            backward_by(engine, _loss_of(out, "logits"), path)
            engine.step()
            ref_out = reference(x)
            (_loss_of(ref_out, "loss") / GAS).backward(retain_graph=True)
            (_loss_of(ref_out, "logits") / GAS).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_weights_match(engine, reference)


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="no output hooks on this DeepSpeed")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_input_gradient_through_returned_outputs_is_not_divided(stage):
    """torch.autograd.grad through the views (a saliency map) gives torch's input gradient,
    GAS 2 or not: the views carry the rule that only accumulating passes divide."""
    torch.manual_seed(0)
    model = LossAndLogits()
    reference = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, gas=GAS), model_parameters=model.parameters())
    zero_lifetime.install(engine)
    x = torch.randn(4, 8, requires_grad=True)
    got, = torch.autograd.grad(_loss_of(engine(x), "both"), [x])
    want, = torch.autograd.grad(_loss_of(reference(x), "both"), [x])
    torch.testing.assert_close(got, want)


def _unscaled_engine_backward_then_plain(engine, loss, window):
    """A window of ``engine.backward(loss / GAS, scale_wrt_gas=False)`` (the transformers
    Trainer's call), then one of plain ``loss.backward()`` through engine(...): torch's
    ``(loss / GAS).backward()`` in both."""
    if window == 0:
        engine.backward(loss / GAS, scale_wrt_gas=False)
    else:
        loss.backward()


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="this DeepSpeed has no plain loss.backward() path")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plain_backward_after_an_unscaled_engine_backward_is_divided(stage):
    engine, reference = _train(LossAndLogits(), stage, None, lambda out: out["loss"],
                               backward=_unscaled_engine_backward_then_plain)
    assert_weights_match(engine, reference)


@pytest.mark.skipif(DS_VERSION != "0.18.9", reason="0.18.9 keeps engine.backward's scale_wrt_gas for later backwards")
def test_stock_0_18_9_plain_backward_after_an_unscaled_engine_backward_is_not_divided():
    """Negative control: stock 0.18.9 keeps the last engine.backward's scale_wrt_gas=False,
    and its output hooks then leave every later plain backward undivided (ZeRO-3: no
    output divided twice here)."""
    engine, reference = _train(LossAndLogits(), 3, None, lambda out: out["loss"], install=False,
                               backward=_unscaled_engine_backward_then_plain)
    with pytest.raises(AssertionError, match="l1.weight"):
        assert_weights_match(engine, reference)
