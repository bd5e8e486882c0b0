"""Two engines whose backwards cross: a GAN's generator G and discriminator D, each a real
DeepSpeed engine with zero_lifetime installed (1 rank), against the same loop in plain torch.

The generator's backward runs through D, so D's hooks fire inside G's backward. The loop
either freezes D for the G step (``requires_grad_(False)``, then back: what most GAN code
does) or lets D's params take gradients there too and drops them with ``D.zero_grad()``
before D's own next step (torch semantics: D then steps on its own loss only; DeepSpeed
0.17.6, which reduces only inside an engine's own backward, refuses that second form).
"""

import copy
import gc

import deepspeed
import pytest
import torch
import torch.nn.functional as F

import zero_lifetime
from harness import (DS_VERSION, TORCH_STYLE_BACKWARD, assert_moved, assert_weights_match, backward_by, ds_config,
                     full_weights, released_state)
from zero_lifetime.adapters import UnsupportedDeepSpeedError

STEPS, LR = 3, 0.1


def _nets():
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 8))
    discriminator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 1))
    return generator, discriminator


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 4, generator=g), torch.randn(4, 8, generator=g)


def _train(G, D, g_update, d_update, freeze_d: bool, steps: int = STEPS):
    """``g_update`` / ``d_update``: (clear, backward_and_step) of each side."""
    for step in range(steps):
        z, real = _batch(step)
        fake = G(z)
        d_update[0]()
        d_update[1](F.softplus(D(fake.detach())).mean() + F.softplus(-D(real)).mean())
        if freeze_d:
            D.requires_grad_(False)
        g_update[0]()
        g_update[1](F.softplus(-D(fake)).mean())  # through D into G
        if freeze_d:
            D.requires_grad_(True)


def _engine_update(engine, path="engine"):

    def backward_and_step(loss):
        backward_by(engine, loss, path)
        engine.step()

    return engine.zero_grad, backward_and_step


def _torch_update(params, gas=1):
    """torch's gradient accumulation: (loss / gas).backward(), a step every gas-th call."""
    optimizer, calls = torch.optim.SGD(params, lr=LR), [0]

    def backward_and_step(loss):
        (loss / gas).backward()
        calls[0] += 1
        if calls[0] % gas == 0:
            optimizer.step()

    return optimizer.zero_grad, backward_and_step


def _engines(stage, install, policy="regather", gas=1):
    """(G, D) engines and (G, D) plain-torch copies with the same initial weights."""
    G, D = _nets()
    references = copy.deepcopy(G), copy.deepcopy(D)
    engines = []
    for model in (G, D):
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, lr=LR, gas=gas),
                                          model_parameters=model.parameters())
        if install:
            zero_lifetime.install(engine, policy=policy)
        engines.append(engine)
    return engines, references


CASES = [(1, "regather"), (2, "regather"), (3, "regather"), (3, "pin")]


@pytest.mark.parametrize("freeze_d", [True, False], ids=["D_frozen_in_G_step", "D_gets_G_step_grads"])
@pytest.mark.parametrize("stage, policy", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_gan_matches_torch(stage, policy, freeze_d):
    (g_engine, d_engine), (g_ref, d_ref) = _engines(stage, install=True, policy=policy)
    if not freeze_d and not TORCH_STYLE_BACKWARD:
        # 0.17.6 reduces only inside an engine's own backward: D's gradients from G's
        # backward are refused at the first one, with the way out.
        with pytest.raises(UnsupportedDeepSpeedError, match="another engine's backward.*freeze"):
            _train(g_engine, d_engine, _engine_update(g_engine), _engine_update(d_engine), freeze_d)
        return
    _train(g_engine, d_engine, _engine_update(g_engine), _engine_update(d_engine), freeze_d)
    _train(g_ref, d_ref, _torch_update(g_ref.parameters()), _torch_update(d_ref.parameters()), freeze_d)
    for engine, reference, initial in zip((g_engine, d_engine), (g_ref, d_ref), _nets()):
        assert_weights_match(engine, reference)
        assert_moved(engine, initial)  # both sides trained
        if stage == 3:
            gc.collect()
            stats = zero_lifetime.stats(engine)
            assert stats["pinned_params"] == 0 and stats["live_handles"] == 0, stats
            assert released_state(engine) == ([], [])


@pytest.mark.parametrize("stage", [2, 3])
def test_stock_gan_fails_when_d_gets_g_step_grads(stage):
    """Negative control: stock ZeRO-2/3 refuse D's second gradient of a step (the one from
    G's backward) at D's next backward, though D.zero_grad() ran in between. Stock 0.18.9
    takes it: ZeRO-2 then trains as torch does, ZeRO-3 silently off torch (measured)."""
    (g_engine, d_engine), (g_ref, d_ref) = _engines(stage, install=False)
    if DS_VERSION == "0.18.9":
        _train(g_engine, d_engine, _engine_update(g_engine), _engine_update(d_engine), freeze_d=False)
        _train(g_ref, d_ref, _torch_update(g_ref.parameters()), _torch_update(d_ref.parameters()), freeze_d=False)
        off = max((got - want.detach()).abs().max().item() for engine, reference in ((g_engine, g_ref), (d_engine, d_ref))
                  for got, want in zip(full_weights(engine), reference.parameters()))
        assert (off > 1e-2) if stage == 3 else (off <= 1e-6), off
        return
    with pytest.raises(AssertionError):
        _train(g_engine, d_engine, _engine_update(g_engine), _engine_update(d_engine), freeze_d=False)


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("freeze_d", [True, False], ids=["D_frozen_in_G_step", "D_gets_G_step_grads"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gan_with_gradient_accumulation_matches_torch(stage, freeze_d):
    """GAS 2 on both engines, loss.backward(). G's gradient passes D's outputs, whose hooks
    divide by D's GAS when D's params take gradients too: G trained on half of torch's
    gradient (its first weight off by 5.1e-3 after four steps) until the fed engine multiplied
    it back (zero_lifetime/chained_engines.py)."""
    gas = 2
    (g_engine, d_engine), (g_ref, d_ref) = _engines(stage, install=True, gas=gas)
    _train(g_engine, d_engine, _engine_update(g_engine, "manual"), _engine_update(d_engine, "manual"), freeze_d,
           steps=2 * gas)
    _train(g_ref, d_ref, _torch_update(g_ref.parameters(), gas), _torch_update(d_ref.parameters(), gas), freeze_d,
           steps=2 * gas)
    for engine, reference in zip((g_engine, d_engine), (g_ref, d_ref)):
        assert_weights_match(engine, reference)
