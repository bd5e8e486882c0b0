"""Engines fed DeepSpeed engines' outputs, with gradient accumulation, against plain torch.

An encoder engine E feeds a head engine H (each its own DeepSpeed engine, 1 rank), or one
engine is fed its own earlier output. On the torch-style path (and on 0.18.9 in
engine.backward too) DeepSpeed divides the gradient at every engine's outputs by its
gradient_accumulation_steps, so the gradient reaching E had been divided twice (with GAS 2, E
trained on a quarter of the loss's gradient, half of torch's, silently).
The oracle: the same models in plain torch, ``(loss / GAS).backward()`` per micro step and
one SGD step per window.
"""

import collections
import copy
import gc
import warnings

import deepspeed
import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput

import zero_lifetime
from zero_lifetime.adapters import UnsupportedDeepSpeedError
from zero_lifetime.chained_engines import ChainedInputs, _where_the_gradient_goes
from frozen_reward import policy_and_reward, reward_steps
from harness import (BACKWARD_PATHS, DS_VERSION, TORCH_FP32_RTOL, TORCH_STYLE_BACKWARD, assert_moved,
                     assert_weights_match, backward_by, ds_config, full_weights, released_state)

LR, WINDOWS = 0.1, 2
PATHS = BACKWARD_PATHS + (["scale"] if TORCH_STYLE_BACKWARD else [])


def _encoder_and_head():
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))
    return encoder, head


def _batch(micro_step):
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + micro_step))


def _engine(model, stage, gas, install):
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, lr=LR, gas=gas),
                                      model_parameters=model.parameters())
    if install:
        zero_lifetime.install(engine)
    return engine


# Losses over (encoder, head, x): through both engines, or also straight off the encoder's
# output (the part of E's gradient that never passes H must stay divided once).
LOSSES = {
    "through_head": lambda encoder, head, x: head(encoder(x)).pow(2).mean(),
    "head_and_encoder_output": lambda encoder, head, x: (
        lambda features: head(features).pow(2).mean() + 0.5 * features.pow(2).mean())(encoder(x)),
    # The encoder's output changed on the way (and gone as a tensor when the head runs): an
    # activation; a slice concatenated with labels that need no gradient (a conditional GAN's D).
    "through_activation": lambda encoder, head, x: head(torch.tanh(encoder(x))).pow(2).mean(),
    "through_slice_and_labels": lambda encoder, head, x: head(
        torch.cat([encoder(x)[:, :6], (x[:, :2] > 0).float()], dim=1)).pow(2).mean(),
}


def _train_chain(stage, gas, path, loss_name, install):
    return _train_against_torch(_encoder_and_head(), stage, gas, LOSSES[loss_name], path, install)


def _train_against_torch(models, stage, gas, loss_of, path="manual", install=True):
    """An engine per model (the last one's backward path taken) and a plain-torch copy of
    each, trained side by side for WINDOWS windows: per micro step ``loss_of(*engines, x)``
    backward and every engine's step(); torch ``(loss_of(*copies, x) / gas).backward()`` and
    one SGD step per window. Returns (engines, copies)."""
    references = [copy.deepcopy(model) for model in models]
    engines = [_engine(model, stage, gas, install) for model in models]
    optimizer = torch.optim.SGD([p for r in references for p in r.parameters()], lr=LR)
    for micro_step in range(WINDOWS * gas):
        x = _batch(micro_step)
        backward_by(engines[-1], loss_of(*engines, x), path)
        for engine in engines:
            engine.step()
        (loss_of(*references, x) / gas).backward()
        if (micro_step + 1) % gas == 0:
            optimizer.step()
            optimizer.zero_grad()
    return engines, references


def _assert_match_torch(engines, references, stage, initial=None, **tolerance):
    """Each engine's weights are its torch copy's (within ``tolerance``, assert_weights_match's
    by default; and moved from ``initial``'s); on ZeRO-3 nothing is left gathered."""
    for k, (engine, reference) in enumerate(zip(engines, references)):
        assert_weights_match(engine, reference, **tolerance)
        if initial is not None:
            assert_moved(engine, initial[k])
        if stage == 3:
            gc.collect()
            assert released_state(engine) == ([], [])


CHAIN_CASES = [(stage, path, "through_head") for stage in (1, 2, 3) for path in PATHS] + [
    (stage, "manual", loss) for stage in (1, 2, 3) if "manual" in PATHS
    for loss in ("head_and_encoder_output", "through_activation", "through_slice_and_labels")]


@pytest.mark.parametrize("stage, path, loss_name", CHAIN_CASES, ids=["-".join(map(str, c)) for c in CHAIN_CASES])
def test_chained_engines_match_torch_with_gradient_accumulation(stage, path, loss_name):
    if not TORCH_STYLE_BACKWARD:
        # 0.17.6 reduces only inside an engine's own backward: the encoder's gradients from
        # the head's engine.backward are refused at the first one, with the way out.
        with pytest.raises(UnsupportedDeepSpeedError, match="another engine's backward"):
            _train_chain(stage, 2, path, loss_name, install=True)
        return
    engines, references = _train_chain(stage, 2, path, loss_name, install=True)
    _assert_match_torch(engines, references, stage, initial=_encoder_and_head())


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("gas", [2, 4])
def test_chained_engines_with_another_gradient_accumulation(gas):
    _assert_match_torch(*_train_chain(3, gas, "manual", "through_head", install=True), stage=3)


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stock_divides_the_encoder_gradient_twice(stage, path):
    """Negative control: stock DeepSpeed's encoder took half of torch's update (GAS 2) on the
    torch-style paths, and on 0.18.9 also through engine.backward, which divides at the
    outputs too there; 0.19.8's engine.backward divides the loss once and matches torch."""
    encoder_engine, head_engine = _train_chain(stage, 2, path, "through_head", install=False)[0]
    installed_encoder, installed_head = _train_chain(stage, 2, path, "through_head", install=True)[0]
    if path == "engine" and DS_VERSION != "0.18.9":
        for stock, installed in ((encoder_engine, installed_encoder), (head_engine, installed_head)):
            for got, want in zip(full_weights(stock), full_weights(installed)):
                torch.testing.assert_close(got, want)
        return
    initial = _encoder_and_head()[0]
    stock_moves = [got - start.detach() for got, start in zip(full_weights(encoder_engine), initial.parameters())]
    torch_moves = [got - start.detach() for got, start in zip(full_weights(installed_encoder), initial.parameters())]
    for stock_move, torch_move in zip(stock_moves, torch_moves):
        assert stock_move.abs().max() < 0.6 * torch_move.abs().max(), (stock_move, torch_move)


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_fed_its_own_output(stage):
    """loss = M(M(x)): the inner call's share of M's gradient passed M's outputs twice."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    engines, references = _train_against_torch([model], stage, 2, lambda m, x: m(m(x)).pow(2).mean())
    _assert_match_torch(engines, references, stage)


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("stage", [1, 3])
def test_input_gradients_through_the_chain(stage):
    """The data input's gradient: divided once by a training backward (torch's (loss / GAS)),
    not at all by torch.autograd.grad; the multiplication back runs in neither."""
    encoder, head = _encoder_and_head()
    ref_encoder, ref_head = copy.deepcopy(encoder), copy.deepcopy(head)
    engines = [_engine(model, stage, 2, install=True) for model in (encoder, head)]
    x, ref_x = _batch(0).requires_grad_(), _batch(0).requires_grad_()
    loss = LOSSES["through_head"](*engines, x)
    ref_loss = LOSSES["through_head"](ref_encoder, ref_head, ref_x)
    got = torch.autograd.grad(loss, [x], retain_graph=True)[0]
    want = torch.autograd.grad(ref_loss, [ref_x], retain_graph=True)[0]
    torch.testing.assert_close(got, want)
    loss.backward()
    (ref_loss / 2).backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    for engine in engines:
        engine.step()


def _train_with_each_own_gas(stage, gas_of_each, install):
    """Encoder and head engines, each with its own GAS, trained 8 micro steps through
    ``loss.backward()``, beside torch copies whose gradients are divided by their own model's
    GAS and each stepped at its own window's end. Returns (engines, references)."""
    encoder, head = _encoder_and_head()
    references = copy.deepcopy(encoder), copy.deepcopy(head)
    engines = tuple(_engine(model, stage, gas, install) for model, gas in zip((encoder, head), gas_of_each))
    optimizers = [torch.optim.SGD(r.parameters(), lr=LR) for r in references]
    for micro_step in range(8):
        x = _batch(micro_step)
        LOSSES["through_head"](*engines, x).backward()
        for engine in engines:
            engine.step()
        loss = LOSSES["through_head"](*references, x)
        for reference, gas in zip(references, gas_of_each):
            params = list(reference.parameters())
            for param, grad in zip(params, torch.autograd.grad(loss, params, retain_graph=True)):
                param.grad = grad / gas if param.grad is None else param.grad + grad / gas
        for optimizer, gas in zip(optimizers, gas_of_each):
            if (micro_step + 1) % gas == 0:
                optimizer.step()
                optimizer.zero_grad()
    return engines, references


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("stage", [1, 3])
def test_chained_engines_each_divide_by_their_own_gradient_accumulation(stage):
    """Encoder GAS 2, head GAS 4: torch with each model's gradients divided by its own GAS and
    each stepped at its own window's end (stock was off by up to 2.4e-2 here)."""
    engines, references = _train_with_each_own_gas(stage, (2, 4), install=True)
    _assert_match_torch(engines, references, stage)


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("zero_grad", [False, True], ids=["sum", "zero_grad_between"])
@pytest.mark.parametrize("stage", [2, 3])
def test_chained_engines_two_backwards_over_one_forward(stage, zero_grad):
    """GAS 2, two retained backwards per micro step; the second loss also reads the encoder's
    output directly. torch: zero_grad() between them drops the window so far."""
    encoder, head = _encoder_and_head()
    references = copy.deepcopy(encoder), copy.deepcopy(head)
    engines = [_engine(model, stage, 2, install=True) for model in (encoder, head)]
    optimizer = torch.optim.SGD([p for r in references for p in r.parameters()], lr=LR)

    def two_losses(encoder, head, x):
        features = encoder(x)
        out = head(features)
        return out.pow(2).mean(), (0.3 * out + 0.1 * features.sum(-1, keepdim=True)).mean()

    for micro_step in range(WINDOWS * 2):
        x = _batch(micro_step)
        first, second = two_losses(*engines, x)
        first.backward(retain_graph=True)
        if zero_grad:
            for engine in engines:
                engine.zero_grad()
        second.backward()
        for engine in engines:
            engine.step()
        first, second = two_losses(*references, x)
        (first / 2).backward(retain_graph=True)
        if zero_grad:
            optimizer.zero_grad()
        (second / 2).backward()
        if micro_step % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
    _assert_match_torch(engines, references, stage)


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("stage", [2, 3])
def test_shared_encoder_feeding_two_head_engines(stage):
    """Multi-task: one encoder engine, two head engines (one fed the features through a relu),
    GAS 2 on all three: each head's share of the encoder's gradient multiplied back by its own
    head, the encoder dividing the sum once."""
    encoder, first_head = _encoder_and_head()
    second_head = copy.deepcopy(first_head)
    with torch.no_grad():
        for param in second_head.parameters():
            param.mul_(0.5)

    def loss_of(encoder, first_head, second_head, x):
        features = encoder(x)
        return first_head(features).pow(2).mean() + second_head(torch.relu(features)).abs().mean()

    _assert_match_torch(*_train_against_torch((encoder, first_head, second_head), stage, 2, loss_of), stage)


def _towers_and_head():
    torch.manual_seed(1)
    towers = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)) for _ in range(2)]
    return (*towers, _encoder_and_head()[1])


# Two tower engines joined into one head engine's input: every branch of the input's gradient
# ends at an engine output, so the head multiplies it all back.
TOWER_JOINS = {
    "sum": lambda a, b, head, x: head(a(x) + b(x)).pow(2).mean(),
    "concatenated_slices": lambda a, b, head, x: head(torch.cat([a(x)[:, :4], torch.relu(b(x))[:, 4:]], 1)).pow(2).mean(),
}


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("join", sorted(TOWER_JOINS))
@pytest.mark.parametrize("stage", [1, 3])
def test_two_tower_engines_joined_into_a_head_engine(stage, join):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing mixed here: no warning
        engines, references = _train_against_torch(_towers_and_head(), stage, 2, TOWER_JOINS[join])
    _assert_match_torch(engines, references, stage, initial=_towers_and_head())


def _deep_side(side):
    """80 autograd nodes of plain torch ops: more than the walk follows."""
    for _ in range(40):
        side = torch.tanh(side * 1.01)
    return side


SIDES = {"leaf": lambda side: side, "deep": _deep_side}


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("side_kind", sorted(SIDES))
@pytest.mark.parametrize("path", PATHS)
def test_input_mixing_an_engine_output_with_a_free_tensor_warns(path, side_kind):
    """head(encoder(x) + f(side)), ``side`` a leaf outside the engines, f nothing or more ops
    than the walk follows: its gradient (divided once, as torch's) and the head's weights are
    torch's; the encoder's share stays divided twice where the outputs divide, and the first
    such pass says so, once."""
    encoder, head = _encoder_and_head()
    ref_encoder, ref_head = copy.deepcopy(encoder), copy.deepcopy(head)
    engines = [_engine(model, 2, 2, install=True) for model in (encoder, head)]
    side, ref_side = torch.zeros(4, 8, requires_grad=True), torch.zeros(4, 8, requires_grad=True)
    divides_at_outputs = path != "engine"  # engine.backward divides the loss (installed 0.18.9 too)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for micro_step in range(2):
            x = _batch(micro_step)
            loss = engines[1](engines[0](x) + SIDES[side_kind](side)).pow(2).mean()
            backward_by(engines[-1], loss, path)
            for engine in engines:
                engine.step()
            (ref_head(ref_encoder(x) + SIDES[side_kind](ref_side)).pow(2).mean() / 2).backward()
    mixed = [w for w in caught if "comes partly from another engine's output" in str(w.message)]
    assert len(mixed) == (1 if divides_at_outputs else 0), [str(w.message) for w in caught]
    torch.testing.assert_close(side.grad, ref_side.grad)
    with torch.no_grad():
        for param in ref_head.parameters():
            param -= LR * param.grad
    assert_weights_match(engines[1], ref_head)


Features = collections.namedtuple("Features", "hidden scale")


class _Pair(tuple):
    """A tuple subclass whose constructor takes two arguments, not one iterable."""

    def __new__(cls, first, second):
        return super().__new__(cls, (first, second))


# How the encoder engine hands its features on, and how the head engine reads them.
CONTAINERS = {
    "named_tuple": (lambda h: Features(h, 1.0), lambda f: f.hidden * f.scale),
    "ordered_dict": (lambda h: collections.OrderedDict(hidden=h), lambda f: f["hidden"]),
    "model_output": (lambda h: BaseModelOutput(last_hidden_state=h), lambda f: f.last_hidden_state),
    "nested": (lambda h: {"features": [Features(h, 2.0)]}, lambda f: f["features"][0].hidden * f["features"][0].scale),
}


class _Wrapped(torch.nn.Module):
    def __init__(self, model, before=lambda v: v, after=lambda v: v):
        super().__init__()
        self.model, self.before, self.after = model, before, after

    def forward(self, value):
        return self.after(self.model(self.before(value)))


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("container", sorted(CONTAINERS))
@pytest.mark.parametrize("stage", [1, 3])
def test_engine_output_handed_on_in_a_container(stage, container):
    """The head engine is fed the container the encoder engine returned (a named tuple, an
    OrderedDict, a transformers ModelOutput, nested): the engine output inside is multiplied
    back as a bare one is."""
    wrap, unwrap = CONTAINERS[container]
    encoder, head = _encoder_and_head()
    models = _Wrapped(encoder, after=wrap), _Wrapped(head, before=unwrap)
    engines, references = _train_against_torch(models, stage, 2, lambda e, h, x: h(e(x)).pow(2).mean())
    _assert_match_torch(engines, references, stage)


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
def test_container_that_cannot_be_rebuilt_warns_and_is_passed_as_is():
    encoder, head = _encoder_and_head()
    models = _Wrapped(encoder, after=lambda h: _Pair(h, h)), _Wrapped(head, before=lambda p: p[0] + p[1])
    encoder_engine, head_engine = (_engine(model, 2, 2, install=True) for model in models)
    with pytest.warns(RuntimeWarning, match="could not copy a container in this engine's output"):
        pair = encoder_engine(_batch(0))  # the encoder's outputs stay where they are too (test_output_division)
    with pytest.warns(RuntimeWarning, match="could not pass this engine's input, a _Pair"):
        out = head_engine(pair)
    torch.testing.assert_close(out, head(pair[0] + pair[1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        head_engine(encoder_engine(_batch(1)))  # once per engine


def test_walk_agrees_with_autograd_on_random_graphs():
    """Where the walk says an input's gradient goes (engine outputs, elsewhere) against
    autograd's own answer: which engine outputs and which free leaves torch.autograd.grad
    reaches from it. Random graphs of a few ops over marked engine outputs (each made from a
    leaf of its own), free leaves that need a gradient and constants that do not."""
    generator = torch.Generator().manual_seed(0)
    ops = [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: torch.tanh(a),
           lambda a, b: torch.cat([a[:2], b[2:]]), lambda a, b: (a - b).relu(), lambda a, b: a.sum() * b]
    seen = set()
    for _ in range(300):
        def pick(n):
            return int(torch.randint(n, (1,), generator=generator))

        engine_outputs = [(torch.randn(4, requires_grad=True) * 1.0) for _ in range(1 + pick(3))]
        ChainedInputs.mark_outputs(engine_outputs)
        free_leaves = [torch.randn(4, requires_grad=True) for _ in range(pick(3))]
        pool = engine_outputs + free_leaves + [torch.randn(4) for _ in range(2)]
        for _ in range(1 + pick(8)):
            pool.append(ops[pick(len(ops))](pool[pick(len(pool))], pool[pick(len(pool))]))
        value = pool[-1]
        if value.grad_fn is None:
            continue
        reached = torch.autograd.grad(value.sum(), engine_outputs + free_leaves, allow_unused=True)
        want = (any(g is not None for g in reached[:len(engine_outputs)]),
                any(g is not None for g in reached[len(engine_outputs):]))
        assert _where_the_gradient_goes(value.grad_fn, value.output_nr) == want
        seen.add(want)
    assert seen == {(True, False), (True, True), (False, True)}  # every verdict was met


class PolicyWithFrozenReward(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.policy, self.reward = policy_and_reward()  # the reward has a LayerNorm, which saves its weight

    def forward(self, x):
        return self.reward(self.policy(x))


@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_reward_model_inside_the_trained_engine(stage, policy):
    """The frozen reward model as a submodule of the trained engine's model (in an engine of its
    own without optimizer: tests/test_frozen_engine.py): torch's weights, the reward's unchanged."""
    model = PolicyWithFrozenReward()
    reference = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, lr=LR),
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    zero_lifetime.install(engine, policy=policy)
    optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)

    def torch_step():
        optimizer.step()
        optimizer.zero_grad()

    reward_steps(engine, lambda out: out, engine.backward, engine.step)
    reward_steps(reference, lambda out: out, torch.Tensor.backward, torch_step)
    # harness.full_weights takes the frozen params' own data: the reward's compared as well.
    # torch.testing's fp32 rtol, as this test had; the initial weights from the same seed.
    _assert_match_torch([engine], [reference], stage, initial=[PolicyWithFrozenReward()], rtol=TORCH_FP32_RTOL)
