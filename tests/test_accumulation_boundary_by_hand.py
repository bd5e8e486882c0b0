"""Gradient accumulation whose window boundary the caller sets by hand, as accelerate does.

accelerate (1.15) calls ``engine.set_gradient_accumulation_boundary(sync_gradients)`` just before
its own backward and ``engine.step()`` only when the window closes. A step that backwards a
first loss itself (``engine.backward(loss, retain_graph=True)`` or ``loss.backward(...)``) before
``accelerator.backward(second)`` ran that first backward with the flag the previous window's last
backward left, True, and ZeRO-2 closed the new window there, dropping the first micro step's
first loss, silently. Installed, a closed window leaves the hand-set flag False when GAS > 1.
"""

import os

import pytest
import torch

import zero_lifetime
from harness import (BACKWARD_PATHS, assert_weights_match, backward_by, full_weights, losses, make_input, make_pair)
from test_hf_trainer import Tokens, _model, second_loss

GAS, WINDOWS = 2, 2


@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_boundary_set_only_before_the_last_backward(stage, path):
    """Per micro step: the first loss backwarded as is, then the boundary set, the second loss
    backwarded and, at the window's end, step(): accelerate's order. Against torch."""
    engine, reference, optimizer = make_pair("mlp_norm", stage, gas=GAS)
    zero_lifetime.install(engine)
    for window in range(WINDOWS):
        for micro in range(GAS):
            closes = micro == GAS - 1
            x = make_input("mlp_norm", 10 * window + micro)
            l1, l2 = losses(engine(x))
            backward_by(engine, l1, path, retain_graph=True)
            engine.set_gradient_accumulation_boundary(closes)
            backward_by(engine, l2, path)
            if closes:
                engine.step()
            r1, r2 = losses(reference(x))
            ((r1 + r2) / GAS).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_weights_match(engine, reference)


def _accelerate_run(stage, gas, train_step, install):
    """Three windows of a plain accelerate loop (``accelerator.accumulate``) over the four
    sequences of ``Tokens``, 4 // gas per micro step; the model's full weights after."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = {"train_micro_batch_size_per_gpu": 4 // gas, "gradient_accumulation_steps": gas,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    accelerator = Accelerator(gradient_accumulation_steps=gas, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = _model()
    engine, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    if install:
        zero_lifetime.install(engine)
    sequences = [Tokens()[i] for i in range(4)]
    for _ in range(3):
        for micro in range(gas):
            part = sequences[micro * (4 // gas):(micro + 1) * (4 // gas)]
            batch = {key: torch.stack([s[key] for s in part]) for key in part[0]}
            with accelerator.accumulate(engine):
                train_step(engine, accelerator, engine(**batch))
                optimizer.step()  # accelerate's DeepSpeed wrappers: nothing, engine.step() ran
                optimizer.zero_grad()
    return full_weights(engine)


def _summed(engine, accelerator, out):
    accelerator.backward(out.loss + second_loss(out.logits))


def _first_loss_by_the_engine(engine, accelerator, out):
    engine.backward(out.loss, retain_graph=True)
    accelerator.backward(second_loss(out.logits))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accelerate_loop_with_two_losses_matches_one_large_batch(stage):
    """The two-loss step in a plain accelerate loop at GAS 2, installed, against the stock
    summed loss at GAS 1 over the same sequences (equal lengths: the same mean)."""
    want = _accelerate_run(stage, 1, _summed, install=False)
    got = _accelerate_run(stage, GAS, _first_loss_by_the_engine, install=True)
    for name, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=f"param {name}")
