"""ZeRO-1/2 IPG buckets filled by one fused bucket_fill per flush: same training as torch,
the gradients alias their bucket slices when DeepSpeed reduces, and the fused path runs."""

import pytest
import torch

import deepspeed
import multitask as mt
import zero_lifetime
from zero_lifetime import ops

STEPS = 3


def _engine(stage, bucket, dtype="fp32", offload=False, mode="per_task", **zero):
    model, reference = mt.make_models()
    cfg = mt.config(stage, mode, offload, dtype, bucket=bucket)
    cfg["zero_optimization"].update(zero)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine, reference


# 100: a few grads per flush, trunk.weight (128 elements) bypasses the bucket as DeepSpeed
# does for oversized grads; 10_000: everything in one flush.
@pytest.mark.parametrize("bucket", [100, 10_000])
@pytest.mark.parametrize("overlap_comm", [True, False])
@pytest.mark.parametrize("stage", [1, 2])
def test_training_matches_torch_and_fill_is_fused(stage, overlap_comm, bucket):
    engine, reference = _engine(stage, bucket, overlap_comm=overlap_comm)
    fill = zero_lifetime.install(engine).bucket_fill
    mt.train_engine(engine, "per_task", STEPS)
    mt.train_reference(reference, "per_task", STEPS)
    diffs = mt.max_differences(engine, reference)
    assert max(diffs.values()) <= 1e-5, diffs
    assert fill.fills > 0 and fill.fused_grads > fill.fills, (fill.fills, fill.fused_grads)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_offload_matches_bf16_without_install_single_backward(stage):
    """Summed loss (GAS 1): stock DeepSpeed is right there, so it is the bf16 oracle."""
    stock, _ = _engine(stage, 100, dtype="bf16", offload=True, mode="summed")
    fused, _ = _engine(stage, 100, dtype="bf16", offload=True, mode="summed")
    zero_lifetime.install(fused)
    for engine in (stock, fused):
        mt.train_engine(engine, "summed", STEPS, dtype="bf16")
    got, want = mt.engine_weights(fused), mt.engine_weights(stock)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


def test_grads_alias_bucket_when_reduced():
    engine, _ = _engine(2, 10_000)
    fill = zero_lifetime.install(engine).bucket_fill
    seen = []
    original = fill.buckets.stock_reduce

    def checking_reduce(comm_dtype=None):
        for dtype, bucket in engine.optimizer.ipg_buckets.items():
            if comm_dtype not in (None, dtype) or not bucket.grads:
                continue
            buffer = bucket.buffer[bucket.index]
            start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
            seen.extend(start <= g.data_ptr() < end for g in bucket.grads)
        # DeepSpeed 0.17.6's reduce_ipg_grads() takes no dtype (it reduces every bucket).
        return original() if comm_dtype is None else original(comm_dtype=comm_dtype)

    fill.buckets.stock_reduce = checking_reduce
    mt.train_engine(engine, "summed", 1)
    assert seen and all(seen), seen


def test_fused_op_is_what_fills(monkeypatch):
    """The fill goes through ops.bucket_fill, a whole bucket per call."""
    calls = []
    real = ops.bucket_fill
    monkeypatch.setattr(ops, "bucket_fill", lambda buf, ts, offs, scale=1.0: (calls.append(len(ts)),
                                                                               real(buf, ts, offs, scale)))
    engine, _ = _engine(2, 10_000)
    zero_lifetime.install(engine)
    mt.train_engine(engine, "summed", 1)
    trainable = sum(1 for p in engine.module.parameters() if p.requires_grad)
    assert calls == [trainable], calls


def test_uninstall_restores_the_per_param_path():
    engine, _ = _engine(2, 10_000)
    optimizer = engine.optimizer
    originals = (optimizer.reduce_independent_p_g_buckets_and_remove_grads, optimizer.reduce_ipg_grads)
    zero_lifetime.install(engine)
    zero_lifetime.uninstall(engine)
    assert (optimizer.reduce_independent_p_g_buckets_and_remove_grads, optimizer.reduce_ipg_grads) == originals
    assert "reduce_ipg_grads" not in optimizer.__dict__


@pytest.mark.parametrize("source_readable", [True, False])
def test_epilogue_rule_fix_follows_the_release_even_without_source(monkeypatch, source_readable):
    """0.17.6's epilogue sums micro-steps by the wrong test; the fix is found by reading
    DeepSpeed's source, and by the release when no source can be read (.pyc-only installs)."""
    import inspect

    from zero_lifetime.adapters import zero12_epilogue
    from zero_lifetime.adapters.errors import deepspeed_version
    from harness import make_pair
    engine, _, _ = make_pair("mlp_norm", 2)
    try:
        if not source_readable:
            def no_source(obj):
                raise OSError("could not get source code")
            monkeypatch.setattr(inspect, "getsource", no_source)
        rule = zero12_epilogue.Zero12Epilogue(engine.optimizer)
        assert rule.needs_fix == (deepspeed_version() == "0.17.6")
    finally:
        engine.destroy()
