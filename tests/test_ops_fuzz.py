"""Fuzz the compiled fused copy ops against the pure-torch reference.

Random cases: tensor counts (0 to thousands), sizes (empty, 1, odd, up to ~70K), source
and buffer dtypes (fp32/bf16/fp16, mixed in one call), offsets with random gaps and
order, scales, non-contiguous sources, sources that are their own destination slice,
and ~10% invalid inputs (overlaps, out of bounds, aliasing), which must fail with the
reference's message and leave the buffer untouched. Results must be bit-identical. On CPU
every case runs twice: with the default store path (small destinations: cached stores) and
with non-temporal stores forced on (ops.set_streaming_store_threshold(0)), whose aligned body,
unaligned head and tail must give the same bits.

ZL_FUZZ_CASES sets the number of cases per op (CI default 1500; release testing: 20000).
The figures are printed (pytest -s) and recorded in docs/reliability.md.
"""

import os
import random

import pytest
import torch

from compiled import compiled_ops_or_skip
from zero_lifetime import ops, ops_reference

CASES = int(os.environ.get("ZL_FUZZ_CASES", "1500"))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU"))]


@pytest.fixture(params=["default_stores", "streaming_stores"])
def store_path(request):
    """The CPU store path: as configured, or non-temporal stores for every destination."""
    if request.param == "default_stores":
        yield request.param
        return
    compiled_ops_or_skip()
    with ops.streaming_stores(0):
        yield request.param


def _native_or_skip():
    compiled_ops_or_skip()
    return torch.ops.zero_lifetime.bucket_fill.default, torch.ops.zero_lifetime.gather_copy_out.default


def _size(rng):
    kind = rng.random()
    if kind < 0.1:
        return 0
    if kind < 0.2:
        return 1
    if kind < 0.7:
        return rng.randint(2, 300)
    if kind < 0.95:
        return rng.randint(301, 5000)
    return rng.randint(5001, 70000)


def _source(rng, n, dtype, device):
    if n >= 4 and rng.random() < 0.15:  # non-contiguous: a transposed 2-D block or a strided slice
        if rng.random() < 0.5 and n % 2 == 0:
            return torch.randn(2, n // 2, device=device).to(dtype).t()
        return torch.randn(2 * n, device=device).to(dtype)[::2]
    return torch.randn(n, device=device).to(dtype)


def _bucket_case(rng, device):
    count = rng.randint(0, 40) if rng.random() < 0.9 else rng.randint(500, 3000)
    sizes = [(_size(rng) if count < 100 else rng.randint(0, 64)) for _ in range(count)]
    mixed = rng.random() < 0.5
    one_dtype = rng.choice(DTYPES)
    tensors = [_source(rng, n, rng.choice(DTYPES) if mixed else one_dtype, device) for n in sizes]
    order = list(range(count))
    rng.shuffle(order)
    offsets, position = [0] * count, 0
    for i in order:
        position += rng.choice((0, 0, rng.randint(1, 9)))
        offsets[i] = position
        position += sizes[i]
    buffer = torch.randn(position + rng.randint(0, 9), device=device).to(rng.choice(DTYPES))
    scale = 1.0 if rng.random() < 0.5 else rng.choice((0.5, 0.25, 1 / 3, 2.0, -1.5))
    own = None  # a source that already is its own destination slice (DeepSpeed re-pointed it)
    if count and rng.random() < 0.1:
        i = rng.randrange(count)
        if sizes[i]:
            own = i
    invalid = None
    if count >= 2 and rng.random() < 0.1:
        invalid = rng.choice(("overlap", "bounds", "alias"))
        i, j = rng.sample(range(count), 2)
        if own in (i, j):
            invalid = None
        elif invalid == "overlap" and sizes[i] and sizes[j]:
            offsets[j] = offsets[i]
        elif invalid == "bounds":
            offsets[i] = buffer.numel() - sizes[i] + 1
        elif invalid == "alias" and sizes[j] >= 2 and sizes[i]:
            tensors[i] = buffer.narrow(0, offsets[j], 1).expand(sizes[i])
        else:
            invalid = None
    return buffer, tensors, offsets, scale, invalid, own


def _with_own_slice(buffer, tensors, offsets, own):
    """The sources, with the own-slice one pointing into ``buffer`` (each run writes a clone)."""
    if own is None:
        return tensors
    tensors = list(tensors)
    tensors[own] = buffer.narrow(0, offsets[own], tensors[own].numel())
    return tensors


def _gather_case(rng, device):
    world = rng.randint(1, 8)
    count = rng.randint(0, 30) if rng.random() < 0.9 else rng.randint(300, 1500)
    shards = [(rng.randint(0, 2000) if count < 100 else rng.randint(0, 40)) for _ in range(count)]
    numels = [0 if s == 0 else rng.randint(max(0, (world - 1) * s - s + 1), world * s) for s in shards]
    gathered = torch.randn(world * sum(shards), device=device).to(rng.choice(DTYPES))
    out = torch.empty(sum(numels), device=device, dtype=rng.choice(DTYPES))
    invalid = None
    if count and rng.random() < 0.1:
        i = rng.randrange(count)
        numels[i] = world * shards[i] + 1  # more than the gathered shards hold
        out = torch.empty(sum(numels), device=device, dtype=out.dtype)
        invalid = "numel"
    return gathered, out, shards, numels, world, invalid


def _run(fn, *args):
    try:
        fn(*args)
        return None
    except RuntimeError as exc:
        return str(exc).splitlines()[0]


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_bucket_fill(device, store_path):
    native_fill, _ = _native_or_skip()
    rng = random.Random(20261122)
    stats = {"cases": 0, "invalid": 0, "own_slice": 0, "tensors": 0, "elements": 0}
    for case in range(CASES):
        buffer, tensors, offsets, scale, invalid, own = _bucket_case(rng, device)
        # Alternate the dispatcher op and the public API (its direct entry on CPU and CUDA).
        fused = native_fill if case % 2 else ops.bucket_fill
        got, want = buffer.clone(), buffer.clone()
        err_got = _run(fused, got, _with_own_slice(got, tensors, offsets, own), offsets, scale)
        err_want = _run(ops_reference.bucket_fill, want, _with_own_slice(want, tensors, offsets, own), offsets, scale)
        context = f"case {case}: {len(tensors)} tensors, buffer {buffer.dtype}[{buffer.numel()}], scale {scale}"
        assert err_got == err_want, f"{context}: fused {err_got!r} vs reference {err_want!r}"
        if err_want is not None:
            assert invalid is not None, f"{context}: unexpected error {err_want}"
            assert torch.equal(got, buffer), f"{context}: a rejected call wrote to the buffer"
            stats["invalid"] += 1
        else:
            assert torch.equal(got, want), f"{context}: max diff {(got.float() - want.float()).abs().max()}"
        stats["cases"] += 1
        stats["own_slice"] += own is not None
        stats["tensors"] += len(tensors)
        stats["elements"] += sum(t.numel() for t in tensors)
    print(f"\nfuzz bucket_fill on {device} ({store_path}): {stats}")
    assert stats["invalid"] > 0 and stats["cases"] == CASES


@pytest.mark.parametrize("device", DEVICES)
def test_fuzz_gather_copy_out(device, store_path):
    _, native_gather = _native_or_skip()
    rng = random.Random(11222026)
    stats = {"cases": 0, "invalid": 0, "params": 0, "elements": 0}
    for case in range(CASES):
        gathered, out, shards, numels, world, invalid = _gather_case(rng, device)
        fused = native_gather if case % 2 else ops.gather_copy_out
        got, want = out.clone(), out.clone()
        err_got = _run(fused, gathered, got, shards, numels, world)
        err_want = _run(ops_reference.gather_copy_out, gathered, want, shards, numels, world)
        context = f"case {case}: world {world}, {len(shards)} params, {gathered.dtype}->{out.dtype}"
        assert err_got == err_want, f"{context}: fused {err_got!r} vs reference {err_want!r}"
        if err_want is None:
            assert torch.equal(got, want), f"{context}"
        else:
            assert invalid is not None, f"{context}: unexpected error {err_want}"
            stats["invalid"] += 1
        stats["cases"] += 1
        stats["params"] += len(shards)
        stats["elements"] += sum(numels)
    print(f"\nfuzz gather_copy_out on {device} ({store_path}): {stats}")
    assert stats["invalid"] > 0 and stats["cases"] == CASES
