"""ZeRO-3 leaf modules (``set_z3_leaf_modules``, as transformers sets for MoE blocks) under
several passes through one forward, on real engines (1 rank), against plain torch.

DeepSpeed reduces a leaf module's gradients from one hook on the module, not per param, and
zero-fills the params that got none (the experts a batch did not use). From 0.18 that hook is
a full backward hook, which also fires in a ``torch.autograd.grad`` through the module: there
it reduced zeros nobody computed, and the next backward then put the same params in the bucket
a second time (DeepSpeed's "same ds_id" assertion), or ``step()`` found them still holding
those zeros. DeepSpeed 0.17.6 reduces a leaf module once per forward: a second pass through
one forward raises an error that says so.
"""

import copy
import gc

import deepspeed
import pytest
import torch
from deepspeed.utils import set_z3_leaf_modules

import zero_lifetime
from harness import DS_VERSION, IN, OUT, assert_weights_match, ds_config, make_input, released_state
from zero_lifetime.grad_hook_guard import GradientsNotReducedError

HIDDEN = 16


class Experts(torch.nn.Module):
    """Two experts and a norm; the second expert is used only when asked (an unused expert)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.use_second = True

    def forward(self, h):
        out = self.experts[0](h)
        if self.use_second:
            out = out + self.experts[1](h)
        return self.norm(torch.relu(out))


class MoEModel(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.moe = Experts()
        self.out = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def _losses(out):
    return out.pow(2).mean(), (out * torch.linspace(-1, 1, out.shape[-1])).sum()


def _make_pair(policy):
    torch.manual_seed(0)
    model = MoEModel()
    reference = copy.deepcopy(model)
    set_z3_leaf_modules(model, [Experts])
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(3), model_parameters=model.parameters())
    zero_lifetime.install(engine, policy=policy)
    return engine, reference, torch.optim.SGD(reference.parameters(), lr=0.1)


def _passes(model, backward, zero_grad, x, kind):
    """One step's passes through one forward; returns what torch.autograd.grad gave (or None)."""
    first, second = _losses(model(x))
    if kind == "single":
        backward(first)
    elif kind in ("two_backwards", "two_backwards_zero_grad"):
        backward(first, retain_graph=True)
        if kind == "two_backwards_zero_grad":
            zero_grad()
        backward(second)
    elif kind == "grad_input_then_backward":
        got = torch.autograd.grad(second, [x], retain_graph=True)[0]
        backward(first)
        return got
    elif kind == "backward_then_grad_input":
        backward(first, retain_graph=True)
        return torch.autograd.grad(second, [x])[0]
    elif kind == "grad_expert_weight_then_backward":  # GradNorm-style, a leaf module's own param
        weight = getattr(model, "module", model).moe.experts[0].weight
        got = torch.autograd.grad(first, [weight], retain_graph=True)[0]
        backward(first + second)
        return got
    elif kind == "gradient_penalty":
        (grad_x, ) = torch.autograd.grad(first, [x], create_graph=True)
        backward(second + grad_x.pow(2).sum())
    return None


KINDS = ["single", "two_backwards", "two_backwards_zero_grad", "grad_input_then_backward",
         "backward_then_grad_input", "grad_expert_weight_then_backward", "gradient_penalty"]
# DeepSpeed 0.17.6 reduces a leaf module's gradients when the last of its inputs' hooks runs
# in a forward's first backward pass: a later backward through that forward reduces none.
PER_FORWARD_RELEASE = DS_VERSION == "0.17.6"
# (A gradient for an expert's weight alone does not reach the module's inputs' hooks.)
UNSUPPORTED_ON_0176 = {"two_backwards", "two_backwards_zero_grad", "grad_input_then_backward", "gradient_penalty"}


@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("kind", KINDS)
def test_leaf_module_passes_match_torch(kind, policy):
    """Every step's weights, and what torch.autograd.grad gave, match torch; the second
    expert sits out every other step (DeepSpeed gives it a zero gradient: plain SGD leaves
    it where torch does); nothing stays gathered."""
    engine, reference, ref_opt = _make_pair(policy)
    if PER_FORWARD_RELEASE and kind in UNSUPPORTED_ON_0176:
        x = make_input("mlp_norm", 0).requires_grad_(True)
        with pytest.raises(GradientsNotReducedError, match="once per forward"):
            _passes(engine, engine.backward, engine.zero_grad, x, kind)
        return
    for step in range(4):
        engine.module.moe.use_second = reference.moe.use_second = step % 2 == 0
        x = make_input("mlp_norm", step).requires_grad_(True)
        got = _passes(engine, engine.backward, engine.zero_grad, x, kind)
        engine.step()
        x_ref = make_input("mlp_norm", step).requires_grad_(True)
        want = _passes(reference, lambda loss, **kw: loss.backward(**kw), ref_opt.zero_grad, x_ref, kind)
        ref_opt.step()
        ref_opt.zero_grad()
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert_weights_match(engine, reference)
    gc.collect()
    assert released_state(engine) == ([], [])


@pytest.mark.skipif(PER_FORWARD_RELEASE, reason="DeepSpeed 0.17.6 has no leaf-module backward hook to gate")
def test_uninstall_puts_deepspeeds_leaf_hooks_back():
    """The gate replaces DeepSpeed's hooks in place, under their ids (DeepSpeed's handles
    still remove them); uninstall puts DeepSpeed's own back, and install gates them again."""
    torch.manual_seed(0)
    model = MoEModel()
    set_z3_leaf_modules(model, [Experts])
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(3), model_parameters=model.parameters())
    hooks = engine.module.moe._backward_hooks
    deepspeeds = dict(hooks)
    assert deepspeeds, "DeepSpeed registered no backward hook on the leaf module"
    zero_lifetime.install(engine)
    assert list(hooks) == list(deepspeeds)
    assert all(hooks[i] is not deepspeeds[i] for i in hooks), "install did not gate the hooks"
    zero_lifetime.uninstall(engine)
    assert dict(hooks) == deepspeeds
    zero_lifetime.install(engine)
    assert all(hooks[i] is not deepspeeds[i] for i in hooks)
    engine.destroy()
    assert not hooks, "DeepSpeed's handles must still remove the gated hooks"
