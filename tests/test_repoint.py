"""zero_lifetime.ops.repoint_to_slices (each tensor's .data made a view of its bucket slice):
the compiled direct entry, the public API and the pure-torch reference, against the plain
torch assignment DeepSpeed makes per gradient, written out here."""

import pytest
import torch

from zero_lifetime import _native, ops, ops_reference

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU"))]
SHAPES = [(5, ), (2, 3), (), (0, ), (4, 1, 2)]


def _direct_entry():
    module = _native.load() if ops.native_available() else None
    if module is None or not hasattr(module, "repoint_to_slices_fast"):
        pytest.skip("compiled extension unavailable")
    return module.repoint_to_slices_fast


def _must_apply(entry):
    def call(buffer, tensors, offsets):
        assert entry(buffer, tensors, offsets) is True, "the direct entry declined plain tensors"
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
def test_errors_change_nothing(repoint, match, make, request):
    if "meta" in match and request.node.callspec.params["repoint"] == "direct":
        pytest.skip("a meta tensor is declined by the direct entry (test_the_direct_entry_declines...)")
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


def test_the_direct_entry_declines_what_needs_the_dispatcher():
    entry = _direct_entry()
    buffer = torch.zeros(8)
    cases = [
        [torch.ones(2, requires_grad=True)],
        [torch.nn.Parameter(torch.ones(2))],
    ]
    for tensors in cases:
        before = tensors[0].data_ptr()
        assert entry(buffer, tensors, [0]) is False
        assert tensors[0].data_ptr() == before
    assert entry(torch.zeros(8, device="meta"), [torch.ones(2, device="meta")], [0]) is False
    assert entry(buffer, [torch.ones(2), torch.ones(2, device="meta")], [0, 2]) is False

    class Recording(torch.utils._python_dispatch.TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    grad = torch.ones(2)
    with Recording():
        assert entry(buffer, [grad], [0]) is False
        ops.repoint_to_slices(buffer, [grad], [2])  # then the Python loop, which the mode sees
    assert "aten.view.default" in Recording.seen, Recording.seen
    assert grad.data_ptr() == buffer.data_ptr() + 8


@pytest.mark.parametrize("make", [
    lambda: [torch.ones(2, requires_grad=True), torch.ones(3)],  # declined: the Python loop runs
    lambda: [torch.ones(2), torch.ones(3)],
], ids=["declined-to-python", "direct"])
def test_public_api_reads_one_shot_iterables_once(make):
    buffer = torch.arange(8.0)
    tensors = make()
    ops.repoint_to_slices(buffer, iter(tensors), iter([5, 0]))
    assert [t.data_ptr() for t in tensors] == [buffer.data_ptr() + 20, buffer.data_ptr()]
    torch.testing.assert_close(tensors[0].detach(), torch.tensor([5.0, 6.0]), rtol=0, atol=0)
