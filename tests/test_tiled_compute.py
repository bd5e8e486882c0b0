"""DeepSpeed's tiled compute (``TiledMLP``, ``SequenceTiledCompute``, from its long-sequence
training): a module run shard by shard along the sequence, its forward recomputed in backward
and each shard backwarded by a nested ``torch.autograd.backward`` inside the outer backward.
Until the last shard the params carry ``ds_grad_is_ready = False``, and DeepSpeed leaves their
accumulating gradient out of the buckets; the last shard's hook adds the whole of it. Installed,
one backward and two over one forward, stages 1-3 on 1 rank, against the same MLP untiled in
plain torch.
"""

import copy

import pytest
import torch

import deepspeed
import zero_lifetime
from harness import BACKWARD_PATHS, assert_weights_match, ds_config, losses

ulysses_sp = pytest.importorskip("deepspeed.runtime.sequence_parallel.ulysses_sp")

HIDDEN, FFN, SEQ, SHARDS = 8, 16, 6, 3


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


def _pair(stage):
    torch.manual_seed(0)
    model = TiledMLPModel()
    reference = copy.deepcopy(model)
    model.tiled = True
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage), model_parameters=model.parameters())
    return engine, reference, torch.optim.SGD(reference.parameters(), lr=0.1)


def _train(engine, reference, ref_opt, backwards, path):
    """Three steps on the engine and on the torch reference: one backward of both losses, or
    (backwards == 2) the first retained, then the second."""
    for step in range(3):
        first, second = losses(engine(_batch(step)))
        want_first, want_second = losses(reference(_batch(step)))
        if backwards == 1:
            pairs = [(first + second, want_first + want_second)]
        else:
            pairs = [(first, want_first), (second, want_second)]
        for index, (loss, want) in enumerate(pairs):
            retain = index + 1 < len(pairs)
            if path == "engine":
                engine.backward(loss, retain_graph=retain)
            else:
                loss.backward(retain_graph=retain)
            want.backward(retain_graph=retain)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad()


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_tiled_mlp_installed_matches_torch(stage, backwards, path):
    engine, reference, ref_opt = _pair(stage)
    zero_lifetime.install(engine)
    try:
        _train(engine, reference, ref_opt, backwards, path)
        assert_weights_match(engine, reference)
        assert zero_lifetime.stats(engine)["filled_grads"] > 0  # the fused fill carried the gradients
    finally:
        zero_lifetime.uninstall(engine)
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stock_tiled_mlp_one_backward_matches_torch(stage):
    """The oracle (the MLP untiled) against DeepSpeed itself."""
    engine, reference, ref_opt = _pair(stage)
    try:
        _train(engine, reference, ref_opt, 1, "engine")
        assert_weights_match(engine, reference)
    finally:
        engine.destroy()


def test_stock_tiled_mlp_two_backwards_fail_on_zero3():
    """What install fixes, with tiled compute too."""
    engine, reference, ref_opt = _pair(3)
    try:
        with pytest.raises(RuntimeError, match="must match the size of tensor"):
            _train(engine, reference, ref_opt, 2, "engine")
    finally:
        engine.destroy()
