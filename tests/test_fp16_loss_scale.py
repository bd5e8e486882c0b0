"""fp16 with dynamic loss scaling: overflow found, the step skipped, the scale halved, 1 rank.

Two backwards over one forward; in chosen steps one of the two losses is blown up so its
scaled fp16 gradients overflow (``fp16_scaling``: the loop, and the plain-torch oracle with
fp32 master weights and DeepSpeed's scale rule). An overflow that zero_grad() dropped before
the second backward must not skip the step, as with torch. 2 ranks: test_two_ranks.
"""

import pytest

import fp16_scaling as fp16
import multitask as mt
import zero_lifetime
from harness import DS_VERSION, TORCH_STYLE_BACKWARD
from multitask import STAGE_IDS, STAGES_OFFLOAD

# reduce_bucket_size: several flushes per backward with trunk.weight (128) bypassing the
# bucket, or every gradient through one fused fill.
BUCKETS = [100, 1000]
# engine.backward(loss), or the torch-style engine.scale(loss).backward() of DeepSpeed 0.18+.
PATHS = ["engine", "scale"] if TORCH_STYLE_BACKWARD else ["engine"]


def _run(stage, offload, path, zero_grad, bucket, install=True, clip=0.0, zero=None):
    """(max abs diff per param, the engine's (loss scale, skipped steps), torch's, steps torch clipped).
    ``zero``: more zero_optimization settings."""
    model, reference = mt.make_models()
    engine = fp16.build_engine(model, stage, offload, bucket, clip, zero)
    if install:
        zero_lifetime.install(engine)
    fp16.train_engine(engine, path, zero_grad)
    master, scale, skipped, clipped = fp16.train_reference(reference, zero_grad, clip=clip)
    return fp16.compare(engine, master), fp16.scale_and_skips(engine), (scale, skipped), clipped


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage,offload", STAGES_OFFLOAD, ids=STAGE_IDS)
def test_overflow_in_either_backward_skips_the_step(stage, offload, path, bucket):
    diffs, got, want, _ = _run(stage, offload, path, zero_grad=False, bucket=bucket)
    assert want[1] == 3, "the oracle should skip the three boosted steps"
    assert got == want, f"(loss scale, skipped steps): engine {got}, torch {want}"
    assert max(diffs.values()) <= 1e-4, diffs


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stage,offload", STAGES_OFFLOAD, ids=STAGE_IDS)
def test_overflow_dropped_by_zero_grad_does_not_skip(stage, offload, path, bucket):
    """The "first" step's overflow is gone with zero_grad(): that step is taken."""
    diffs, got, want, _ = _run(stage, offload, path, zero_grad=True, bucket=bucket)
    assert want[1] == 2, "only the steps whose second loss is boosted skip"
    assert got == want, f"(loss scale, skipped steps): engine {got}, torch {want}"
    assert max(diffs.values()) <= 1e-4, diffs


CLIPPING = [(stage, offload, zero_grad) for stage, offload in STAGES_OFFLOAD for zero_grad in (True, False)]


@pytest.mark.parametrize("stage,offload,zero_grad", CLIPPING,
                         ids=[f"{mt.stage_id(s, o)}-{'zero_grad' if z else 'no_zero_grad'}"
                              for s, o, z in CLIPPING])
def test_overflow_and_gradient_clipping(stage, offload, zero_grad):
    """Clipping on: the norm is taken over the unscaled, summed gradients of the steps taken."""
    diffs, got, want, clipped = _run(stage, offload, "engine", zero_grad, bucket=1000, clip=0.05)
    assert clipped >= 3, "clipping should engage in most of the steps taken"
    assert got == want, f"(loss scale, skipped steps): engine {got}, torch {want}"
    assert max(diffs.values()) <= 1e-4, diffs


WITHOUT_HOOKS = {"contiguous_gradients": False, "overlap_comm": False}


@pytest.mark.parametrize("install", [True, False], ids=["installed", "stock"])
@pytest.mark.parametrize("zero_grad", [True, False], ids=["zero_grad", "no_zero_grad"])
def test_stage1_without_gradient_hooks(zero_grad, install):
    """ZeRO-1 with no gradient hooks (.grad reduced at the boundary): an overflow in either
    backward skips the step. Stock (no zero_grad() between) keeps only the last backward
    and misses the overflows of the first; stock 0.17.6 fails in the second backward (its
    epilogue adds to a sum the first one freed, zero_grad() or not): negative controls."""
    if not install and DS_VERSION == "0.17.6":
        with pytest.raises(TypeError, match="'NoneType' object is not iterable"):
            _run(1, False, "engine", zero_grad, bucket=1000, install=False, zero=WITHOUT_HOOKS)
        return
    diffs, got, want, _ = _run(1, False, "engine", zero_grad, bucket=1000, install=install, zero=WITHOUT_HOOKS)
    if install or zero_grad:
        assert got == want, f"(loss scale, skipped steps): engine {got}, torch {want}"
        assert max(diffs.values()) <= 1e-4, diffs
    else:
        assert got[1] < want[1], (got, want)


@pytest.mark.parametrize("stage", [1, 2])
def test_stock_offload_skips_steps_torch_takes(stage):
    """Negative control, per release: stock ZeRO-1/2 with CPU offload and zero_grad() between
    the two backwards. 0.17.6 and 0.18.9 skip the step whose dropped first backward overflowed
    (the overflow flag outlives zero_grad()). 0.19.8 also leaves the overflowed gradient in its CPU
    accumulator after the skipped step, and the second backward of every later step adds to
    it (its zero_grad() starts no new window): every step after the first overflow skips."""
    _, got, want, _ = _run(stage, True, "engine", zero_grad=True, bucket=1000, install=False)
    assert want[1] == 2
    assert got[1] == (3 if DS_VERSION in ("0.17.6", "0.18.9") else len(fp16.SCHEDULE) - 1), (got, want)
