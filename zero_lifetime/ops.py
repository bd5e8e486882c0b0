"""Fused copies for ZeRO's hot paths, one call for a whole list of tensors:

* :func:`bucket_fill` - gradients (any mix of fp32/bf16/fp16, scaled, cast) into a flat
  reduction bucket, instead of one ``narrow().copy_()`` per parameter;
* :func:`gather_copy_out` - an all-gathered rank-major flat buffer back into whole
  parameters, instead of one ``torch.cat`` per parameter;
* :func:`repoint_to_slices` - each gradient's ``.data`` made a view of its bucket slice,
  instead of a Python loop of views and ``.data`` assignments.

The two copies are ``torch.ops.zero_lifetime`` operators from the compiled extension (CPU,
CUDA when built with CUDA, Meta). Without it (no compiler, or ``ZERO_LIFETIME_FORCE_PYTHON=1``),
or on a device it has no kernel for, the pure-torch :mod:`zero_lifetime.ops_reference`
runs instead, after one warning. ``repoint_to_slices`` moves no bytes and is no operator:
the compiled module's direct entry, else the same pure-torch loop.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, ContextManager, Dict, Iterator, Optional, Sequence, Tuple

import torch

from . import _native, ops_reference

_OP_NAMES = ("bucket_fill", "gather_copy_out")
# device type -> (bucket_fill, gather_copy_out); filled on first use per device type, so
# the hot path is a dict lookup and a direct call of the op handle.
_impls: Dict[str, Tuple[Callable, Callable]] = {}
_REFERENCE = (ops_reference.bucket_fill, ops_reference.gather_copy_out)
_warned = False
# device type -> the compiled module's direct entries (bucket_fill_fast,
# gather_copy_out_fast) for device types whose ops resolved to the compiled kernels: no
# boxed dispatcher call per tensor, see csrc/ops/fast_path.cpp. They return False (nothing
# done) when the dispatcher is needed, and the op runs instead.
_fast: Dict[str, Tuple[Callable, Callable]] = {}
_FAST_DEVICE_TYPES = ("cpu", "cuda")

# set_cuda_memcpy_segment_bytes(CUDA_MEMCPY_NEVER): no segment is this large, so the fused
# kernel always runs. It is the compiled default (INT64_MAX in csrc/ops/copy_plan.cpp) until a
# GPU run measures where the route wins.
CUDA_MEMCPY_NEVER = 2**63 - 1


def native_available() -> bool:
    """Whether the compiled ops are loaded (never true under ZERO_LIFETIME_FORCE_PYTHON=1)."""
    return not _native.force_python() and _native.load() is not None


def _warn_fallback(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"zero_lifetime: fused copy ops unavailable, using the slower pure-torch "
                      f"reference. Reason: {reason}", RuntimeWarning, stacklevel=4)


def _has_kernel(name: str, dispatch_key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"zero_lifetime::{name}",
                                                              dispatch_key)
    except RuntimeError:  # operator not registered at all: a build without csrc/ops
        return False


def _resolve(device_type: str) -> Tuple[Callable, Callable]:
    if _native.force_python():
        return _REFERENCE  # not cached: the variable is read at every resolution
    if _native.load() is None:
        _warn_fallback(str(_native.status()["error"]))
        impls = _REFERENCE
    else:
        key = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}.get(device_type, device_type)
        missing = [name for name in _OP_NAMES if not _has_kernel(name, key)]
        if missing:
            _warn_fallback(f"the compiled extension has no {key} kernel for {missing}")
            impls = _REFERENCE
        else:
            impls = tuple(getattr(torch.ops.zero_lifetime, name).default for name in _OP_NAMES)
            module = _native.load()
            if device_type in _FAST_DEVICE_TYPES and hasattr(module, "bucket_fill_fast"):
                _fast[device_type] = (module.bucket_fill_fast, module.gather_copy_out_fast)
    _impls[device_type] = impls
    return impls


def _as_sequence(items):
    """items itself when it can be read twice (fast path, then fallback), else a list."""
    return items if isinstance(items, (list, tuple)) else list(items)


def bucket_fill(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                offsets: Sequence[int], scale: float = 1.0) -> None:
    """buffer[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i].flatten() * scale,
    cast to buffer.dtype, for every i, in one fused call.

    ``buffer``: 1-D contiguous fp32/bf16/fp16. ``tensors``: fp32/bf16/fp16 (mixed allowed,
    any layout) on the buffer's device; destination ranges must not overlap, and a tensor
    may alias the buffer only as exactly its own destination slice (then it is scaled in
    place). Offsets are element offsets (64-bit)."""
    device_type = buffer.device.type
    impls = _impls.get(device_type) or _resolve(device_type)
    # Lists and tuples as they are: copying two 8K-element lists costs ~45 us (~1% of a fill of 8K grads).
    tensors, offsets, scale = _as_sequence(tensors), _as_sequence(offsets), float(scale)
    fast = _fast.get(device_type) if impls is not _REFERENCE else None
    if fast is not None and not torch.compiler.is_compiling() and fast[0](buffer, tensors, offsets, scale):
        return
    impls[0](buffer, tensors, offsets, scale)


def gather_copy_out(gathered: torch.Tensor, out: torch.Tensor, shard_numels: Sequence[int],
                    numels: Sequence[int], world_size: int) -> None:
    """Unshard a rank-major all-gathered flat buffer (``world_size`` segments of
    ``sum(shard_numels)`` elements) into ``out``, whole parameters back to back: parameter i
    is the concatenation over ranks of its shards, truncated to ``numels[i]`` (the padding
    dropped), cast to ``out.dtype``. What DeepSpeed's ``AllGatherCoalescedHandle.wait`` does
    with one ``torch.cat`` per parameter."""
    device_type = gathered.device.type
    impls = _impls.get(device_type) or _resolve(device_type)
    shard_numels, numels, world_size = list(shard_numels), list(numels), int(world_size)
    fast = _fast.get(device_type) if impls is not _REFERENCE else None
    if (fast is not None and not torch.compiler.is_compiling()
            and fast[1](gathered, out, shard_numels, numels, world_size)):
        return
    impls[1](gathered, out, shard_numels, numels, world_size)


def repoint_to_slices(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                      shapes: Optional[Sequence[Sequence[int]]] = None) -> None:
    """tensors[i].data = buffer[offsets[i] : offsets[i] + numel] viewed in shapes[i] (default:
    tensors[i]'s own shape), for every i: what DeepSpeed does to each gradient once it is copied
    into its bucket, and to each param of a gather. Every argument is checked before any tensor
    changes. The compiled entry makes the views without a Python loop, for torch.Tensor and
    nn.Parameter; subclasses, active modes and compiling take the pure-torch loop."""
    tensors, offsets = _as_sequence(tensors), _as_sequence(offsets)
    shapes = None if shapes is None else _as_sequence(shapes)
    fast = _repoint_entry()
    if fast is not None and not torch.compiler.is_compiling() and fast(buffer, tensors, offsets, shapes):
        return
    ops_reference.repoint_to_slices(buffer, tensors, offsets, shapes)


_repoint_fast = None


def _repoint_entry():
    """The compiled repoint entry, looked up once; None without the compiled module."""
    global _repoint_fast
    if _repoint_fast is None:
        module = _compiled_module_or_none("repoint_to_slices_fast")
        if module is None:
            return None  # not cached: ZERO_LIFETIME_FORCE_PYTHON is read at every lookup
        _repoint_fast = module.repoint_to_slices_fast
    return _repoint_fast


def gather_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized 1-D buffer for one fused gather's params.

    On the CPU, with the compiled ops, it comes from a cache of released gather buffers
    (:func:`cpu_buffer_cache_info`): a fresh allocation of tens of MB faults in all its pages
    on every gather. Elsewhere (a GPU has its caching allocator) ``torch.empty``."""
    module = _compiled_module_or_none("cpu_gather_buffer") if device.type == "cpu" else None
    if module is not None:
        return module.cpu_gather_buffer(int(numel), dtype)
    return torch.empty(int(numel), dtype=dtype, device=device)


def cpu_buffer_cache_info() -> Dict[str, int]:
    """The CPU gather-buffer cache: ``cached_bytes`` and ``cached_blocks`` held now (released
    buffers, not in use), ``limit_bytes``, and ``hits``/``misses`` of requests so far."""
    return dict(_compiled_module("cpu_buffer_cache_info").cpu_buffer_cache_info())


def set_cpu_buffer_cache_limit(nbytes: int) -> int:
    """Bytes of released gather buffers the CPU cache may hold in this process (0: none, and
    what it holds is freed now); returns the previous limit. The default is 256 MiB."""
    return _compiled_module("set_cpu_buffer_cache_limit").set_cpu_buffer_cache_limit(int(nbytes))


def empty_cpu_buffer_cache() -> None:
    """Free every block the CPU gather-buffer cache holds (buffers in use are not touched)."""
    _compiled_module("empty_cpu_buffer_cache").empty_cpu_buffer_cache()


def streaming_store_threshold() -> int:
    """Destination bytes from which the compiled CPU ops write with non-temporal stores.

    Those skip reading each destination cache line before overwriting it: faster for copies
    larger than the CPU's cache, slower for ones the next op would read from the cache. The
    default is the size of the CPU's last-level cache (Linux sysfs, cpu0) up to 96 MiB (a VM
    may list its whole socket's cache), 32 MiB where it cannot be read."""
    return _compiled_module("streaming_store_threshold").streaming_store_threshold()


def set_streaming_store_threshold(nbytes: int) -> int:
    """Set :func:`streaming_store_threshold` (0: always, a huge value: never) for this process;
    returns the previous value. :func:`streaming_stores` sets it for a block."""
    return _compiled_module("set_streaming_store_threshold").set_streaming_store_threshold(int(nbytes))


def streaming_stores(threshold_bytes: int = 0) -> ContextManager[None]:
    """:func:`set_streaming_store_threshold` inside the block, the previous value after it
    (0: every CPU fused copy writes with non-temporal stores)."""
    return _setting_for_block(set_streaming_store_threshold, threshold_bytes)


def cuda_memcpy_segment_bytes() -> int:
    """Segment bytes from which a CUDA fused copy with no cast and no scale runs as one
    ``cudaMemcpyAsync`` per segment (at most :func:`cuda_memcpy_max_segments` segments, each
    at least this large) instead of the fused kernel: the call torch's own contiguous
    ``copy_`` makes. The default is a huge value (never) until a GPU run shows where it beats
    the kernel (the "memcpy" way of ``benchmarks/profile_ops.py``). CPU copies do not read it."""
    return _compiled_module("cuda_memcpy_segment_bytes").cuda_memcpy_segment_bytes()


def set_cuda_memcpy_segment_bytes(nbytes: int) -> int:
    """Set :func:`cuda_memcpy_segment_bytes` (0: whenever there is no cast or scale, a huge
    value: never, :data:`CUDA_MEMCPY_NEVER` the default) for this process; returns the
    previous value. :func:`cuda_memcpy_route` sets it for a block."""
    return _compiled_module("set_cuda_memcpy_segment_bytes").set_cuda_memcpy_segment_bytes(int(nbytes))


def cuda_memcpy_route(segment_bytes: int = 0) -> ContextManager[None]:
    """:func:`set_cuda_memcpy_segment_bytes` inside the block, the previous value after it
    (0: every CUDA copy with no cast and no scale takes the route)."""
    return _setting_for_block(set_cuda_memcpy_segment_bytes, segment_bytes)


@contextlib.contextmanager
def _setting_for_block(set_setting: Callable[[int], int], value: int) -> Iterator[None]:
    """A process-wide copy setting set for a block: the setter returns the value it replaced,
    which is put back however the block ends."""
    previous = set_setting(value)
    try:
        yield
    finally:
        set_setting(previous)


def cuda_memcpy_max_segments() -> int:
    """The most segments a CUDA fused copy may have to take the ``cudaMemcpyAsync`` route: a
    bound on its host cost, one call per segment where the kernel is one launch."""
    return _compiled_module("cuda_memcpy_max_segments").cuda_memcpy_max_segments()


def _compiled_module_or_none(what: str):
    """The compiled module when it is loaded (not forced off) and has ``what``, else None."""
    module = _native.load() if not _native.force_python() else None
    return module if module is not None and hasattr(module, what) else None


def _compiled_module(what: str):
    module = _compiled_module_or_none(what)
    if module is None:
        raise RuntimeError(f"zero_lifetime.ops.{what}: the compiled ops are not loaded "
                           f"({_native.status()['error'] or 'ZERO_LIFETIME_FORCE_PYTHON=1'})")
    return module
