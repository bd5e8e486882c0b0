"""A block applied twice in one forward (shared weights, as in ALBERT) under activation
checkpointing, 1 rank, against plain torch.

Reentrant checkpointing (``use_reentrant=True``) runs each application's backward as a
backward of its own, so the shared params' .grad accumulates, and their gradient hooks fire,
once per application. DeepSpeed reduces a param once per backward: stock ZeRO-2 and 3 fail on
an assertion, and ZeRO-3 with a reduce bucket smaller than the model reduces the bucket between
the two and keeps only the last share, silently. Installed refuses with an error that names
the param and the fix. Non-reentrant checkpointing accumulates once and trains like torch.
"""

import copy

import deepspeed
import pytest
import torch
import torch.nn.functional as F

import zero_lifetime
from harness import (DS_VERSION, HIDDEN, IN, OUT, TiedLM, assert_weights_match, ds_config, losses, make_input,
                     two_backwards_step_like_torch)
from zero_lifetime.grad_hook_guard import GradientReducedTwiceError

# Smaller than the model's params (about 700 elements): the bucket is reduced mid-backward.
SMALL_BUCKET = {"reduce_bucket_size": 16}


class SharedBlockTwice(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.reentrant = True
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.block = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
        self.out = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(h)


def _pair(stage, make_model=None, **zero):
    """An engine over ``make_model()`` (SharedBlockTwice), a torch copy and its SGD."""
    torch.manual_seed(0)
    model = (make_model or SharedBlockTwice)()
    reference = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, **zero),
                                      model_parameters=model.parameters())
    return engine, reference, torch.optim.SGD(reference.parameters(), lr=0.1)


def _train_like_torch(engine, reference, ref_opt, steps, first_input=0):
    """Steps of two retained backwards (the two losses), checked against torch after each."""
    for step in range(first_input, first_input + steps):
        x = make_input("mlp_norm", step)
        two_backwards_step_like_torch(engine, engine(x), reference, ref_opt, reference(x))


@pytest.mark.parametrize("zero", [{}, SMALL_BUCKET, {"overlap_comm": True}],
                         ids=["default_bucket", "small_bucket", "overlap_comm"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reentrant_checkpointing_of_a_block_applied_twice_is_refused_then_training_goes_on(stage, zero):
    """Where DeepSpeed buckets each gradient as its hook fires (ZeRO-2 and 3, ZeRO-1 with
    overlap_comm at the boundary): the error names a shared param and the fix, and nothing of
    that backward is applied; the same model with use_reentrant=False then trains like torch."""
    engine, reference, ref_opt = _pair(stage, **zero)
    zero_lifetime.install(engine)
    if stage == 1 and not zero.get("overlap_comm"):
        # No hook buckets anything: DeepSpeed reduces the summed .grad at the boundary.
        _train_like_torch(engine, reference, ref_opt, steps=2)
        return
    l1, _ = losses(engine(make_input("mlp_norm", 0)))
    with pytest.raises(GradientReducedTwiceError, match=r"block\.0\.(weight|bias).*use_reentrant=False"):
        engine.backward(l1)
    engine.module.reentrant = reference.reentrant = False
    _train_like_torch(engine, reference, ref_opt, steps=2, first_input=1)


@pytest.mark.parametrize("stage", [2, 3])
def test_non_reentrant_checkpointing_of_a_block_applied_twice_trains_like_torch(stage):
    engine, reference, ref_opt = _pair(stage, **SMALL_BUCKET)
    engine.module.reentrant = reference.reentrant = False
    zero_lifetime.install(engine)
    _train_like_torch(engine, reference, ref_opt, steps=2)


def test_stock_zero3_with_a_small_bucket_keeps_only_the_last_application_silently():
    """Why install refuses rather than passing it on: stock gives no error, and wrong weights."""
    engine, reference, ref_opt = _pair(3, **SMALL_BUCKET)
    x = make_input("mlp_norm", 0)
    engine.backward(losses(engine(x))[0])
    engine.step()
    losses(reference(x))[0].backward()
    ref_opt.step()
    with pytest.raises(AssertionError, match=r"block\.0\.weight"):
        assert_weights_match(engine, reference)


class TiedHeadCheckpointed(TiedLM):
    """The embedding outside a reentrant checkpoint, its weight also the head's inside it."""

    def _head(self, h):
        return F.linear(self.ln(torch.tanh(self.mix(h))), self.emb.weight)

    def forward(self, tokens):
        return torch.utils.checkpoint.checkpoint(self._head, self.emb(tokens), use_reentrant=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_tied_weight_inside_and_outside_a_reentrant_checkpoint_is_refused(stage):
    engine, _, _ = _pair(stage, TiedHeadCheckpointed)
    zero_lifetime.install(engine)
    with pytest.raises(GradientReducedTwiceError, match=r"emb\.weight.*tied embedding"):
        engine.backward(sum(losses(engine(make_input("tied_lm", 0)))))


class SharedBlockUnderDeepSpeedCheckpoint(SharedBlockTwice):
    """The same, under DeepSpeed's own checkpoint (always reentrant)."""

    def forward(self, x):
        from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint
        h = self.inp(x)
        for _ in range(2):
            h = checkpoint(self.block, h)
        return self.out(h)


@pytest.mark.skipif(DS_VERSION in ("0.17.6", "0.18.9"),
                    reason="this DeepSpeed's checkpoint needs an accelerator Stream: none on the CPU")
@pytest.mark.parametrize("stage", [2, 3])
def test_a_block_applied_twice_under_deepspeeds_checkpoint_is_refused(stage):
    engine, _, _ = _pair(stage, SharedBlockUnderDeepSpeedCheckpoint)
    zero_lifetime.install(engine)
    with pytest.raises(GradientReducedTwiceError, match=r"block\.0\..*deepspeed\.checkpointing\.checkpoint"):
        engine.backward(losses(engine(make_input("mlp_norm", 0).requires_grad_(True)))[0])
