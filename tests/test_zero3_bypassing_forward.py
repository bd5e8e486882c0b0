"""ZeRO-3 forwards that run the model's modules without the root module's hooks (a method of
the model, its forward function called directly, submodules one by one), then two backwards
over the retained graph; 1 rank, against torch.

DeepSpeed's module hooks gather each module's params however it is called, but the saved
params of such a forward were outside the lifetime tracker, and DeepSpeed's module counters,
which a second backward needs to fetch module by module again, were consumed by the first:
the second backward failed on a released param, stock and installed alike.
"""

import pytest
import torch

import zero_lifetime
from harness import (TORCH_STYLE_BACKWARD, assert_weights_match, losses, make_input, make_pair,
                     released_state, two_backwards, two_backwards_step_like_torch)
from zero_lifetime.outer_saved_tensor_hooks import hooks_in_force

MODELS = ["mlp_norm", "split_heads", "ckpt_reentrant", "ckpt_nonreentrant"]
PATHS = ["engine", "manual"] if TORCH_STYLE_BACKWARD else ["engine"]


def _forward_without_root_hooks(engine, x):
    """The root's forward code, called as a function: its module hooks never run."""
    model = engine.module
    return type(model).forward(model, x)


def _step_like_torch(engine, reference, ref_opt, x, out, path):
    two_backwards(engine, out, path, zero_grad=False)
    engine.step()
    sum(losses(reference(x))).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    assert_weights_match(engine, reference)
    assert released_state(engine) == ([], [])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("model_name", MODELS)
def test_two_backwards_over_a_forward_without_the_root_train_like_torch(model_name, policy, path):
    engine, reference, ref_opt = make_pair(model_name, 3)
    zero_lifetime.install(engine, policy=policy)
    for step in range(3):
        x = make_input(model_name, step)
        _step_like_torch(engine, reference, ref_opt, x, _forward_without_root_hooks(engine, x), path)
        assert hooks_in_force() is None  # popped as the forward returned


@pytest.mark.parametrize("model_name", MODELS)
def test_pin_over_such_a_forward_pins_what_the_engines_forward_pins(model_name):
    figures = {}
    for forward in (_forward_without_root_hooks, lambda engine, x: engine(x)):
        engine, reference, ref_opt = make_pair(model_name, 3)
        zero_lifetime.install(engine, policy="pin")
        for step in range(2):
            x = make_input(model_name, step)
            _step_like_torch(engine, reference, ref_opt, x, forward(engine, x), "engine")
        stats = zero_lifetime.stats(engine)
        figures[forward] = (stats["peak_pinned_bytes"], stats["regathers"])
    without_root, through_engine = figures.values()
    assert without_root == through_engine and without_root[0] > 0


def test_submodules_called_one_by_one_train_like_torch():
    """A loss computed from submodules the training code calls itself (the root's forward is
    not what runs), mixed with steps through the engine."""
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine)
    model = engine.module
    for step, through_engine in enumerate([False, False, True, False]):
        x = make_input("mlp_norm", step)
        out = engine(x) if through_engine else model.l2(model.ln(torch.relu(model.l1(x))))
        _step_like_torch(engine, reference, ref_opt, x, out, "engine")


@pytest.mark.parametrize("model_name", ["mlp_norm", "ckpt_reentrant", "ckpt_nonreentrant"])
def test_stock_fails_on_the_second_backward(model_name):
    """Why: stock DeepSpeed released the params the retained graph saved. (SplitHeads gets
    through on 0.18.9 and 0.17.6, not on 0.19.8.)"""
    engine, reference, ref_opt = make_pair(model_name, 3)
    with pytest.raises(RuntimeError, match="size of tensor a"):
        x = make_input(model_name, 0)
        two_backwards(engine, _forward_without_root_hooks(engine, x), "engine", zero_grad=False)


def test_a_forward_that_raises_leaves_no_hooks_in_force_and_training_goes_on():
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine)
    with pytest.raises(RuntimeError):
        engine.module.l1(torch.randn(4, 3))  # wrong width: the Linear raises
    assert hooks_in_force() is None
    for step in range(2):
        x = make_input("mlp_norm", step)
        _step_like_torch(engine, reference, ref_opt, x, _forward_without_root_hooks(engine, x), "engine")


def test_inside_the_users_saved_tensor_hooks_they_keep_what_is_saved():
    """Activation offloading around such a forward: its hooks see every saved tensor, params
    too (copies: nothing to gather again), as stock; training still follows torch."""
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine)
    params = list(engine.module.parameters())
    packed_params = []

    def pack(tensor):
        storage = tensor.untyped_storage().data_ptr()
        packed_params.extend(p for p in params if p.numel() and p.untyped_storage().data_ptr() == storage)
        return tensor.clone()

    for step in range(2):
        packed_params.clear()
        x = make_input("mlp_norm", step)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _forward_without_root_hooks(engine, x)
        assert packed_params, "no param reached these hooks"  # (which ones depends on the release)
        two_backwards_step_like_torch(engine, out, reference, ref_opt, reference(x))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("forward", ["module", "root_function"])
@pytest.mark.parametrize("model_name", MODELS)
def test_such_a_forward_between_two_backwards_over_an_engine_forward(model_name, forward, grad):
    """An evaluation or logging forward between the two backwards of a step: what it records
    of DeepSpeed's module counters must not take the engine forward's place."""
    engine, reference, ref_opt = make_pair(model_name, 3)
    zero_lifetime.install(engine)
    model = engine.module
    for step in range(2):
        x = make_input(model_name, step)
        l1, l2 = losses(engine(x))
        engine.backward(l1, retain_graph=True)
        with torch.set_grad_enabled(grad):
            y = make_input(model_name, 100 + step)
            model(y) if forward == "module" else _forward_without_root_hooks(engine, y)
        engine.backward(l2)
        engine.step()
        sum(losses(reference(x))).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_weights_match(engine, reference)
        assert released_state(engine) == ([], [])


def test_forwards_with_no_backward_between_them_keep_one_record_per_module():
    """An evaluation loop through a method: what is recorded of DeepSpeed's counters for the
    next backward stays one entry per module (appended per forward, it grew without end)."""
    engine, reference, ref_opt = make_pair("ckpt_nonreentrant", 3)
    installation = zero_lifetime.install(engine)
    with torch.no_grad():
        for batch in range(20):
            _forward_without_root_hooks(engine, make_input("ckpt_nonreentrant", batch))
    assert 0 < len(installation.lifetime._counters_after_forward) <= len(list(engine.module.modules()))
    x = make_input("ckpt_nonreentrant", 0)
    _step_like_torch(engine, reference, ref_opt, x, _forward_without_root_hooks(engine, x), "engine")
