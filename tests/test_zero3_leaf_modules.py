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
import zero_lifetime.adapters.grad_hooks
from harness import DS_VERSION, IN, OUT, assert_weights_match, ds_config, make_input, released_state
from zero_lifetime.grad_hook_guard import GradientReducedTwiceError, GradientsNotReducedError

HIDDEN, WIDE = 16, 256
LR = 0.01  # the gradient penalty through the wide layer diverges at harness's 0.1
# Experts' granularity (params per layer, DeepSpeed's measure) is 144, the whole model's 762:
# this threshold makes Experts, and only Experts, a leaf module.
GRANULARITY_THRESHOLD = 150


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
        self.wide = torch.nn.Linear(HIDDEN, WIDE)
        self.out = torch.nn.Linear(WIDE, OUT)

    def forward(self, x):
        return self.out(self.wide(self.moe(self.inp(x))))


def _losses(out):
    return out.pow(2).mean(), (out * torch.linspace(-1, 1, out.shape[-1])).sum()


def _engine(model, marking, leaf_class=Experts):
    """``marking``: how the leaf module is chosen: "by_class" (set_z3_leaf_modules) or
    "by_threshold" (stage3_module_granularity_threshold; DeepSpeed then keeps a released
    leaf param's data, its "fast sharding")."""
    zero = {}
    if marking == "by_class":
        set_z3_leaf_modules(model, [leaf_class])
    else:
        zero["stage3_module_granularity_threshold"] = GRANULARITY_THRESHOLD
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(3, lr=LR, **zero),
                                      model_parameters=model.parameters())
    return engine


def _make_pair(policy, marking):
    torch.manual_seed(0)
    model = MoEModel()
    reference = copy.deepcopy(model)
    engine = _engine(model, marking)
    zero_lifetime.install(engine, policy=policy)
    return engine, reference, torch.optim.SGD(reference.parameters(), lr=LR)


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
# Stock 0.17.6's fast sharding (leaf modules by threshold) fails on the CPU accelerator in its first
# forward ("Invalid device string: '0'", torch.device of the bare device index).
THRESHOLD_RUNS_HERE = DS_VERSION != "0.17.6"
_BY_THRESHOLD = pytest.mark.skipif(not THRESHOLD_RUNS_HERE, reason="stock 0.17.6 fails by threshold on the CPU")


@pytest.mark.parametrize("marking, policy", [("by_class", "regather"), ("by_class", "pin"),
                                             pytest.param("by_threshold", "regather", marks=_BY_THRESHOLD)])
@pytest.mark.parametrize("kind", KINDS)
def test_leaf_module_passes_match_torch(kind, policy, marking):
    """Every step's weights, and what torch.autograd.grad gave, match torch; the second
    expert sits out every other step (DeepSpeed gives it a zero gradient: plain SGD leaves
    it where torch does); nothing stays gathered."""
    engine, reference, ref_opt = _make_pair(policy, marking)
    assert zero_lifetime.adapters.grad_hooks.GradHooks(engine.optimizer, 3).leaf_modules() == [engine.module.moe]
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
    gathered, data_kept = released_state(engine)
    assert gathered == []
    if marking == "by_class":  # by threshold, DeepSpeed keeps released leaf params' data
        assert data_kept == []


@pytest.mark.parametrize("marking", ["by_class", "by_threshold"])
def test_the_whole_model_as_leaf_module_is_refused(marking):
    """The root a leaf module: DeepSpeed reduces every gradient from one hook on the model's
    inputs, which stock fails in when no input needs a gradient, and which left the second of
    two backwards unreduced. install says what to do instead."""
    torch.manual_seed(0)
    model = MoEModel()
    if marking == "by_class":
        engine = _engine(model, marking, leaf_class=MoEModel)
    else:  # a threshold above every module's granularity: the root is chosen first
        engine = deepspeed.initialize(model=model, config=ds_config(3, stage3_module_granularity_threshold=10 ** 6),
                                      model_parameters=model.parameters())[0]
    with pytest.raises(ValueError, match="root module is a ZeRO-3 leaf module"):
        zero_lifetime.install(engine)


@_BY_THRESHOLD
def test_pin_with_leaf_modules_chosen_by_threshold_is_refused():
    """DeepSpeed's fast sharding (leaf modules by threshold) sets a released param's data to
    one element even while it is pinned: policy "pin" is refused, naming the alternatives."""
    torch.manual_seed(0)
    engine = _engine(MoEModel(), "by_threshold")
    with pytest.raises(ValueError, match='policy "pin" cannot keep'):
        zero_lifetime.install(engine, policy="pin")
    assert zero_lifetime.install(engine, policy="regather") is not None


def test_stock_fails_with_the_whole_model_as_leaf_and_no_input_gradient():
    """What the refusal's message says of stock DeepSpeed (a DeepSpeed that fixes it fails this)."""
    torch.manual_seed(0)
    engine = _engine(MoEModel(), "by_class", leaf_class=MoEModel)
    with pytest.raises(RuntimeError):
        engine.backward(_losses(engine(make_input("mlp_norm", 0)))[0])


class LeafAppliedTwice(MoEModel):
    """The leaf module applied twice in one forward (``twice``), or once."""

    def __init__(self):
        super().__init__()
        self.twice = True

    def forward(self, x):
        h = self.moe(self.inp(x))
        return self.out(self.wide(self.moe(h) if self.twice else h))


@pytest.mark.parametrize("install", [False, True], ids=["stock", "installed"])
@pytest.mark.parametrize("marking", ["by_class", pytest.param("by_threshold", marks=_BY_THRESHOLD)])
def test_a_leaf_module_applied_twice_in_one_forward_is_refused(marking, install):
    """DeepSpeed 0.18.9 and 0.19.8 reduce a leaf module's params from a hook that fires once per
    application of the module: stock fails on its bucket's duplicate ids (an AssertionError);
    installed raises an error that names the param and the cause, then the model applying it
    once trains like torch."""
    torch.manual_seed(0)
    model = LeafAppliedTwice()
    reference = copy.deepcopy(model)
    engine = _engine(model, marking)
    if install:
        zero_lifetime.install(engine)
    x = make_input("mlp_norm", 0)
    first, _ = _losses(engine(x))
    if PER_FORWARD_RELEASE:
        # 0.17.6 reduces the module once per forward, from its inputs' hooks: one backward
        # through both applications trains like torch there, stock and installed.
        engine.backward(first)
        engine.step()
        _losses(reference(x))[0].backward()
        torch.optim.SGD(reference.parameters(), lr=LR).step()
        assert_weights_match(engine, reference)
        return
    with pytest.raises(GradientReducedTwiceError if install else AssertionError,
                       match=r"moe\.\S+ to DeepSpeed's reduction buckets twice.*leaf module" if install else None):
        engine.backward(first)
    if not install:
        return
    model.twice = reference.twice = False
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(1, 3):
        x = make_input("mlp_norm", step)
        first, second = _losses(engine(x))
        engine.backward(first, retain_graph=True)
        engine.backward(second)
        engine.step()
        sum(_losses(reference(x))).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_weights_match(engine, reference)
    gathered, data_kept = released_state(engine)
    assert gathered == []
    if marking == "by_class":  # by threshold, DeepSpeed keeps released leaf params' data
        assert data_kept == []


@pytest.mark.skipif(PER_FORWARD_RELEASE, reason="DeepSpeed 0.17.6 has no leaf-module backward hook to gate")
def test_uninstall_puts_deepspeeds_leaf_hooks_back():
    """The gate replaces DeepSpeed's hooks in place, under their ids (DeepSpeed's handles
    still remove them); uninstall puts DeepSpeed's own back, and install gates them again."""
    torch.manual_seed(0)
    engine = _engine(MoEModel(), "by_class")
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
