"""Pure-torch references of the fused copy ops (csrc/ops): the fallback when the compiled
extension is unavailable, and the oracle of tests/test_ops.py.

Same semantics and the same argument checks (and error texts) as the compiled ops, so the
two are interchangeable; correctness, not speed, is the point here.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

# What the fused copies take (the compiled kernels and this reference alike).
SUPPORTED_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


def _fail(message: str) -> None:
    # RuntimeError: what the compiled ops' TORCH_CHECK raises.
    raise RuntimeError(message)


def _check_flat(op: str, name: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        _fail(f"{op}: {name} must be a dense (strided) tensor, got layout {_layout_name(t)}")
    if t.dim() != 1 or not t.is_contiguous():
        _fail(f"{op}: {name} must be a 1-D contiguous tensor, got sizes {list(t.shape)} "
              f"strides {list(t.stride())}")


def _layout_name(t: torch.Tensor) -> str:
    """The layout as c10 prints it in the compiled ops' messages (torch.sparse_coo -> Sparse)."""
    return {torch.sparse_coo: "Sparse", torch.sparse_csr: "SparseCsr", torch.sparse_csc: "SparseCsc",
            torch.sparse_bsr: "SparseBsr", torch.sparse_bsc: "SparseBsc", torch._mkldnn: "Mkldnn",
            torch.jagged: "Jagged"}.get(t.layout, str(t.layout))


def _check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        _fail(f"{op}: unsupported dtype {t.dtype} for {name}; expected float32, bfloat16 or float16")


def _byte_span(t: torch.Tensor):
    """[first, last) bytes a (possibly strided) tensor can touch; None when empty."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def check_bucket_fill(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                      offsets: Sequence[int]) -> None:
    op = "bucket_fill"
    _check_flat(op, "buffer", buffer)
    _check_dtype(op, "buffer", buffer)
    if len(tensors) != len(offsets):
        _fail(f"{op}: got {len(tensors)} tensors but {len(offsets)} offsets")
    numel = buffer.numel()
    ranges = []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.device != buffer.device:
            _fail(f"{op}: tensors[{i}] is on {t.device} but buffer is on {buffer.device}")
        _check_dtype(op, f"tensors[{i}]", t)
        if t.layout != torch.strided:
            _fail(f"{op}: tensors[{i}] has layout {_layout_name(t)}; expected a dense (strided) tensor")
        if off < 0:
            _fail(f"{op}: offsets[{i}] is negative ({off})")
        n = t.numel()
        if off > numel - n:
            _fail(f"{op}: tensors[{i}] ({n} elements at offset {off}) is out of bounds of the "
                  f"buffer ({numel} elements)")
        if n:
            ranges.append((off, off + n, i))
    ranges.sort()
    for (a0, a1, i), (b0, b1, j) in zip(ranges, ranges[1:]):
        if b0 < a1:
            _fail(f"{op}: destination ranges overlap: tensors[{i}] [{a0}, {a1}) and "
                  f"tensors[{j}] [{b0}, {b1})")
    if buffer.device.type == "meta":
        return  # no memory to alias
    base, isz = buffer.data_ptr(), buffer.element_size()
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        span = _byte_span(t)
        if span is None or span[1] <= base or span[0] >= base + numel * isz:
            continue
        own = (t.dtype == buffer.dtype and t.is_contiguous() and span[0] == base + off * isz)
        if own:
            continue  # exactly its own destination slice: in-place scale or nothing
        for lo, hi, j in ranges:
            if span[0] < base + hi * isz and base + lo * isz < span[1]:
                _fail(f"{op}: tensors[{i}] overlaps the destination range of tensors[{j}] "
                      f"in the buffer; it may only alias exactly its own destination slice")


def bucket_fill(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                offsets: Sequence[int], scale: float = 1.0) -> None:
    """buffer[offsets[i] : offsets[i] + tensors[i].numel()] = (tensors[i].flatten() * scale)
    cast to buffer.dtype, for every i. The product is computed in float32 (as the kernels do)."""
    check_bucket_fill(buffer, tensors, offsets)
    if buffer.device.type == "meta":
        return
    scale = float(scale)
    for t, off in zip(tensors, offsets):
        n = t.numel()
        if n == 0:
            continue
        dst = buffer.narrow(0, off, n)
        src = t.reshape(-1)
        if scale == 1.0:
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        elif src.data_ptr() == dst.data_ptr():
            dst.mul_(scale)  # its own slice: dtype equal, float32 math below would match
        else:
            dst.copy_(src.float() * scale)


def check_gather_copy_out(gathered: torch.Tensor, out: torch.Tensor,
                          shard_numels: Sequence[int], numels: Sequence[int],
                          world_size: int) -> None:
    op = "gather_copy_out"
    _check_flat(op, "gathered", gathered)
    _check_flat(op, "out", out)
    _check_dtype(op, "gathered", gathered)
    _check_dtype(op, "out", out)
    if out.device != gathered.device:
        _fail(f"{op}: out is on {out.device} but gathered is on {gathered.device}")
    if world_size < 1:
        _fail(f"{op}: world_size must be >= 1, got {world_size}")
    if len(shard_numels) != len(numels):
        _fail(f"{op}: got {len(shard_numels)} shard_numels but {len(numels)} numels")
    for i, (shard, n) in enumerate(zip(shard_numels, numels)):
        if shard < 0 or n < 0:
            _fail(f"{op}: shard_numels[{i}] ({shard}) and numels[{i}] ({n}) must be >= 0")
        if n > world_size * shard:
            _fail(f"{op}: numels[{i}] ({n}) exceeds world_size * shard_numels[{i}] "
                  f"({world_size} * {shard})")
    expected = world_size * sum(shard_numels)
    if gathered.numel() != expected:
        _fail(f"{op}: gathered has {gathered.numel()} elements, expected world_size * "
              f"sum(shard_numels) = {expected}")
    if out.numel() != sum(numels):
        _fail(f"{op}: out has {out.numel()} elements, expected sum(numels) = {sum(numels)}")
    if gathered.device.type != "meta":
        a, b = _byte_span(gathered), _byte_span(out)
        if a and b and a[0] < b[1] and b[0] < a[1]:
            _fail(f"{op}: out overlaps gathered in memory")


def gather_copy_out(gathered: torch.Tensor, out: torch.Tensor, shard_numels: Sequence[int],
                    numels: Sequence[int], world_size: int) -> None:
    """Unshard a rank-major all-gathered flat buffer into ``out``, parameters back to back:
    parameter i is concat over ranks r of gathered[r*S + o_i : r*S + o_i + shard_numels[i]],
    truncated to numels[i] (S = sum(shard_numels), o_i = sum(shard_numels[:i]))."""
    check_gather_copy_out(gathered, out, shard_numels, numels, world_size)
    if gathered.device.type == "meta":
        return
    segment = sum(shard_numels)
    src_offset = dst_offset = 0
    for shard, n in zip(shard_numels, numels):
        for rank in range(world_size):
            take = min(shard, n - rank * shard)
            if take <= 0:
                break
            out.narrow(0, dst_offset + rank * shard, take).copy_(
                gathered.narrow(0, rank * segment + src_offset, take))
        src_offset += shard
        dst_offset += n


def check_repoint_to_slices(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                            shapes: Optional[Sequence[Sequence[int]]] = None) -> List[int]:
    """The checks of repoint_to_slices; returns each tensor's element count in its new shape."""
    op = "repoint_to_slices"
    _check_flat(op, "buffer", buffer)
    if len(tensors) != len(offsets):
        _fail(f"{op}: got {len(tensors)} tensors but {len(offsets)} offsets")
    if shapes is not None and len(tensors) != len(shapes):
        _fail(f"{op}: got {len(tensors)} tensors but {len(shapes)} shapes")
    numel, numels = buffer.numel(), []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if t.device != buffer.device:
            _fail(f"{op}: tensors[{i}] is on {t.device} but buffer is on {buffer.device}")
        if t.layout != torch.strided:
            _fail(f"{op}: tensors[{i}] has layout {_layout_name(t)}; expected a dense (strided) tensor")
        n = t.numel()
        if shapes is not None:
            shape = [int(size) for size in shapes[i]]
            if any(size < 0 for size in shape):
                _fail(f"{op}: shapes[{i}] {shape} has a negative size")
            n = math.prod(shape)
            if n > numel:
                _fail(f"{op}: tensors[{i}] (shape {shape}) is out of bounds of the buffer ({numel} elements)")
        if off < 0:
            _fail(f"{op}: offsets[{i}] is negative ({off})")
        if off > numel - n:
            _fail(f"{op}: tensors[{i}] ({n} elements at offset {off}) is out of bounds of the "
                  f"buffer ({numel} elements)")
        numels.append(n)
    return numels


def repoint_to_slices(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                      shapes: Optional[Sequence[Sequence[int]]] = None) -> None:
    """tensors[i].data = buffer[offsets[i] : offsets[i] + numel] viewed in shapes[i] (default:
    tensors[i]'s own shape), for every i; every argument checked before any tensor changes."""
    numels = check_repoint_to_slices(buffer, tensors, offsets, shapes)
    for i, (t, off, n) in enumerate(zip(tensors, offsets, numels)):
        t.data = buffer.narrow(0, off, n).view(t.shape if shapes is None else tuple(shapes[i]))
