"""Training patterns users run on DeepSpeed, installed, against plain torch (1 rank, stages 1-3).

Each was first tried as a scratch test (docs/reliability.md, "User patterns the suite did not
reach"); they passed installed and are kept so that they stay so.
"""

import contextlib

import deepspeed
import pytest
import torch

import zero_lifetime
from harness import (DS_VERSION, TORCH_STYLE_BACKWARD, MLPNorm, assert_weights_match, losses, make_input, make_pair,
                     released_state)

SMALL_LR = {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
needs_torch_style = pytest.mark.skipif(not TORCH_STYLE_BACKWARD,
                                       reason="DeepSpeed 0.17.6 reduces only inside engine.backward(loss)")


def _finish(engine, reference, ref_opt, stage, **tolerance):
    engine.step()
    ref_opt.step()
    ref_opt.zero_grad()
    assert_weights_match(engine, reference, **tolerance)
    if stage == 3:
        assert released_state(engine) == ([], [])


@needs_torch_style
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_cache(stage):
    """GradCache (sentence-transformers' cached losses): representations without grad, the
    loss's gradient for them, then per chunk a forward with grad and a backward of the cached
    gradient through its outputs (torch.autograd.backward with grad_tensors). Stock ZeRO-1/2
    train off torch here."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage, config=SMALL_LR)
    zero_lifetime.install(engine)
    for step in range(3):
        chunks = [make_input("mlp_norm", 10 * step + c) for c in range(3)]
        for model in (engine, reference):
            with torch.no_grad():
                reps = [model(chunk).requires_grad_(True) for chunk in chunks]
            everything = torch.cat(reps)
            (everything @ everything.t()).logsumexp(dim=1).mean().backward()
            for chunk, rep in zip(chunks, reps):
                torch.autograd.backward([model(chunk)], [rep.grad])
        _finish(engine, reference, ref_opt, stage)


@needs_torch_style
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_for_some_params_only(stage):
    """loss.backward(inputs=[...]): only the head learns (the rest gets no gradient in torch;
    DeepSpeed a zero one, which plain SGD does not move)."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage)
    zero_lifetime.install(engine)
    for step in range(3):
        x = make_input("mlp_norm", step)
        losses(engine(x))[0].backward(inputs=list(engine.module.l2.parameters()))
        losses(reference(x))[0].backward(inputs=list(reference.l2.parameters()))
        _finish(engine, reference, ref_opt, stage)


@needs_torch_style
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_autocast_bf16_two_backwards(stage):
    """torch.autocast over the forward (bf16 on the CPU), two retained backwards."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage)
    zero_lifetime.install(engine)
    for step in range(3):
        x = make_input("mlp_norm", step)
        for model in (engine, reference):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                first, second = losses(model(x).float())
            first.backward(retain_graph=True)
            second.backward()
        _finish(engine, reference, ref_opt, stage, atol=1e-2, rtol=1e-2)  # both run bf16 matmuls


@needs_torch_style
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_users_full_backward_hook_sees_torchs_gradients(stage):
    """A module's full backward hook (gradient monitoring) over two retained backwards gets
    the gradients torch's does."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage)
    zero_lifetime.install(engine)
    seen = {"engine": [], "torch": []}
    engine.module.l2.register_full_backward_hook(lambda m, gi, go: seen["engine"].append(go[0].clone()))
    reference.l2.register_full_backward_hook(lambda m, gi, go: seen["torch"].append(go[0].clone()))
    for step in range(2):
        x = make_input("mlp_norm", step)
        for model in (engine, reference):
            first, second = losses(model(x))
            first.backward(retain_graph=True)
            second.backward()
        _finish(engine, reference, ref_opt, stage)
    assert len(seen["engine"]) == len(seen["torch"]) == 4
    for got, want in zip(seen["engine"], seen["torch"]):
        torch.testing.assert_close(got, want)


class DeepSpeedCheckpointed(MLPNorm):
    """mlp_norm, its layers but the last under DeepSpeed's own activation checkpointing
    (deepspeed.checkpointing.checkpoint, as Megatron-DeepSpeed uses it) or none."""

    def __init__(self):
        super().__init__()
        self.checkpointed = True

    def _block(self, x):
        return self.ln(torch.relu(self.l1(x)))

    def forward(self, x):
        from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint
        return self.l2(checkpoint(self._block, x) if self.checkpointed else self._block(x))


# 0.17.6's and 0.18.9's checkpoint makes an accelerator stream in every forward, which their
# CPU accelerator does not have (a TypeError); 0.19.8's does not need one.
needs_streams = pytest.mark.skipif(DS_VERSION in ("0.17.6", "0.18.9"),
                                   reason="this DeepSpeed's checkpoint needs an accelerator Stream: none on the CPU")


def _deepspeed_checkpointed_pair(stage):
    import copy

    import deepspeed
    from harness import ds_config
    torch.manual_seed(0)
    model = DeepSpeedCheckpointed()
    reference = copy.deepcopy(model)
    reference.checkpointed = False  # the oracle recomputes nothing: same math
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, lr=0.01),
                                      model_parameters=model.parameters())
    return engine, reference, torch.optim.SGD(reference.parameters(), lr=0.01)


@needs_streams
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_activation_checkpointing_one_backward(stage):
    """One backward per forward through deepspeed.checkpointing.checkpoint: its recompute
    gathers the ZeRO-3 params again inside the backward."""
    engine, reference, ref_opt = _deepspeed_checkpointed_pair(stage)
    zero_lifetime.install(engine)
    for step in range(3):
        x = make_input("mlp_norm", step).requires_grad_(True)
        engine.backward(sum(losses(engine(x))))
        sum(losses(reference(x))).backward()
        _finish(engine, reference, ref_opt, stage)


@needs_streams
@pytest.mark.parametrize("install", [False, True], ids=["stock", "installed"])
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_activation_checkpointing_refuses_a_second_backward(stage, install):
    """DeepSpeed's checkpoint frees what it saved in its first backward, so a second one
    through the same forward fails inside it, stock or installed (README, Limitations).
    ZeRO-1/2 show it stock; stock ZeRO-3 fails earlier, on the released params."""
    engine, _, _ = _deepspeed_checkpointed_pair(stage)
    if install:
        zero_lifetime.install(engine)
    l1, l2 = losses(engine(make_input("mlp_norm", 0).requires_grad_(True)))
    engine.backward(l1, retain_graph=True)
    with pytest.raises(TypeError, match="'NoneType' object is not iterable"):
        engine.backward(l2)


EVALUATION_CONTEXTS = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _evaluate(model, how, x):
    """What an evaluation inside a training step runs; ``model`` is the engine or the torch
    model. "gathered_parameters": a ZeRO-3 context over every param (a norm for a log)."""
    module = getattr(model, "module", model)
    if how == "forward":
        return model(x)
    if how == "module":
        return module(x)
    if how == "submodules":  # one by one, without the root
        return module.l2(module.ln(torch.relu(module.l1(x))))
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params) if model is not module else contextlib.nullcontext():
        return torch.stack([p.norm() for p in params])


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("how", ["forward", "module", "submodules", "gathered_parameters"])
@pytest.mark.parametrize("context", sorted(EVALUATION_CONTEXTS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_evaluation_before_the_backward(stage, context, how, policy, backwards):
    """An evaluation in eval mode under torch.inference_mode or no_grad between a training
    forward and its backward(s) (metrics, a reference output for a penalty, a param norm): the
    evaluation's results and the training are torch's. Under inference mode ZeRO-3's releases
    swap inference tensors into the params, which turns the params into inference tensors that
    autograd cannot see; installed puts normal empty tensors back as a backward opens."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage)
    zero_lifetime.install(engine, policy=policy)
    for step in range(3):
        x, x_eval = make_input("mlp_norm", step), make_input("mlp_norm", 100 + step)
        evaluated = []
        for model, backward in ((engine, engine.backward), (reference, torch.Tensor.backward)):
            first, second = losses(model(x))
            model.eval()
            with EVALUATION_CONTEXTS[context]():
                evaluated.append(_evaluate(model, how, x_eval).clone())
            model.train()
            if backwards == 1:
                backward(first + second)
            else:
                backward(first, retain_graph=True)
                backward(second)
        torch.testing.assert_close(evaluated[0], evaluated[1], rtol=0, atol=0)
        _finish(engine, reference, ref_opt, stage)
    replaced = zero_lifetime.stats(engine).get("inference_placeholders_replaced")
    if stage == 3 and context == "inference_mode" and policy == "regather":
        assert replaced > 0, "no param was released under inference mode: the test tests nothing"
    elif stage == 3 and context == "no_grad":
        assert replaced == 0


@pytest.mark.skipif(DS_VERSION == "0.17.6", reason="0.17.6's gradient hooks look at their own param only: stock "
                    "is right there (checked), though its params are inference tensors as well")
def test_stock_stage3_fails_a_backward_after_an_inference_mode_forward():
    """Negative control: stock ZeRO-3 leaves the params inference tensors after that forward,
    and its own gradient hooks, which look at every param, then fail in the backward of the
    training forward before it."""
    engine, _, _ = make_pair("mlp_norm", 3)
    first, second = losses(engine(make_input("mlp_norm", 0)))
    with torch.inference_mode():
        engine(make_input("mlp_norm", 100))
    assert all(p.is_inference() for p in engine.module.parameters())
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'next_functions'"):
        engine.backward(first + second)
