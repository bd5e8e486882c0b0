"""``deepspeed.zero.GatheredParameters`` while a graph is alive (logging weight norms, an EMA
copy, between a forward and its backward or between two backwards), on real ZeRO-3 engines
(1 rank), against plain torch.

The context partitions every param it was given as it exits. Under policy "pin" a param the
live graph saved is pinned, and DeepSpeed refused to free it ("Cannot free a ZeRO-3 parameter
while it is still active in submodules"); installed, pinned params stay gathered, as the
context found them.
"""

import deepspeed
import pytest
import torch

import zero_lifetime
from harness import assert_weights_match, losses, make_input, make_pair, released_state
from zero_lifetime.adapters.zero3_params import PinnedParamUpdatedError


def _read_in_context(engine, modifier_rank=None):
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        return [p.detach().clone() for p in params]


@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("where", ["after_forward", "between_backwards"])
def test_reading_gathered_params_with_a_live_graph(policy, where):
    """What the context shows is torch's weights; the steps match torch; nothing stays gathered."""
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy=policy)
    for step in range(3):
        x = make_input("mlp_norm", step)
        first, second = losses(engine(x))
        if where == "after_forward":
            seen = _read_in_context(engine)
        engine.backward(first, retain_graph=True)  # engine.backward: the path every release has
        if where == "between_backwards":
            seen = _read_in_context(engine)
        engine.backward(second)
        engine.step()
        for got, want in zip(seen, reference.parameters()):
            torch.testing.assert_close(got, want.detach())
        ref_first, ref_second = losses(reference(x))
        ref_first.backward(retain_graph=True)
        ref_second.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_weights_match(engine, reference)
    assert released_state(engine) == ([], [])
    assert zero_lifetime.stats(engine)["pinned_params"] == 0


def test_an_update_of_pinned_params_is_refused_and_training_goes_on():
    """modifier_rank: DeepSpeed would copy the update into its partitions and free the
    gathered params the graph still needs. The error names them; the graph still runs."""
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy="pin")
    x = make_input("mlp_norm", 0)
    first, second = losses(engine(x))
    engine.backward(first, retain_graph=True)
    # The LayerNorm saves its weight on every release (what else is saved depends on its F.linear).
    with pytest.raises(PinnedParamUpdatedError, match="ln.weight"):
        _read_in_context(engine, modifier_rank=0)
    engine.backward(second)
    engine.step()
    ref_first, ref_second = losses(reference(x))
    ref_first.backward(retain_graph=True)
    ref_second.backward()
    ref_opt.step()
    assert_weights_match(engine, reference)
    # With no graph alive the same update goes through as in stock DeepSpeed.
    _read_in_context(engine, modifier_rank=0)
    assert released_state(engine) == ([], [])


def test_uninstall_gives_the_params_deepspeeds_partition_back():
    engine, _, _ = make_pair("mlp_norm", 3)
    before = {id(p): p.partition for p in engine.module.parameters()}
    zero_lifetime.install(engine, policy="pin")
    assert all(p.partition is not before[id(p)] for p in engine.module.parameters())
    zero_lifetime.uninstall(engine)
    assert all(p.partition is before[id(p)] for p in engine.module.parameters())
