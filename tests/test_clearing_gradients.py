"""Every way a user clears gradients between two backwards does what torch's zero_grad() does.

Installed, two backwards sum (torch's semantics), and DeepSpeed keeps that sum in its partitions:
``param.grad`` is empty after each backward. So a clear must reach the partitions, whichever
method the user calls: the engine's, the optimizer's deepspeed.initialize returned, or torch's
``Module.zero_grad()`` on the model. The oracle: plain torch with ``zero_grad()`` there.
"""

import copy
import weakref

import pytest
import torch

import zero_lifetime
from harness import CLEARS, assert_weights_match, losses, make_input, make_pair
from zero_lifetime import module_zero_grad


@pytest.mark.parametrize("clear", CLEARS)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("gas", [1, 2])
def test_a_clear_between_two_backwards_keeps_only_the_second_like_torch(stage, clear, gas):
    engine, reference, ref_opt = make_pair("mlp_norm", stage, gas=gas)
    zero_lifetime.install(engine)
    for step in range(2):
        for micro in range(gas):
            x = make_input("mlp_norm", 10 * step + micro)
            l1, l2 = losses(engine(x))
            r1, r2 = losses(reference(x))
            if micro == gas - 1:  # the boundary micro step: clear between its two backwards
                engine.backward(l1, retain_graph=True)
                (r1 / gas).backward(retain_graph=True)
                CLEARS[clear](engine)
                ref_opt.zero_grad()  # drops the earlier micro steps too, as torch's does
                engine.backward(l2)
                (r2 / gas).backward()
            else:
                engine.backward(l1 + l2)
                ((r1 + r2) / gas).backward()
            engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_weights_match(engine, reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clearing_part_of_the_model_while_deepspeed_holds_its_gradients_is_refused(stage):
    """DeepSpeed's partitions can only be dropped whole: a submodule's zero_grad() between two
    backwards raises, clears nothing, and training goes on as without it."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage)
    zero_lifetime.install(engine)
    x = make_input("mlp_norm", 0)
    l1, l2 = losses(engine(x))
    engine.backward(l1, retain_graph=True)
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) on a part of the model .* Nothing was cleared"):
        engine.module.l1.zero_grad()
    engine.backward(l2)
    engine.step()
    r1, r2 = losses(reference(x))
    (r1 + r2).backward()
    ref_opt.step()
    assert_weights_match(engine, reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clearing_part_of_the_model_with_nothing_held_is_torchs(stage):
    """After step(), or for params no backward reached, a submodule's zero_grad() is allowed."""
    engine, reference, ref_opt = make_pair("mlp_norm", stage)
    zero_lifetime.install(engine)
    for param in engine.module.l2.parameters():  # a backward that reaches only l1 and ln
        param.requires_grad_(False)
    for param in reference.l2.parameters():
        param.requires_grad_(False)
    for step in range(2):
        x = make_input("mlp_norm", step)
        engine.backward(losses(engine(x))[0])
        engine.module.l2.zero_grad()  # holds nothing: l2 got no gradient
        engine.step()
        engine.module.l1.zero_grad()  # after step(): nothing held
        losses(reference(x))[0].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    engine.module.l2.requires_grad_(True)  # ZeRO-3 hands out no fp32 copy of a frozen param
    assert_weights_match(engine, reference)


def test_uninstall_takes_back_both_patches_and_the_model_gets_no_attribute():
    """The model's zero_grad is torch's class method (wrapped while installed), never an
    attribute on the model, which a deepcopy or a pickled model would carry along."""
    engine, _, _ = make_pair("mlp_norm", 2)
    installation = zero_lifetime.install(engine)
    assert torch.nn.Module.zero_grad is module_zero_grad._zero_grad
    assert installation in module_zero_grad._installations
    assert "zero_grad" not in vars(engine.module) and "zero_grad" in vars(engine.optimizer)
    copy.deepcopy(engine.module).zero_grad()  # a copy is no engine's: a plain zero_grad
    zero_lifetime.uninstall(engine)
    assert installation not in module_zero_grad._installations
    assert "zero_grad" not in vars(engine.optimizer)


class _Asked:
    def __init__(self):
        self.asked = []

    def before_module_zero_grad(self, param_ids):
        self.asked.append(param_ids)


def test_torchs_module_zero_grad_is_wrapped_while_any_installation_lives(monkeypatch):
    torchs = _Asked()  # stands in for torch's own method, restored by monkeypatch
    monkeypatch.setattr(torch.nn.Module, "zero_grad", lambda module, *a, **k: torchs.asked.append(module))
    stand_in = torch.nn.Module.zero_grad
    monkeypatch.setattr(module_zero_grad, "_installations", weakref.WeakSet())
    monkeypatch.setattr(module_zero_grad, "_original", None)
    first, second, model = _Asked(), _Asked(), torch.nn.Linear(2, 3)
    module_zero_grad.register(first)
    module_zero_grad.register(second)
    model.zero_grad()
    expected = {id(model.weight), id(model.bias)}
    assert first.asked == [expected] and second.asked == [expected] and torchs.asked == [model]
    module_zero_grad.unregister(first)
    assert torch.nn.Module.zero_grad is module_zero_grad._zero_grad
    module_zero_grad.unregister(second)
    assert torch.nn.Module.zero_grad is stand_in
    # Wrapped again by someone after us: theirs stays when we go (ours passes through).
    module_zero_grad.register(first)
    theirs = lambda module, *a, **k: module_zero_grad._zero_grad(module, *a, **k)  # noqa: E731
    torch.nn.Module.zero_grad = theirs
    module_zero_grad.unregister(first)
    assert torch.nn.Module.zero_grad is theirs
    model.zero_grad()
    assert first.asked == [expected] and torchs.asked == [model, model]
