"""zero_lifetime.ops.repoint_to_slices (each tensor's .data made a view of its bucket slice):
the compiled direct entry, the public API and the pure-torch reference, against the plain
torch assignment DeepSpeed makes per gradient, written out here."""

import pytest
import torch

from compiled import compiled_ops_or_skip
from test_ops import RecordingDispatchMode
from zero_lifetime import ops, ops_reference

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU"))]
SHAPES = [(5, ), (2, 3), (), (0, ), (4, 1, 2)]


class _Sub(torch.Tensor):
    """A subclass: may override .data, so the direct entry leaves it to the Python loop."""


def _direct_entry():
    return compiled_ops_or_skip().repoint_to_slices_fast


def _must_apply(entry):
    def call(buffer, tensors, offsets, shapes=None):
        assert entry(buffer, tensors, offsets, shapes) is True, "the direct entry declined plain tensors"
    return call


@pytest.fixture(params=["direct", "public", "reference"])
def repoint(request):
    if request.param == "direct":
        return _must_apply(_direct_entry())
    if request.param == "public":
        _direct_entry()
        return ops.repoint_to_slices
    return ops_reference.repoint_to_slices


def torch_repoint(buffer, tensors, offsets):
    """DeepSpeed's per-gradient re-pointing (stage 1/2 ipg bucket), one tensor at a time."""
    for t, off in zip(tensors, offsets):
        t.data = buffer.narrow(0, off, t.numel()).view_as(t)


def _layout(t):
    return (t.shape, t.stride(), t.dtype, t.device, t.storage_offset(), t.untyped_storage().data_ptr(),
            t._version, t.is_contiguous())


def _tensors(device, dtype=torch.float32):
    made = [torch.randn(shape, device=device).to(dtype) for shape in SHAPES]
    made.append(torch.randn(3, 4, device=device).to(dtype).t())  # non-contiguous: becomes a contiguous view
    return made


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_the_per_tensor_assignment(device, dtype, repoint, request):
    if device == "cuda" and request.node.callspec.params["repoint"] == "reference":
        pytest.skip("the reference is checked on the CPU")
    buffer = torch.zeros(64, device=device, dtype=dtype)
    offsets = [40, 0, 7, 7, 30, 10]  # any order; an empty tensor may sit anywhere in range
    ours, theirs = _tensors(device, dtype), None
    theirs = [t.clone() for t in ours]
    repoint(buffer, ours, offsets)
    torch_repoint(buffer, theirs, offsets)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert _layout(a) == _layout(b), i
    buffer.copy_(torch.arange(64, device=device).to(dtype))  # the tensors see the buffer's bytes
    for a, off in zip(ours, offsets):
        expected = torch.arange(off, off + a.numel(), device=device).to(dtype).view(a.shape)
        torch.testing.assert_close(a, expected, rtol=0, atol=0)


def test_the_old_storage_is_let_go(repoint):
    grad = torch.randn(1000)
    old = grad.untyped_storage()
    refs = old._weak_ref()
    del old
    buffer = torch.zeros(1000)
    repoint(buffer, [grad], [0])
    assert grad.untyped_storage().data_ptr() == buffer.data_ptr()
    assert torch.UntypedStorage._expired(refs)


def test_a_parameter_s_grad_accumulates_into_its_slice_afterwards(repoint):
    """Copied into its slice and re-pointed (as DeepSpeed does), the next backward adds into the slice."""
    weight = torch.nn.Parameter(torch.randn(3, 2))
    (weight * 2).sum().backward()
    buffer = torch.zeros(10)
    buffer.narrow(0, 4, 6).copy_(weight.grad.view(-1))
    repoint(buffer, [weight.grad], [4])
    (weight * 3).sum().backward()
    torch.testing.assert_close(buffer, torch.tensor([0, 0, 0, 0, 5, 5, 5, 5, 5, 5.0]), rtol=0, atol=0)


ERRORS = [
    ("out of bounds of the buffer \\(10 elements\\)", lambda b: ([torch.ones(2), torch.ones(4)], [0, 7])),
    ("offsets\\[1\\] is negative \\(-1\\)", lambda b: ([torch.ones(2), torch.ones(4)], [0, -1])),
    ("got 2 tensors but 1 offsets", lambda b: ([torch.ones(2), torch.ones(4)], [0])),
    ("tensors\\[1\\] is on meta but buffer is on cpu", lambda b: ([torch.ones(2), torch.ones(4, device="meta")], [0, 2])),
    ("tensors\\[1\\] has layout Sparse; expected a dense", lambda b: ([torch.ones(2), torch.ones(4).to_sparse()], [0, 2])),
]


@pytest.mark.parametrize("match, make", ERRORS, ids=[m.split(" ")[0] for m, _ in ERRORS])
def test_errors_change_nothing(repoint, match, make):
    buffer = torch.zeros(10)
    tensors, offsets = make(buffer)
    before = [t.data_ptr() if t.layout == torch.strided and t.device.type != "meta" else None for t in tensors]
    with pytest.raises(RuntimeError, match=match):
        repoint(buffer, tensors, offsets)
    after = [t.data_ptr() if t.layout == torch.strided and t.device.type != "meta" else None for t in tensors]
    assert after == before  # the first tensor was not re-pointed before the second failed


@pytest.mark.parametrize("buffer, match", [
    (torch.zeros(4, 4), "1-D contiguous"),
    (torch.zeros(8)[::2], "1-D contiguous"),
    (torch.zeros(8).to_sparse(), "dense \\(strided\\)"),
])
def test_the_buffer_must_be_flat(repoint, buffer, match):
    with pytest.raises(RuntimeError, match=match):
        repoint(buffer, [torch.ones(2)], [0])


def test_parameters_take_their_full_shape(repoint):
    """The fused ZeRO-3 gather: released params (numel 0) become views of their slice in ds_shape."""
    params = [torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))]
    theirs = [torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))]
    shapes, offsets = [torch.Size([2, 3]), (4, )], [0, 6]
    buffer = torch.arange(10.0)
    repoint(buffer, params, offsets, shapes)
    for p, shape, off in zip(theirs, shapes, offsets):  # the stock wait's assignment
        p.data = buffer.narrow(0, off, torch.Size(shape).numel()).view(shape)
    for a, b in zip(params, theirs):
        assert _layout(a) == _layout(b)
        assert a.requires_grad and isinstance(a, torch.nn.Parameter)
    torch.testing.assert_close(params[1].detach(), torch.tensor([6.0, 7, 8, 9]), rtol=0, atol=0)


SHAPE_ERRORS = [
    ("got 2 tensors but 1 shapes", [(2, ), (4, )][:1], [0, 2]),
    ("shapes\\[1\\] \\[2, -1\\] has a negative size", [(2, ), (2, -1)], [0, 2]),
    ("tensors\\[1\\] \\(8 elements at offset 4\\) is out of bounds", [(2, ), (2, 4)], [0, 4]),
    ("tensors\\[1\\] \\(shape \\[1099511627776, 1099511627776\\]\\) is out of bounds",
     [(2, ), (1 << 40, 1 << 40)], [0, 2]),
]


@pytest.mark.parametrize("match, shapes, offsets", SHAPE_ERRORS, ids=["count", "negative", "bounds", "overflow"])
def test_shape_errors_change_nothing(repoint, match, shapes, offsets):
    tensors = [torch.ones(2), torch.ones(4)]
    before = [t.data_ptr() for t in tensors]
    with pytest.raises(RuntimeError, match=match):
        repoint(torch.zeros(10), tensors, offsets, shapes)
    assert [t.data_ptr() for t in tensors] == before


def test_a_shape_with_a_zero_is_empty_whatever_its_other_sizes(repoint):
    t = torch.ones(3)
    repoint(torch.zeros(4), [t], [4], [(1 << 40, 0)])
    assert t.shape == (1 << 40, 0) and t.numel() == 0


def test_the_direct_entry_declines_what_needs_the_python_loop():
    entry = _direct_entry()
    buffer = torch.zeros(8)

    sub = torch.ones(2).as_subclass(_Sub)
    before = sub.data_ptr()
    assert entry(buffer, [sub], [0]) is False  # a subclass may override .data
    assert sub.data_ptr() == before
    assert entry(buffer.as_subclass(_Sub), [torch.ones(2)], [0]) is False

    with torch.inference_mode():
        assert entry(buffer, [torch.ones(2)], [0]) is False

    grad = torch.ones(2)
    with RecordingDispatchMode() as mode:
        assert entry(buffer, [grad], [0]) is False
        ops.repoint_to_slices(buffer, [grad], [2])  # then the Python loop, which the mode sees
    assert "aten.view.default" in mode.seen, mode.seen
    assert grad.data_ptr() == buffer.data_ptr() + 8


def test_the_direct_entry_takes_parameters_and_tensors_that_require_grad():
    entry = _direct_entry()
    buffer = torch.zeros(8)
    tensors = [torch.ones(2, requires_grad=True), torch.nn.Parameter(torch.ones(3))]
    assert entry(buffer, tensors, [0, 4]) is True
    assert [t.data_ptr() for t in tensors] == [buffer.data_ptr(), buffer.data_ptr() + 16]
    assert all(t.requires_grad and t.is_leaf for t in tensors)
    meta = [torch.ones(2, device="meta")]
    assert entry(torch.zeros(8, device="meta"), meta, [6]) is True
    assert meta[0].device.type == "meta" and meta[0].storage_offset() == 6


@pytest.mark.parametrize("make", [
    lambda: [torch.ones(2).as_subclass(_Sub), torch.ones(3)],  # declined: the Python loop runs
    lambda: [torch.ones(2), torch.ones(3)],
], ids=["declined-to-python", "direct"])
def test_public_api_reads_one_shot_iterables_once(make):
    buffer = torch.arange(8.0)
    tensors = make()
    ops.repoint_to_slices(buffer, iter(tensors), iter([5, 0]))
    assert [t.data_ptr() for t in tensors] == [buffer.data_ptr() + 20, buffer.data_ptr()]
    torch.testing.assert_close(tensors[0].detach(), torch.tensor([5.0, 6.0]), rtol=0, atol=0)


def _random_case(rng):
    """Tensors of random shapes, offsets mostly in range, sometimes a shape list, sometimes a bad one."""
    count = rng.randint(0, 6)
    shapes = [tuple(rng.choice([0, 1, 2, 3, 5]) for _ in range(rng.randint(0, 3))) for _ in range(count)]
    tensors = [torch.randn(shape) for shape in shapes]
    buffer_numel = rng.randint(0, 40)
    offsets = [rng.randint(-2, buffer_numel + 2) if rng.random() < 0.1 else rng.randint(0, buffer_numel)
               for _ in range(count)]
    new_shapes = None
    if rng.random() < 0.5:
        new_shapes = [tuple(rng.choice([0, 1, 2, 4]) for _ in range(rng.randint(0, 3))) for _ in range(count)]
        if count and rng.random() < 0.1:
            new_shapes[rng.randrange(count)] = (2, -1)
    return torch.arange(float(buffer_numel)), tensors, offsets, new_shapes


def test_random_cases_match_the_reference_results_and_errors():
    """The compiled entry and the Python loop: the same tensors afterwards, or the same error with nothing changed."""
    import random
    entry = _direct_entry()
    rng = random.Random(0)
    outcomes = {"applied": 0, "refused": 0}
    for case in range(300):
        buffer, tensors, offsets, shapes = _random_case(rng)
        twins = [t.clone() for t in tensors]
        before = [_layout(t) for t in tensors]
        try:
            ops_reference.repoint_to_slices(buffer, twins, offsets, shapes)
            expected = None
        except RuntimeError as error:
            expected = str(error)
        if expected is None:
            assert entry(buffer, tensors, offsets, shapes) is True, case
            assert [_layout(t) for t in tensors] == [_layout(t) for t in twins], case
            outcomes["applied"] += 1
        else:
            with pytest.raises(RuntimeError) as raised:
                entry(buffer, tensors, offsets, shapes)
            assert str(raised.value).split("\n")[0] == expected, case
            assert [_layout(t) for t in tensors] == before, case
            outcomes["refused"] += 1
    assert min(outcomes.values()) > 30, outcomes  # both sides of the checks were exercised


@pytest.fixture
def compiled_repoints(monkeypatch):
    """What the compiled entry answered on each ops.repoint_to_slices call (True: it re-pointed)."""
    entry = _direct_entry()
    answers = []

    def recording(*args):
        answers.append(entry(*args))
        return answers[-1]

    monkeypatch.setattr(ops, "_repoint_fast", recording)
    return answers


def test_a_zero2_bucket_flush_re_points_through_the_compiled_entry(compiled_repoints):
    """DeepSpeed's own ZeRO-2 bucket path (the bench's engine): the gradients are plain tensors."""
    from zero_lifetime.bench.ds_paths import _Zero2Bucket
    bucket = _Zero2Bucket(4, 8, install=True)
    try:
        bucket.reset()
        bucket.fill()
        assert compiled_repoints == [True]
        base = bucket.buffer().data_ptr()
        assert [p.grad.data_ptr() for _, p in bucket.group_params] == [base + 4 * 8 * k for k in range(4)]
    finally:
        bucket.close()


def test_a_fused_zero3_gather_hands_out_params_through_the_compiled_entry(compiled_repoints):
    """DeepSpeed's params are nn.Parameters: the compiled entry must take them, in ds_shape."""
    import zero_lifetime
    from zero_lifetime.bench.ds_paths import _GatheredParams, _zero3_fused
    engine, fused = _zero3_fused()
    try:
        params = _GatheredParams(3, 10, 2, torch.device("cpu"))
        params.reset()
        fused.wait(params.handle)
        assert compiled_repoints == [True]
        assert all(p.shape == (10, ) and p.ds_status == params.status.AVAILABLE for p in params.params)
        # rank-major shards of 5: param k is [rank 0's k-th shard, rank 1's k-th shard]
        for k, p in enumerate(params.params):
            want = torch.cat([params.gathered.narrow(0, r * 15 + 5 * k, 5) for r in range(2)])
            torch.testing.assert_close(p.detach(), want, rtol=0, atol=0)
    finally:
        zero_lifetime.uninstall(engine)
        engine.destroy()
