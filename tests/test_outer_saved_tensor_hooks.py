"""Saved-tensor hooks around an installed engine's forward (activation offloading) keep working.

Torch applies only the innermost saved_tensors_hooks, and an installed ZeRO-3 engine pushes
its tracker's pair around its forward: an outer pair (torch's ``save_on_cpu()``, TRL's
``activation_offloading``) saw none of the tensors the model saved, so what stock DeepSpeed
offloaded stayed in device memory. Installed, the tracker keeps the params and the outer pair
gets the rest, exactly what stock gives it (``zero_lifetime/outer_saved_tensor_hooks.py``).

A pair pushed *inside* the forward (TRL gives the output head a no-op pair) hides the params
saved under it from the tracker. Two backwards through them still match torch: the tracker sets
DeepSpeed's module counters back before the second, so DeepSpeed's own pre-backward hooks
gather them again (stock fails there).
"""

import pytest
import torch

import zero_lifetime
from harness import (BACKWARD_PATHS, assert_weights_match, backward_both, losses, make_input, make_pair,
                     reference_step_both)


class CountingHooks:
    """An outer pair that records the shape of every tensor it packs that is not param memory
    (a param or a view of one: the tracker keeps those), and counts their unpacks."""

    def __init__(self, params):
        self.params = list(params)
        self.packed, self.unpacked = [], 0

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _is_param_memory(self, tensor) -> bool:
        storage = tensor.untyped_storage().data_ptr()
        return any(p.numel() and p.untyped_storage().data_ptr() == storage for p in self.params)

    def _pack(self, tensor):
        param = self._is_param_memory(tensor)
        if not param:
            self.packed.append(tuple(tensor.shape))
        return param, tensor.detach().clone()  # a copy, as an offloading hook makes (no graph cycle)

    def _unpack(self, packed):
        param, copy = packed
        self.unpacked += not param
        return copy


MODELS = ["mlp_norm", "raw_alias", "tied_lm", "ckpt_reentrant", "ckpt_nonreentrant"]


def _noop_pair_around(module):
    """TRL's way of keeping a module out of activation offloading
    (``trl.models.activation_offloading.get_act_offloading_ctx_manager``)."""
    offloading = pytest.importorskip("trl.models.activation_offloading")
    noop = offloading.NoOpManager()
    module.register_forward_pre_hook(lambda *_: noop.__enter__())
    module.register_forward_hook(lambda *_: noop.__exit__(), always_call=True)


def _two_backwards_under_inner_noop_pairs(model_name, where, install, policy, path):
    engine, reference, ref_opt = make_pair(model_name, 3)
    if where == "root":
        _noop_pair_around(engine.module)
    else:  # every module that owns params
        for module in engine.module.modules():
            if any(True for _ in module.parameters(recurse=False)):
                _noop_pair_around(module)
    if install:
        zero_lifetime.install(engine, policy=policy)
    try:
        for step in range(3):
            x = make_input(model_name, step)
            engine_losses, reference_losses = losses(engine(x)), losses(reference(x))
            backward_both(engine, *engine_losses, path, zero_grad=False)
            engine.step()
            reference_step_both(ref_opt, *reference_losses, zero_grad=False)
        assert_weights_match(engine, reference)
        if install:
            assert zero_lifetime.stats(engine)["pinned_params"] == 0
    finally:
        engine.destroy()


@pytest.mark.parametrize("where", ["root", "every"])
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_two_backwards_under_inner_noop_pairs_match_torch(path, policy, model_name, where):
    _two_backwards_under_inner_noop_pairs(model_name, where, True, policy, path)


@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_stock_fails_two_backwards_under_an_inner_noop_pair(path):
    """What the test above guards against: the params saved under the inner pair were released."""
    with pytest.raises(RuntimeError, match="size|match"):
        _two_backwards_under_inner_noop_pairs("mlp_norm", "every", False, None, path)


def _outer_hooks_over_one_step(stage, install):
    engine, *_ = make_pair("mlp_norm", stage)
    if install:
        zero_lifetime.install(engine)
    hooks = CountingHooks(engine.module.parameters())
    with hooks():
        out = engine(make_input("mlp_norm", 0))
    engine.backward(losses(out)[0])
    engine.step()
    engine.destroy()
    return hooks


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_outer_pair_packs_what_it_packs_on_stock(stage):
    want = _outer_hooks_over_one_step(stage, install=False)
    got = _outer_hooks_over_one_step(stage, install=True)
    assert got.packed == want.packed and len(got.packed) >= 6  # the activations, in the same order
    assert got.unpacked > 0 and got.unpacked == want.unpacked


@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_two_backwards_under_save_on_cpu_match_torch(path, policy):
    """ZeRO-3's two backwards over one forward made under torch's activation offloading."""
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy=policy)
    for step in range(3):
        x = make_input("mlp_norm", step)
        with torch.autograd.graph.save_on_cpu():
            engine_losses, reference_losses = losses(engine(x)), losses(reference(x))
        backward_both(engine, *engine_losses, path, zero_grad=False)
        engine.step()
        reference_step_both(ref_opt, *reference_losses, zero_grad=False)
    assert_weights_match(engine, reference)
    assert zero_lifetime.stats(engine)["pinned_params"] == 0
    engine.destroy()
