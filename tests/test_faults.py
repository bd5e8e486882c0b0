"""Faults around a retained graph: an interrupt between the two backwards, a loss whose
backward raises, uninstall() and engine.destroy() with graphs still alive. No pinned or
gathered param may survive, nothing hangs, and the next step is correct."""

import gc

import pytest
import torch

import zero_lifetime
from harness import assert_weights_match, losses, make_input, make_pair, released_state, stock_backward_leftovers


class _FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises, half-way through the graph's backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("loss backward failed")


def _plain_step(engine, reference, ref_opt, seed):
    """One ordinary step on both, to check the engine still trains like torch."""
    x = make_input("mlp_norm", seed)
    engine.backward(losses(engine(x))[0])
    engine.step()
    losses(reference(x))[0].backward()
    ref_opt.step()
    ref_opt.zero_grad()


def _assert_nothing_held(engine, after_backward=False):
    """Nothing pinned or gathered, but what stock DeepSpeed keeps after a backward (0.17.6)."""
    gc.collect()
    assert released_state(engine) == (stock_backward_leftovers("mlp_norm") if after_backward else [], [])


@pytest.mark.parametrize("policy", ["regather", "pin"])
def test_interrupt_between_the_two_backwards(policy):
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy=policy)

    def interrupted_step():
        l1, l2 = losses(engine(make_input("mlp_norm", 7)))
        engine.backward(l1, retain_graph=True)
        raise KeyboardInterrupt  # e.g. Ctrl-C before the second loss

    with pytest.raises(KeyboardInterrupt):
        interrupted_step()
    _assert_nothing_held(engine, after_backward=True)
    assert zero_lifetime.stats(engine)["pinned_params"] == 0
    # The user drops the half step and goes on; torch does the same.
    engine.zero_grad()
    _plain_step(engine, reference, ref_opt, 0)
    assert_weights_match(engine, reference)


@pytest.mark.parametrize("where", ["loss", "mid_model"])
@pytest.mark.parametrize("policy", ["regather", "pin"])
def test_backward_raising(policy, where):
    """A node whose backward raises: in the loss (before any param gradient) or inside the
    model, after the last layer's params already got theirs (DeepSpeed reduced them)."""
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy=policy)
    hook = None
    if where == "mid_model":
        hook = engine.module.ln.register_forward_hook(lambda module, args, out: _FailingBackward.apply(out))

    def failing_step():
        out = engine(make_input("mlp_norm", 5))
        if where == "loss":
            out = _FailingBackward.apply(out)
        engine.backward(losses(out)[0], retain_graph=True)

    with pytest.raises(ArithmeticError, match="loss backward failed"):
        failing_step()
    if hook is not None:
        hook.remove()
    engine.zero_grad()  # the next engine call cleans up after the dead backward
    _assert_nothing_held(engine)
    stats = zero_lifetime.stats(engine)
    # Only a backward that reached our hooks was opened, and so has to be cleaned up.
    assert stats["failed_backwards"] == (1 if where == "mid_model" else 0), stats
    assert stats["pinned_params"] == 0 and stats["live_handles"] == 0, stats
    _plain_step(engine, reference, ref_opt, 0)
    assert_weights_match(engine, reference)


@pytest.mark.parametrize("teardown", ["uninstall", "destroy"])
def test_teardown_with_a_retained_graph_alive(teardown):
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy="pin")
    out = engine(make_input("mlp_norm", 3))
    l1, l2 = losses(out)
    engine.backward(l1, retain_graph=True)  # the graph (and its pins) stay alive
    if teardown == "uninstall":
        assert zero_lifetime.uninstall(engine)
    else:
        engine.destroy()
        assert "destroy" not in engine.__dict__  # uninstalled on the way
    _assert_nothing_held(engine, after_backward=True)  # pins released at once, with the graph still alive
    del out, l1, l2
    gc.collect()
    _assert_nothing_held(engine, after_backward=True)
    if teardown == "uninstall":
        # A stock engine again, holding the first loss's reduced gradients: step() applies
        # them (as torch would), and it goes on training like torch.
        engine.step()
        losses(reference(make_input("mlp_norm", 3)))[0].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _plain_step(engine, reference, ref_opt, 0)
        assert_weights_match(engine, reference)
