"""Backwards that DeepSpeed runs itself around the user's, installed, against plain torch (1 rank).

DeepSpeed's tiled compute (``deepspeed.runtime.sequence_parallel.ulysses_sp``) runs a module
shard by shard along the sequence, each shard backwarded by a ``torch.autograd.backward`` of
its own. Until the last shard the params carry ``ds_grad_is_ready = False``, and DeepSpeed
leaves their summing gradient in ``.grad``, reducing it whole at the last. ``TiledMLP`` and
``SequenceTiledCompute`` do that inside the user's backward; ``TiledFusedLogitsLoss`` inside
its forward, so its shard backwards come before the user's (inside the engine's forward, or
after it when the training loop applies the loss to the engine's output). Also a
``torch.autograd.grad`` inside the forward, which writes no ``.grad``. Stages 1-3, with and
without CPU optimizer offload, one backward and two over one forward, against the same modules
untiled in plain torch.
"""

import contextlib
import copy
import gc

import pytest
import torch

import deepspeed
import zero_lifetime
from harness import (BACKWARD_PATHS, assert_weights_match, backward_both, backward_by, ds_config, losses,
                     reference_step_both, released_state)

ulysses_sp = pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")

HIDDEN, FFN, SEQ, SHARDS = 8, 16, 6, 3
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


class TiledMLPModel(torch.nn.Module):
    """A SwiGLU MLP between two Linears; ``tiled``: the MLP through DeepSpeed's TiledMLP."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.gate_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = torch.nn.Linear(FFN, HIDDEN, bias=False)
        self.out = torch.nn.Linear(HIDDEN, 4)
        self.tiled = False

    def mlp(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.tiled:
            params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
            h = h + ulysses_sp.TiledMLP.apply(TiledMLPModel.mlp, self, h, SHARDS, params)
        else:
            h = h + self.mlp(h)
        return self.out(h)


def _batch(step):
    return torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(step))


def _pair(model_class, stage, offload=False):
    """An engine over the tiled model, and the same model untiled in plain torch with its SGD."""
    torch.manual_seed(0)
    model = model_class()
    reference = copy.deepcopy(model)
    model.tiled = True
    config = ds_config(stage, **(OFFLOAD if offload else {}))
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine, reference, torch.optim.SGD(reference.parameters(), lr=0.1)


@contextlib.contextmanager
def _installed(engine, policy=None):
    zero_lifetime.install(engine, policy=policy)
    try:
        yield
    finally:
        zero_lifetime.uninstall(engine)
        engine.destroy()


def _step_both(engine, ref_opt, got, want, backwards, path="engine"):
    """One step on the engine and on the torch reference from their two losses: one backward
    of their sum, or (backwards == 2) the first retained, then the second."""
    if backwards == 1:
        backward_by(engine, got[0] + got[1], path)
        (want[0] + want[1]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    else:
        backward_both(engine, *got, path, zero_grad=False)
        reference_step_both(ref_opt, *want, zero_grad=False)
    engine.step()


def _train(engine, reference, ref_opt, backwards, path):
    """Three steps of the model's two losses on the engine and on the torch reference."""
    for step in range(3):
        _step_both(engine, ref_opt, losses(engine(_batch(step))), losses(reference(_batch(step))), backwards, path)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
def test_tiled_mlp_installed_matches_torch(stage, backwards, path, offload):
    engine, reference, ref_opt = _pair(TiledMLPModel, stage, offload)
    with _installed(engine):
        _train(engine, reference, ref_opt, backwards, path)
        assert_weights_match(engine, reference)
        assert zero_lifetime.stats(engine)["filled_grads"] > 0  # the fused fill carried the gradients


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stock_tiled_mlp_one_backward_matches_torch(stage):
    """The oracle (the MLP untiled) against DeepSpeed itself."""
    engine, reference, ref_opt = _pair(TiledMLPModel, stage)
    try:
        _train(engine, reference, ref_opt, 1, "engine")
        assert_weights_match(engine, reference)
    finally:
        engine.destroy()


def test_stock_tiled_mlp_two_backwards_fail_on_zero3():
    """What install fixes, with tiled compute too."""
    engine, reference, ref_opt = _pair(TiledMLPModel, 3)
    try:
        with pytest.raises(RuntimeError, match="must match the size of tensor"):
            _train(engine, reference, ref_opt, 2, "engine")
    finally:
        engine.destroy()


VOCAB = 11


class TiledLossModel(torch.nn.Module):
    """Hidden states, then an LM head whose loss is DeepSpeed's TiledFusedLogitsLoss (``tiled``) or
    plain cross entropy over the full logits: the tiled loss backwards each shard inside its
    *forward*, so the head's gradient exists before any backward is called."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.tiled = False
        self.loss_outside = False  # return the hidden states: the caller computes the loss

    def shard_loss(self, x, y):
        return torch.nn.functional.cross_entropy(self.lm_head(x).reshape(-1, VOCAB), y.reshape(-1))

    def forward(self, x, labels):
        hidden = torch.tanh(self.inp(x))
        if self.loss_outside:
            return hidden.pow(2).mean(), hidden
        if self.tiled:
            loss = ulysses_sp.TiledFusedLogitsLoss.apply(TiledLossModel.shard_loss, self, hidden, labels, None,
                                                         SHARDS, [self.lm_head.weight], "mean")
        else:
            loss = self.shard_loss(hidden, labels)
        return hidden.pow(2).mean(), loss


class SequenceTiledLossModel(TiledLossModel):
    """The same loss through DeepSpeed's generic SequenceTiledCompute, which (like TiledMLP) runs
    the shards in the user's backward, recomputing each."""

    def forward(self, x, labels):
        if not self.tiled:
            return super().forward(x, labels)
        hidden = torch.tanh(self.inp(x))
        loss = ulysses_sp.SequenceTiledCompute.apply(self.shard_loss_by_name, SEQ, SHARDS, ["x", "y"], [], "x",
                                                     [self.lm_head.weight], 0, "mean", hidden, labels)
        return hidden.pow(2).mean(), loss

    def shard_loss_by_name(self, x, y):
        return self.shard_loss(x, y)


def _labels(step):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def _train_with_labels(engine, reference, ref_opt, backwards, path="engine"):
    """Three steps of a loss model's two losses (computed inside its forward)."""
    for step in range(3):
        _step_both(engine, ref_opt, engine(_batch(step), _labels(step)), reference(_batch(step), _labels(step)),
                   backwards, path)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
def test_tiled_fused_logits_loss_installed_matches_torch(stage, backwards, offload):
    """backwards 2: a second loss over the same hidden states backwarded first, retained.

    The tiled loss's shards are backwards of their own inside the forward; the head's gradient
    is reduced at the last, on ZeRO-3 in a later micro step than the window's first, so it must
    overwrite what the head's accumulator held from the last step (it was added to it: the
    head's previous gradient applied again)."""
    engine, reference, ref_opt = _pair(TiledLossModel, stage, offload)
    with _installed(engine):
        _train_with_labels(engine, reference, ref_opt, backwards)
        assert_weights_match(engine, reference)


def _train_loss_after_the_forward(engine, reference, ref_opt, backwards, path="engine"):
    """Three steps, the tiled loss applied to the engine's output by the training loop: its
    shard backwards come between the forward and the user's backward (or backwards: the first,
    of a second loss over the same hidden states, retained)."""
    engine.module.loss_outside = True  # the torch twin computes its (untiled) loss inside
    for step in range(3):
        aux, hidden = engine(_batch(step), _labels(step))
        loss = ulysses_sp.TiledFusedLogitsLoss.apply(TiledLossModel.shard_loss, engine.module, hidden, _labels(step),
                                                     None, SHARDS, [engine.module.lm_head.weight], "mean")
        _step_both(engine, ref_opt, (aux, loss), reference(_batch(step), _labels(step)), backwards, path)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
def test_tiled_fused_logits_loss_after_the_forward_matches_torch(stage, backwards, path, offload):
    """DeepSpeed holds the shards' gradients back and reduces them in the user's backward, as
    if the loss had been computed inside the forward. Taken as backwards of their own, the
    last shard reduced the head's gradient in a micro step before the user's: with ZeRO-1/2
    CPU offload the head was then trained wrong from the first step (0.008 off)."""
    engine, reference, ref_opt = _pair(TiledLossModel, stage, offload)
    with _installed(engine):
        _train_loss_after_the_forward(engine, reference, ref_opt, backwards, path)
        assert_weights_match(engine, reference)


@pytest.mark.parametrize("policy", ["regather", "pin"])
def test_tiled_loss_after_the_forward_leaves_nothing_gathered_on_zero3(policy):
    """The shards gather the head outside the engine's forward and backward; as they join the
    user's backward, whatever they gathered or pinned must be let go as after any backward."""
    engine, reference, ref_opt = _pair(TiledLossModel, 3)
    with _installed(engine, policy):
        _train_loss_after_the_forward(engine, reference, ref_opt, 2)
        assert_weights_match(engine, reference)
        gc.collect()
        assert released_state(engine) == ([], [])
        stats = zero_lifetime.stats(engine)
        assert stats["live_handles"] == 0 and stats["pinned_bytes"] == 0, stats


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
def test_sequence_tiled_compute_installed_matches_torch(stage, backwards, path, offload):
    engine, reference, ref_opt = _pair(SequenceTiledLossModel, stage, offload)
    with _installed(engine):
        _train_with_labels(engine, reference, ref_opt, backwards, path)
        assert_weights_match(engine, reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stock_sequence_tiled_compute_one_backward_matches_torch(stage):
    """The oracle (the loss untiled) against DeepSpeed itself."""
    engine, reference, ref_opt = _pair(SequenceTiledLossModel, stage)
    try:
        _train_with_labels(engine, reference, ref_opt, 1)
        assert_weights_match(engine, reference)
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
def test_stock_tiled_fused_logits_loss_after_the_forward_matches_torch(stage, offload):
    """The oracle against DeepSpeed itself (one backward: stock ZeRO-3 cannot do two)."""
    engine, reference, ref_opt = _pair(TiledLossModel, stage, offload)
    try:
        _train_loss_after_the_forward(engine, reference, ref_opt, 1)
        assert_weights_match(engine, reference)
    finally:
        engine.destroy()


class GradInForwardModel(torch.nn.Module):
    """A forward that takes torch.autograd.grad of params: a penalty on the first layer's
    gradient (kept in the graph, MAML-style), and a probe whose gradient is only read (the probe
    gets no gradient from the loss). Backwards inside the forward that write no .grad."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.probe = torch.nn.Linear(HIDDEN, 1)
        self.out = torch.nn.Linear(HIDDEN, 4)
        self.tiled = False  # no tiled form: the same model on both sides

    def forward(self, x):
        hidden = torch.tanh(self.inp(x))
        weight_grad, = torch.autograd.grad(hidden.pow(2).sum(), self.inp.weight, create_graph=True)
        probe_grad, = torch.autograd.grad(self.probe(x).pow(2).sum(), self.probe.weight)
        return self.out(hidden) + 0.01 * weight_grad.pow(2).sum() + 0.01 * probe_grad.sum()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("backwards", [1, 2])
def test_autograd_grad_inside_the_forward_matches_torch(stage, backwards):
    engine, reference, ref_opt = _pair(GradInForwardModel, stage)
    with _installed(engine):
        _train(engine, reference, ref_opt, backwards, "engine")
        assert_weights_match(engine, reference)
