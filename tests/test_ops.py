"""The fused copy ops (zero_lifetime.ops: bucket_fill, gather_copy_out): compiled kernels
(CPU, Meta, and CUDA when a GPU is present) and the pure-torch reference, against plain
torch expressions built independently (torch.cat of scaled, flattened tensors; DeepSpeed's
per-parameter torch.cat of shards).
"""

import inspect
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.library import opcheck

from zero_lifetime import ops, ops_reference

import kernel_paths  # tests/ is on sys.path (conftest.py)
from compiled import compiled_module_or_skip, compiled_ops_or_skip

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 7, 2**20 + 7]
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU"))]


def _native_ops(device):
    compiled_ops_or_skip()
    key = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}[device]
    if not torch._C._dispatch_has_kernel_for_dispatch_key("zero_lifetime::bucket_fill", key):
        pytest.skip(f"extension built without {key} kernels")
    return torch.ops.zero_lifetime.bucket_fill, torch.ops.zero_lifetime.gather_copy_out


@pytest.fixture(params=["native", "public", "reference"])
def impl(request):
    """(bucket_fill, gather_copy_out): the compiled CPU ops through the dispatcher, the
    public API (whose CPU bucket_fill takes the direct fast path), or the reference."""
    if request.param == "native":
        return _native_ops("cpu")
    if request.param == "public":
        _native_ops("cpu")
        return ops.bucket_fill, ops.gather_copy_out
    return ops_reference.bucket_fill, ops_reference.gather_copy_out


@pytest.fixture(params=["dispatcher", "direct"])
def route(request):
    """How a device test calls the compiled ops: through torch.ops (the dispatcher), or
    through the public API, which takes the direct entries of fast_path.cpp on CPU and CUDA."""
    return request.param


def _ops_by_route(device, route):
    native = _native_ops(device)
    return native if route == "dispatcher" else (ops.bucket_fill, ops.gather_copy_out)


class RecordingDispatchMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class PassThroughFunctionMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_direct_entries_apply_only_to_plain_tensors(device):
    _native_ops(device)
    module = compiled_module_or_skip()
    fill, gather = module.bucket_fill_fast, module.gather_copy_out_fast
    buffer = torch.zeros(8, device=device)
    version = buffer._version
    ones, twos = torch.ones(2, device=device), torch.full((3,), 2.0, device=device)
    assert fill(buffer, [ones, twos], [0, 4], 0.5) is True
    written = torch.tensor([0.5, 0.5, 0, 0, 1, 1, 1, 0])
    assert_same(buffer.cpu(), written)
    assert buffer._version > version  # as the dispatcher's in-place handling does
    out = torch.zeros(4, device=device)
    version = out._version
    assert gather(torch.arange(4.0, device=device), out, [2], [4], 2) is True
    assert_same(out.cpu(), torch.arange(4.0))
    assert out._version > version
    # Refusals: the dispatcher must run for these, and nothing may be written.
    assert fill(buffer, [torch.ones(2, device=device, requires_grad=True)], [0], 1.0) is False
    assert fill(torch.zeros(8, device="meta"), [torch.ones(2, device="meta")], [0], 1.0) is False
    assert fill(buffer, [torch.nn.Parameter(torch.ones(2, device=device))], [0], 1.0) is False
    assert gather(torch.zeros(4, device="meta"), torch.zeros(4, device="meta"), [2], [4], 2) is False
    with RecordingDispatchMode() as mode:
        assert fill(buffer, [torch.full((2,), 9.0, device=device)], [0], 1.0) is False
        assert gather(torch.zeros(4, device=device), out, [2], [4], 2) is False
        # The public API then goes through the dispatcher, where the mode sees the op.
        ops.bucket_fill(buffer, [torch.full((2,), 5.0, device=device)], [2], 1.0)
    assert any("zero_lifetime.bucket_fill" in name for name in mode.seen), mode.seen
    with PassThroughFunctionMode():
        assert fill(buffer, [torch.full((2,), 9.0, device=device)], [0], 1.0) is False
    assert_same(buffer.cpu(), torch.tensor([0.5, 0.5, 5, 5, 1, 1, 1, 0]))
    assert_same(out.cpu(), torch.arange(4.0))
    # Errors from the direct entry are the ops' own, as RuntimeError.
    with pytest.raises(RuntimeError, match="destination ranges overlap"):
        fill(buffer, [ones, twos], [0, 1], 1.0)


def test_direct_entry_reads_thousands_of_sources_on_several_threads():
    """The direct entry reads its sources on the intra-op threads from 1024 up: one source it
    must decline, wherever it sits, declines the whole call before anything is written."""
    fill = compiled_module_or_skip().bucket_fill_fast
    n = 3000
    sources = [torch.full((2,), float(i)) for i in range(n)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for order in ("ascending", "shuffled"):
            slots = list(range(n))
            if order == "shuffled":
                random.Random(1).shuffle(slots)
            offsets = [2 * slot for slot in slots]
            for position in (0, n // 2, n - 1):
                declined = list(sources)
                declined[position] = torch.ones(2, requires_grad=True)
                buffer = torch.zeros(2 * n)
                assert fill(buffer, declined, offsets, 1.0) is False
                assert not buffer.any()
            buffer = torch.zeros(2 * n)
            assert fill(buffer, sources, offsets, 1.0) is True
            assert_same(buffer, expected_bucket(sources, offsets, 2 * n, torch.float32, 1.0))
    finally:
        torch.set_num_threads(threads)


def expected_bucket(tensors, offsets, numel, dtype, scale):
    """Plain torch: zeros in the gaps, cat of the scaled flattened tensors in offset order."""
    pieces, position = [], 0
    for off, t in sorted(zip(offsets, tensors), key=lambda p: (p[0], p[1].numel())):
        pieces.append(torch.zeros(off - position, dtype=dtype, device=t.device))
        pieces.append((t.flatten().float() * scale).to(dtype))
        position = off + t.numel()
    pieces.append(torch.zeros(numel - position, dtype=dtype))
    return torch.cat([p.to(pieces[0].device) for p in pieces])


def layout(sizes, gap_max=5, seed=0):
    """Offsets with random gaps, in a random order of the tensors; and the buffer size."""
    rng = random.Random(seed)
    order = list(range(len(sizes)))
    rng.shuffle(order)
    offsets, position = [0] * len(sizes), 0
    for i in order:
        position += rng.randint(0, gap_max)
        offsets[i] = position
        position += sizes[i]
    return offsets, position + rng.randint(0, gap_max)


def assert_same(actual, expected):
    assert actual.dtype == expected.dtype
    assert torch.equal(actual.cpu(), expected.cpu()), (actual - expected).abs().max()


# ------------------------------------------------------------------ bucket_fill values
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=str)
def test_bucket_fill_dtype_pairs_and_sizes(device, src_dtype, dst_dtype, route):
    bucket_fill, _ = _ops_by_route(device, route)
    torch.manual_seed(0)
    tensors = [torch.randn(n, device=device).to(src_dtype) for n in SIZES]
    offsets, numel = layout(SIZES)
    for scale in (1.0, 0.37):
        buffer = torch.zeros(numel, dtype=dst_dtype, device=device)
        bucket_fill(buffer, tensors, offsets, scale)
        assert_same(buffer, expected_bucket(tensors, offsets, numel, dst_dtype, scale))
        reference = torch.zeros_like(buffer)
        ops_reference.bucket_fill(reference, tensors, offsets, scale)
        assert_same(buffer, reference)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=str)
def test_bucket_fill_mixed_source_dtypes_many_tensors(device, dst_dtype, route):
    """3000 tensors of mixed dtypes and odd sizes: more than one launch's argument space.
    ZL_MANY_TENSORS makes it fewer (still a table launch) for compute-sanitizer, under which
    each of the 6000 launches that make the sources takes milliseconds."""
    bucket_fill, _ = _ops_by_route(device, route)
    rng = random.Random(1)
    sizes = [rng.choice([0, 1, 3, 8, 17, 64, 1000, 4099]) for _ in range(int(os.environ.get("ZL_MANY_TENSORS", "3000")))]
    torch.manual_seed(1)
    tensors = [torch.randn(n, device=device).to(DTYPES[i % 3]) for i, n in enumerate(sizes)]
    offsets, numel = layout(sizes, gap_max=9, seed=2)
    buffer = torch.full((numel,), 7.0, dtype=dst_dtype, device=device)
    bucket_fill(buffer, tensors, offsets, 1.5)
    # Gaps keep their old content: compare the written ranges and one gap element.
    expected = expected_bucket(tensors, offsets, numel, dst_dtype, 1.5)
    written = torch.zeros(numel, dtype=torch.bool)
    for off, n in zip(offsets, sizes):
        written[off:off + n] = True
    assert_same(buffer.cpu()[written], expected.cpu()[written])
    assert bool((buffer.cpu()[~written] == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_bucket_fill_non_contiguous_sources(device, route):
    bucket_fill, _ = _ops_by_route(device, route)
    base = torch.randn(64, 48, device=device)
    tensors = [base.t(), base[::3, 1:40], base[5].view(6, 8)[:, ::2],
               torch.randn(1, device=device).expand(10), base.bfloat16().t()[3:9]]
    offsets, numel = layout([t.numel() for t in tensors], seed=3)
    buffer = torch.zeros(numel, device=device, dtype=torch.float16)
    bucket_fill(buffer, tensors, offsets, 0.5)
    assert_same(buffer, expected_bucket(tensors, offsets, numel, torch.float16, 0.5))


def test_bucket_fill_same_dtype_scale_one_is_a_bit_copy(impl):
    bucket_fill, _ = impl
    bits = torch.tensor([0x7FC1, -1, 0x0001, -0x8000], dtype=torch.int16)  # NaN payloads, -0
    src = bits.view(torch.bfloat16)
    buffer = torch.zeros(6, dtype=torch.bfloat16)
    bucket_fill(buffer, [src], [1])
    assert torch.equal(buffer[1:5].view(torch.int16), bits)


# ------------------------------------------------------------------ aliasing with the buffer
def test_bucket_fill_source_is_its_own_slice(impl):
    bucket_fill, _ = impl
    buffer = torch.arange(20, dtype=torch.float32)
    own = buffer[4:10].view(2, 3)  # as when DeepSpeed re-pointed the grad into the bucket
    other = torch.ones(3)
    bucket_fill(buffer, [own, other], [4, 12])
    expected = torch.arange(20, dtype=torch.float32)
    expected[12:15] = 1
    assert_same(buffer, expected)
    bucket_fill(buffer, [own, other], [4, 12], 2.0)  # in-place scale
    expected[4:10] *= 2
    expected[12:15] = 2
    assert_same(buffer, expected)


def test_bucket_fill_source_in_a_gap_of_the_buffer(impl):
    bucket_fill, _ = impl
    buffer = torch.arange(10, dtype=torch.float32)
    bucket_fill(buffer, [buffer[0:2]], [6])  # read-only memory outside every destination
    assert buffer[6:8].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("source", [
    lambda b: b[2:6],                        # another tensor's destination
    lambda b: b[5:9],                        # its own destination, shifted
    lambda b: b[4:12:2],                     # strided through its own destination
    lambda b: b[3:7],                        # straddles both destinations
    lambda b: b.view(torch.bfloat16)[8:12],  # same bytes, other dtype
])
def test_bucket_fill_rejects_aliasing_other_destinations(impl, source):
    bucket_fill, _ = impl
    buffer = torch.arange(16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="overlaps the destination range"):
        bucket_fill(buffer, [torch.ones(2), source(buffer)], [2, 4])


# ------------------------------------------------------------------ bucket_fill errors
ERRORS = [
    ("buffer must be a 1-D contiguous", lambda: (torch.zeros(4, 4), [torch.ones(2)], [0])),
    ("buffer must be a 1-D contiguous", lambda: (torch.zeros(8)[::2], [torch.ones(2)], [0])),
    ("is on meta but buffer is on cpu", lambda: (torch.zeros(8), [torch.ones(2, device="meta")], [0])),
    ("unsupported dtype", lambda: (torch.zeros(8), [torch.ones(2, dtype=torch.float64)], [0])),
    ("unsupported dtype", lambda: (torch.zeros(8, dtype=torch.int32), [torch.ones(2)], [0])),
    ("got 2 tensors but 1 offsets", lambda: (torch.zeros(8), [torch.ones(2), torch.ones(2)], [0])),
    (r"offsets\[0\] is negative \(-1\)", lambda: (torch.zeros(8), [torch.ones(2)], [-1])),
    (r"offsets\[0\] is negative", lambda: (torch.zeros(8), [torch.ones(0)], [-3])),
    (r"tensors\[1\] \(3 elements at offset 6\) is out of bounds of the buffer \(8 elements\)",
     lambda: (torch.zeros(8), [torch.ones(2), torch.ones(3)], [0, 6])),
    ("out of bounds", lambda: (torch.zeros(8), [torch.ones(1)], [2**62])),
    (r"destination ranges overlap: tensors\[1\] \[0, 3\) and tensors\[0\] \[2, 4\)",
     lambda: (torch.zeros(8), [torch.ones(2), torch.ones(3)], [2, 0])),
]


@pytest.mark.parametrize("match,make", ERRORS, ids=[m for m, _ in ERRORS])
def test_bucket_fill_errors(impl, match, make):
    bucket_fill, _ = impl
    buffer, tensors, offsets = make()
    before = buffer.clone()
    with pytest.raises(RuntimeError, match=match):
        bucket_fill(buffer, tensors, offsets)
    assert torch.equal(buffer, before)  # checked before anything is written


# Non-strided layouts this torch can build on the CPU: (name in c10's messages, backend, convert).
OTHER_LAYOUTS = [("Sparse", "SparseCPU", torch.Tensor.to_sparse)]
if torch.backends.mkldnn.is_available():
    OTHER_LAYOUTS.append(("Mkldnn", "MkldnnCPU", torch.Tensor.to_mkldnn))


@pytest.mark.parametrize("layout,backend,convert", OTHER_LAYOUTS, ids=[name for name, *_ in OTHER_LAYOUTS])
@pytest.mark.parametrize("make", [
    lambda convert: (torch.zeros(8), [torch.ones(2), convert(torch.ones(2))], [0, 2]),
    lambda convert: (convert(torch.zeros(8)), [torch.ones(2)], [0]),
], ids=["source", "buffer"])
def test_bucket_fill_refuses_non_strided_tensors_by_name(impl, make, layout, backend, convert):
    """Not the generic 'no data pointer' error: which tensor, its layout as c10 names it, and that
    it must be dense. Through the dispatcher, torch may refuse the backend before our kernel runs."""
    bucket_fill, _ = impl
    buffer, tensors, offsets = make(convert)
    with pytest.raises(RuntimeError, match=rf"(tensors\[1\] has layout {layout};|buffer must be a dense \(strided\) "
                                           rf"tensor, got layout {layout}$)|'{backend}' backend"):
        bucket_fill(buffer, tensors, offsets)
    if buffer.layout == torch.strided:
        assert not buffer.any()


@pytest.mark.parametrize("layout,backend,convert", OTHER_LAYOUTS, ids=[name for name, *_ in OTHER_LAYOUTS])
def test_gather_copy_out_refuses_a_non_strided_input_by_name(impl, layout, backend, convert):
    _, gather_copy_out = impl
    with pytest.raises(RuntimeError, match=rf"gathered must be a dense \(strided\) tensor, got layout {layout}$"
                                           rf"|'{backend}' backend"):
        gather_copy_out(convert(torch.zeros(4)), torch.zeros(4), [2], [4], 2)


def test_bucket_fill_empty_ranges_may_touch():
    bucket_fill, _ = _native_ops("cpu")
    buffer = torch.zeros(4)
    bucket_fill(buffer, [torch.ones(0), torch.ones(4), torch.ones(0)], [2, 0, 4])
    assert buffer.tolist() == [1.0] * 4


# ------------------------------------------------------------------ meta: 64-bit, no memory
def test_meta_validates_64_bit_offsets_without_memory():
    bucket_fill, gather_copy_out = _native_ops("meta")
    buffer = torch.empty(2**33, device="meta", dtype=torch.bfloat16)
    tensors = [torch.empty(2**31 + 1, device="meta"), torch.empty(5, device="meta")]
    bucket_fill(buffer, tensors, [2**32, 2**33 - 5])
    with pytest.raises(RuntimeError, match="out of bounds"):
        bucket_fill(buffer, tensors, [2**32, 2**33 - 4])
    with pytest.raises(RuntimeError, match="destination ranges overlap"):
        bucket_fill(buffer, tensors, [2**32, 2**32 + 2**31])
    shard = 2**31 + 3
    gathered = torch.empty(4 * shard, device="meta")
    gather_copy_out(gathered, torch.empty(4 * shard - 9, device="meta"), [shard], [4 * shard - 9], 4)
    with pytest.raises(RuntimeError, match="exceeds world_size"):
        gather_copy_out(gathered, torch.empty(4 * shard + 1, device="meta"), [shard],
                        [4 * shard + 1], 4)


def test_public_api_on_meta_and_lists():
    buffer = torch.empty(2**33, device="meta")
    ops.bucket_fill(buffer, (torch.empty(3, device="meta"),), (2**33 - 3,), 2)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["direct", "declined-to-dispatcher"])
def test_public_api_reads_one_shot_iterables_once(requires_grad):
    # The direct entry reads tensors and offsets first; where it declines (autograd), the op
    # must still get every item, so one-shot iterables are materialised before either.
    grads = [torch.randn(5, requires_grad=requires_grad), torch.randn(3)]
    buffer = torch.zeros(8)
    with torch.no_grad():
        ops.bucket_fill(buffer, iter(grads), iter([3, 0]), 2.0)
    expected = torch.cat([grads[1], grads[0]]).detach() * 2.0
    torch.testing.assert_close(buffer, expected, rtol=0, atol=0)


# ------------------------------------------------------------------ gather_copy_out
def deepspeed_unshard(gathered, shard_numels, numels, world_size, dtype):
    """AllGatherCoalescedHandle.wait: one torch.cat of the ranks' shards per parameter."""
    segment, offset, params = sum(shard_numels), 0, []
    for shard, n in zip(shard_numels, numels):
        pieces = [gathered.narrow(0, r * segment + offset, shard) for r in range(world_size)]
        params.append(torch.cat(pieces)[:n].to(dtype))
        offset += shard
    return torch.cat(params) if params else torch.empty(0, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32), (torch.float32, torch.bfloat16)], ids=str)
def test_gather_copy_out(device, world_size, src_dtype, dst_dtype, route):
    _, gather_copy_out = _ops_by_route(device, route)
    rng = random.Random(world_size)
    numels = [rng.choice([0, 1, 5, 64, 1001, 2**18 + 3]) for _ in range(40)]
    shard_numels = [-(-n // world_size) + rng.choice([0, 0, 1]) for n in numels]  # padded
    gathered = torch.randn(world_size * sum(shard_numels), device=device).to(src_dtype)
    out = torch.full((sum(numels),), 3.0, device=device, dtype=dst_dtype)
    gather_copy_out(gathered, out, shard_numels, numels, world_size)
    expected = deepspeed_unshard(gathered, shard_numels, numels, world_size, dst_dtype)
    assert_same(out, expected)
    reference = torch.empty_like(out)
    ops_reference.gather_copy_out(gathered, reference, shard_numels, numels, world_size)
    assert_same(out, reference)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_copy_out_many_params(device, route):
    _, gather_copy_out = _ops_by_route(device, route)
    numels = [random.Random(i).randint(1, 300) for i in range(3000)]
    shard_numels = [-(-n // 2) for n in numels]
    gathered = torch.randn(2 * sum(shard_numels), device=device)
    out = torch.empty(sum(numels), device=device)
    gather_copy_out(gathered, out, shard_numels, numels, 2)
    assert_same(out, deepspeed_unshard(gathered, shard_numels, numels, 2, torch.float32))


# CUDA launches pass up to 64 segments in the kernel's arguments and longer lists through a
# device table; these counts sit on both sides of that limit (on CPU: the same plan, one path).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [1, 63, 64, 65, 200])
def test_segment_counts_around_the_inline_limit(device, count, route):
    bucket_fill, gather_copy_out = _ops_by_route(device, route)
    rng = random.Random(count)
    # Sizes around the kernels' 8192-element chunk, some odd (unaligned starts after them).
    sizes = [rng.choice([1, 7, 4096, 8191, 8192, 8193, 3 * 8192 + 5]) for _ in range(count)]
    tensors = [torch.randn(n, device=device).to(DTYPES[i % 2]) for i, n in enumerate(sizes)]
    offsets, numel = layout(sizes, seed=count)
    buffer = torch.zeros(numel, device=device)
    bucket_fill(buffer, tensors, offsets, 0.25)
    assert_same(buffer, expected_bucket(tensors, offsets, numel, torch.float32, 0.25))
    # gather: count segments = params x world
    world = 2 if count % 2 == 0 else 1
    numels = sizes[: max(1, count // world)]
    shard_numels = [-(-n // world) for n in numels]
    gathered = torch.randn(world * sum(shard_numels), device=device).to(torch.bfloat16)
    out = torch.empty(sum(numels), device=device)
    gather_copy_out(gathered, out, shard_numels, numels, world)
    assert_same(out, deepspeed_unshard(gathered, shard_numels, numels, world, torch.float32))


# CUDA plans with no cast and no scale may run as one cudaMemcpyAsync per segment instead
# of the kernel (ops.set_cuda_memcpy_segment_bytes; off by default until measured on a GPU).
@pytest.fixture
def memcpy_route_forced():
    _native_ops("cpu")
    with ops.cuda_memcpy_route():
        yield


def _cuda_activity(fn):
    """Names of the CUDA kernels and memcpys ``fn`` ran."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.key for event in prof.key_averages()]


def _ran_kernel(names):
    return any("copy_plan" in name for name in names)


def _ran_memcpy(names):
    return any("memcpy" in name.lower() and "dtod" in name.lower().replace(" ", "") for name in names)


def _assert_routes(observed):
    """observed: (names the profiler saw, whether the memcpy route was due) per call. Under
    compute-sanitizer the profiler sees nothing (CUPTI takes one subscriber): then only the
    results, checked before, count."""
    if not any(names for names, _ in observed):
        pytest.skip("the CUDA profiler recorded nothing (compute-sanitizer?): results checked, routes not")
    for names, memcpy_due in observed:
        assert (_ran_memcpy(names), _ran_kernel(names)) == (memcpy_due, not memcpy_due), names


def test_cpu_copies_ignore_the_cuda_memcpy_route(memcpy_route_forced, impl):
    bucket_fill, gather_copy_out = impl
    sizes = [8193, 7, 1]
    tensors = [torch.randn(n) for n in sizes]
    offsets, numel = layout(sizes, seed=4)
    buffer = torch.zeros(numel)
    bucket_fill(buffer, tensors, offsets, 1.0)
    assert_same(buffer, expected_bucket(tensors, offsets, numel, torch.float32, 1.0))
    gathered = torch.randn(2 * 4100)
    out = torch.empty(8199)
    gather_copy_out(gathered, out, [4097, 3], [8193, 6], 2)
    assert_same(out, deepspeed_unshard(gathered, [4097, 3], [8193, 6], 2, torch.float32))


@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
def test_cuda_memcpy_route_is_taken_only_without_cast_or_scale(memcpy_route_forced, route):
    bucket_fill, gather_copy_out = _ops_by_route("cuda", route)
    sizes = [2**20 + 3, 8192, 7, 1]
    tensors = [torch.randn(n, device="cuda") for n in sizes]
    tensors.append(torch.randn(64, 48, device="cuda").t())  # strided: made contiguous first
    sizes.append(64 * 48)
    offsets, numel = layout(sizes, seed=5)
    observed = []
    for dtype, scale, memcpy_due in [(torch.float32, 1.0, True), (torch.float32, 0.5, False),
                                     (torch.bfloat16, 1.0, False)]:
        sources = [t.to(dtype) for t in tensors]
        buffer = torch.zeros(numel, device="cuda")
        observed.append((_cuda_activity(lambda: bucket_fill(buffer, sources, offsets, scale)), memcpy_due))
        assert_same(buffer, expected_bucket(sources, offsets, numel, torch.float32, scale))
    numels, shards = [3 * 8192 + 5, 1, 1001], [12295, 1, 501]
    for src, dst, memcpy_due in [(torch.float32, torch.float32, True), (torch.float16, torch.float32, False)]:
        gathered = torch.randn(2 * sum(shards), device="cuda").to(src)
        out = torch.full((sum(numels),), 3.0, device="cuda", dtype=dst)
        observed.append((_cuda_activity(lambda: gather_copy_out(gathered, out, shards, numels, 2)), memcpy_due))
        assert_same(out, deepspeed_unshard(gathered, shards, numels, 2, dst))
    # More segments than the route takes: the kernel, with the route still forced.
    too_many = ops.cuda_memcpy_max_segments() + 1
    many = [torch.randn(5, device="cuda") for _ in range(too_many)]
    offsets, numel = layout([5] * too_many, seed=6)
    buffer = torch.zeros(numel, device="cuda")
    observed.append((_cuda_activity(lambda: bucket_fill(buffer, many, offsets, 1.0)), False))
    assert_same(buffer, expected_bucket(many, offsets, numel, torch.float32, 1.0))
    _assert_routes(observed)


@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
def test_cuda_memcpy_route_is_off_by_default_and_by_size():
    _native_ops("cuda")
    tensors = [torch.randn(2**16, device="cuda") for _ in range(2)]
    buffer = torch.zeros(2**17, device="cuda")
    def fill():
        ops.bucket_fill(buffer, tensors, [0, 2**16])
    observed = [(_cuda_activity(fill), False)]
    with ops.cuda_memcpy_route(2**16 * 4):  # exactly each segment's bytes
        observed.append((_cuda_activity(fill), True))
    with ops.cuda_memcpy_route(2**16 * 4 + 1):
        observed.append((_cuda_activity(fill), False))
    assert_same(buffer, torch.cat(tensors))
    _assert_routes(observed)


# tests/kernel_paths.py is what compute-sanitizer runs on a GPU (scripts/gpu_check.sh); it
# must hold here too, and it must notice a wrong result, or a clean sanitizer run says little.
@pytest.mark.parametrize("device", DEVICES)
def test_every_kernel_path_matches_torch(device):
    _native_ops(device)
    results = kernel_paths.check_all(device)
    assert len(results) == 37
    assert [name for name, same in results if not same] == []


def test_kernel_paths_report_a_wrong_result(monkeypatch):
    _native_ops("cpu")
    fill = ops.bucket_fill
    monkeypatch.setattr(ops, "bucket_fill", lambda buffer, tensors, offsets, scale=1.0:
                        fill(buffer, tensors[:-1], offsets[:-1], scale))  # drops the last source
    gather = ops.gather_copy_out
    monkeypatch.setattr(ops, "gather_copy_out", lambda gathered, out, shard_numels, numels, world_size:
                        gather(gathered, out, shard_numels, numels, world_size) or out[:1].fill_(0))
    failed = [name for name, same in kernel_paths.check_all("cpu") if not same]
    # Every gather, and every fill whose last source is not empty: all but the 18 aligned
    # and the 2 unaligned-source fills, whose last source is.
    assert "fill inline grid-stride" in failed and "gather table world 2" in failed
    assert "fill memcpy route, unaligned" in failed and "gather memcpy route world 2 bfloat16" in failed
    assert not any(name.startswith(("fill inline aligned", "fill inline unaligned sources")) for name in failed)
    assert len(failed) == 37 - 20


GATHER_ERRORS = [
    ("gathered must be a 1-D contiguous", lambda: (torch.zeros(2, 4), torch.zeros(8), [4], [8], 2)),
    ("out must be a 1-D contiguous", lambda: (torch.zeros(8), torch.zeros(16)[::2], [4], [8], 2)),
    ("unsupported dtype", lambda: (torch.zeros(8, dtype=torch.float64), torch.zeros(8), [4], [8], 2)),
    ("out is on meta but gathered is on cpu",
     lambda: (torch.zeros(8), torch.zeros(8, device="meta"), [4], [8], 2)),
    ("world_size must be >= 1", lambda: (torch.zeros(0), torch.zeros(0), [], [], 0)),
    ("got 2 shard_numels but 1 numels", lambda: (torch.zeros(8), torch.zeros(8), [2, 2], [8], 2)),
    (r"numels\[0\] \(9\) exceeds world_size \* shard_numels\[0\] \(2 \* 4\)",
     lambda: (torch.zeros(8), torch.zeros(9), [4], [9], 2)),
    ("must be >= 0", lambda: (torch.zeros(8), torch.zeros(8), [-4], [8], 2)),
    ("gathered has 7 elements, expected world_size", lambda: (torch.zeros(7), torch.zeros(8), [4], [8], 2)),
    (r"out has 7 elements, expected sum\(numels\) = 8",
     lambda: (torch.zeros(8), torch.zeros(7), [4], [8], 2)),
]


@pytest.mark.parametrize("match,make", GATHER_ERRORS, ids=[m for m, _ in GATHER_ERRORS])
def test_gather_copy_out_errors(impl, match, make):
    _, gather_copy_out = impl
    with pytest.raises(RuntimeError, match=match):
        gather_copy_out(*make())


def test_gather_copy_out_rejects_out_overlapping_gathered(impl):
    _, gather_copy_out = impl
    storage = torch.zeros(16)
    with pytest.raises(RuntimeError, match="out overlaps gathered"):
        gather_copy_out(storage[:8], storage[4:12], [4], [8], 2)


# ------------------------------------------------------------------ opcheck
def _opcheck_cases(device):
    buffer = torch.zeros(64, device=device)
    tensors = [torch.randn(3, 4, device=device), torch.randn(5, device=device).bfloat16(),
               torch.randn(6, 4, device=device).t()]
    gathered = torch.randn(2 * 9, device=device).half()
    return [
        (torch.ops.zero_lifetime.bucket_fill.default, (buffer, tensors, [0, 20, 30], 0.5)),
        (torch.ops.zero_lifetime.gather_copy_out.default,
         (gathered, torch.empty(14, device=device), [4, 5], [6, 8], 2)),
    ]


@pytest.mark.parametrize("device", ["cpu", "meta", *DEVICES[1:]])
def test_opcheck(device):
    _native_ops(device)
    for op, args in _opcheck_cases(device):
        opcheck(op, args)


# ------------------------------------------------------------------ fallback
def _fill_and_gather_mixed_dtypes(ops):
    """One bucket_fill and one gather_copy_out over mixed dtypes, through the public API;
    also run verbatim in the subprocess below (inspect.getsource)."""
    torch.manual_seed(5)
    tensors = [torch.randn(n).to(d) for n, d in
               [(1000, torch.float32), (33, torch.bfloat16), (2**16 + 1, torch.float16)]]
    buffer = torch.zeros(2**16 + 2000, dtype=torch.bfloat16)
    ops.bucket_fill(buffer, tensors, [2**16 + 900, 0, 40], 0.25)
    gathered = torch.randn(3 * 700)
    out = torch.empty(1500, dtype=torch.float16)
    ops.gather_copy_out(gathered, out, [300, 400], [800, 700], 3)
    return buffer, out


def test_forced_python_fallback_gives_identical_results(tmp_path):
    """ZERO_LIFETIME_FORCE_PYTHON=1 in a fresh process: the public API takes the reference
    (chosen on purpose: no fallback warning) and writes exactly what the compiled ops write here."""
    _native_ops("cpu")
    code = textwrap.dedent(inspect.getsource(_fill_and_gather_mixed_dtypes)) + textwrap.dedent("""
        import sys, warnings, torch
        from zero_lifetime import ops
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            buffer, out = _fill_and_gather_mixed_dtypes(ops)
        assert not ops.native_available()
        assert not [w for w in caught if "zero_lifetime" in str(w.message)], caught
        torch.save({"buffer": buffer, "out": out}, sys.argv[1])
    """)
    env = dict(os.environ, ZERO_LIFETIME_FORCE_PYTHON="1",
               PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path = tmp_path / "result.pt"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    python_result = torch.load(path)

    buffer, out = _fill_and_gather_mixed_dtypes(ops)
    assert_same(buffer, python_result["buffer"])
    assert_same(out, python_result["out"])


@pytest.mark.parametrize("setting, is_default, refusal", [
    ("streaming_store_threshold", lambda value: value > 0,  # from this machine's cache
     "streaming store threshold must be >= 0 bytes, got -1"),
    ("cuda_memcpy_segment_bytes", lambda value: value == ops.CUDA_MEMCPY_NEVER,  # until a GPU run measures it
     "CUDA memcpy segment bytes must be >= 0, got -1"),
])
def test_copy_settings_are_settable_and_checked(setting, is_default, refusal):
    _native_ops("cpu")
    get, set_ = getattr(ops, setting), getattr(ops, f"set_{setting}")
    default = get()
    assert is_default(default)
    previous = set_(123)
    try:
        assert previous == default and get() == 123
        with pytest.raises(RuntimeError, match=refusal):
            set_(-1)
        assert get() == 123
    finally:
        set_(default)


@pytest.mark.parametrize("setting, block", [("streaming_store_threshold", "streaming_stores"),
                                            ("cuda_memcpy_segment_bytes", "cuda_memcpy_route")])
def test_copy_setting_blocks_give_the_previous_value_back(setting, block):
    _native_ops("cpu")
    get = getattr(ops, setting)
    before = get()
    with getattr(ops, block)(123):
        assert get() == 123
    assert get() == before
    with pytest.raises(KeyError):
        with getattr(ops, block)(456):
            assert get() == 456
            raise KeyError("the block failed")
    assert get() == before


def _sysfs_cache(root, index, level, kind, size):
    entry = root / "cache" / f"index{index}"
    entry.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size)):
        (entry / name).write_text(f"{value}\n")


def test_last_level_cache_bytes_reads_a_sysfs_tree(tmp_path):
    _native_ops("cpu")
    read = ops._compiled_module("last_level_cache_bytes").last_level_cache_bytes
    epyc = tmp_path / "epyc"
    for index, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"),
                                                 (2, "Unified", "512K"), (3, "Unified", "32768K")]):
        _sysfs_cache(epyc, index, level, kind, size)
    assert read(str(epyc)) == 32 << 20
    # An instruction cache above the data caches holds no copy; sizes may be in M or bytes.
    odd = tmp_path / "odd"
    _sysfs_cache(odd, 0, 2, "Data", "1048576")
    _sysfs_cache(odd, 1, 3, "Data", "8M")
    _sysfs_cache(odd, 2, 4, "Instruction", "64M")
    assert read(str(odd)) == 8 << 20
    # Unreadable sizes are skipped, not taken as 0 or as bytes.
    broken = tmp_path / "broken"
    _sysfs_cache(broken, 0, 2, "Unified", "2M")
    _sysfs_cache(broken, 1, 3, "Unified", "lots")
    assert read(str(broken)) == 2 << 20
    assert read(str(tmp_path / "missing")) == 0


def test_streaming_store_threshold_defaults_to_the_last_level_cache(tmp_path):
    _native_ops("cpu")
    default_for = ops._compiled_module("default_streaming_store_threshold").default_streaming_store_threshold
    big, socket, small = tmp_path / "big", tmp_path / "socket", tmp_path / "small"
    _sysfs_cache(big, 0, 2, "Unified", "2M")
    _sysfs_cache(big, 1, 3, "Unified", "65536K")
    # What an Intel Xeon VM lists: the whole socket's L3, of which its cores get a slice.
    _sysfs_cache(socket, 0, 2, "Unified", "2048K")
    _sysfs_cache(socket, 1, 3, "Unified", "491520K")
    _sysfs_cache(small, 0, 3, "Unified", "512K")  # under 1 MiB: not believed
    assert default_for(str(big)) == 64 << 20
    assert default_for(str(socket)) == 96 << 20
    assert default_for(str(small)) == 32 << 20
    assert default_for(str(tmp_path / "missing")) == 32 << 20
    # A fresh process starts with what this machine's sysfs gives.
    code = "from zero_lifetime import ops; print(ops.streaming_store_threshold())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) == default_for("/sys/devices/system/cpu/cpu0")


@pytest.mark.parametrize("setting", ["streaming_store_threshold", "cuda_memcpy_segment_bytes",
                                     "cuda_memcpy_max_segments"])
def test_copy_settings_need_the_compiled_ops(monkeypatch, setting):
    monkeypatch.setenv("ZERO_LIFETIME_FORCE_PYTHON", "1")
    with pytest.raises(RuntimeError, match=f"ops.{setting}: the compiled ops are not loaded"):
        getattr(ops, setting)()


@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.bfloat16), (torch.float16, torch.float16)])
def test_destinations_past_the_streaming_threshold(src_dtype, dst_dtype):
    """The default CPU path of big buckets and gathers (non-temporal stores): the reference's
    bits, with sources and shards of odd lengths, so every store alignment and tail occurs."""
    _native_ops("cpu")
    # The default threshold is the machine's last-level cache (up to hundreds of MB): a
    # fixed one keeps the test small; the streaming path is the same code.
    threshold = 4 << 20
    with ops.streaming_stores(threshold):
        _check_streaming_stores(src_dtype, dst_dtype, threshold)


def _check_streaming_stores(src_dtype, dst_dtype, threshold):
    itemsize = torch.empty(0, dtype=dst_dtype).element_size()
    rng = random.Random(7)
    sizes, total = [], 0
    while total * itemsize < threshold + 4096:
        sizes.append(rng.choice((1, 3, 8, 13, 100, 1023, 4097, 65537)))
        total += sizes[-1]
    tensors = [torch.randn(n).to(src_dtype) for n in sizes]
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n + 1)  # one-element gaps: destinations start anywhere
    buffer = torch.randn(offsets[-1] + sizes[-1] + 3).to(dst_dtype)
    want = buffer.clone()
    ops.bucket_fill(buffer, tensors, offsets, 0.5)
    ops_reference.bucket_fill(want, tensors, offsets, 0.5)
    assert_same(buffer, want)

    world = 3
    shards = [-(-n // world) for n in sizes]
    gathered = torch.randn(world * sum(shards)).to(src_dtype)
    out, out_want = torch.empty(total, dtype=dst_dtype), torch.empty(total, dtype=dst_dtype)
    ops.gather_copy_out(gathered, out, shards, sizes, world)
    ops_reference.gather_copy_out(gathered, out_want, shards, sizes, world)
    assert_same(out, out_want)
