"""ZeRO-3 gradient buckets and coalesced all-gather handles: the private names the fused copies use.

Two DeepSpeed copy loops (0.19.8 and 0.17.6 alike) are replaced (see ``zero_lifetime/zero3_fused.py``):

* ``DeepSpeedZeroOptimizer_Stage3.__add_grad_to_ipg_bucket`` copies each gradient into
  the IPG bucket buffer; ``__reduce_and_partition_ipg_grads`` flushes a bucket. Both are
  name-mangled methods looked up on ``self``, so an instance attribute overrides them
  for one optimizer only.
* ``AllGatherCoalescedHandle.wait`` splits an all-gathered buffer with one ``torch.cat``
  per param. The coordinator obtains these handles from the per-param instance attribute
  ``param.all_gather_coalesced``; wrapping that attribute on one engine's params reaches
  exactly that engine's handles, so the class itself is never patched.

0.17.6 differs only in the bucket: no ZenFlow on stage 3 and no per-bucket
``process_group`` (``_get_param_partition_group``, 0.18+), so both are probed.
"""

import inspect
import itertools
from typing import NamedTuple

from .. import ops
from .errors import SUPPORTED_DEEPSPEED_VERSIONS, UnsupportedDeepSpeedError, require
from .patching import Patches

_STAGE3 = "_DeepSpeedZeroOptimizer_Stage3"
ADD_GRAD = f"{_STAGE3}__add_grad_to_ipg_bucket"
REDUCE_BUCKET = f"{_STAGE3}__reduce_and_partition_ipg_grads"
_BUCKET_FIELDS = ("buffer", "params", "elements", "process_group")
_HANDLE_FIELDS = ("allgather_handle", "params", "partitions", "world_size", "use_secondary_tensor", "quantization",
                  "complete")


class Zero3Buckets:
    """One ZeRO-3 optimizer's IPG buckets, and its two bucket methods overridden per instance."""

    def __init__(self, optimizer):
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3, IPGBucketZ3

        self.optimizer = optimizer
        if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
            raise TypeError(f"expected a ZeRO-3 optimizer, got {type(optimizer).__qualname__}")
        for name in (ADD_GRAD, REDUCE_BUCKET):
            require(DeepSpeedZeroOptimizer_Stage3, name, "a ZeRO-3 IPG bucket method")
        for name in ("ipg_buckets", "contiguous_gradients", "reduce_bucket_size", "reduce_and_partition_stream",
                     "get_param_comm_dtype"):
            require(optimizer, name, "a ZeRO-3 IPG bucket attribute")
        # Each bucket records its param's partition group from 0.18 on (0.17.6: one group).
        self._has_bucket_group = hasattr(optimizer, "_get_param_partition_group")
        fields = _BUCKET_FIELDS if self._has_bucket_group else _BUCKET_FIELDS[:-1]
        for name in fields:
            require(IPGBucketZ3(), name, "an IPG bucket field")
        self._overridden = []

    # ---- the per-instance override ------------------------------------------------------

    def stock(self, name):
        """The class's method bound to this optimizer (what runs without an override)."""
        return getattr(type(self.optimizer), name).__get__(self.optimizer)

    def override(self, name, function) -> None:
        # Replaces, not wraps (``stock`` is the class's method); restore goes back to it.
        self.optimizer.__dict__[name] = function
        self._overridden.append(name)

    def restore(self) -> None:
        for name in self._overridden:
            self.optimizer.__dict__.pop(name, None)
        self._overridden.clear()

    # ---- what the bucket methods read ---------------------------------------------------

    def comm_dtype(self, param):
        return self.optimizer.get_param_comm_dtype(param)

    def elements(self, comm_dtype) -> int:
        """Where the next gradient's slice of the bucket starts (reserved slices included)."""
        return self.optimizer.ipg_buckets[comm_dtype].elements

    def buffer(self, comm_dtype):
        """The bucket's buffer (None until the first stock add allocates it)."""
        return self.optimizer.ipg_buckets[comm_dtype].buffer

    def has_params(self, comm_dtype) -> bool:
        return bool(self.optimizer.ipg_buckets[comm_dtype].params)

    def append(self, comm_dtype, param, numel: int) -> None:
        """The stock add's bookkeeping, for a gradient whose copy is deferred to the flush."""
        bucket = self.optimizer.ipg_buckets[comm_dtype]
        bucket.params.append(param)
        if self._has_bucket_group:  # the param's partition group, where the bucket records it
            bucket.process_group = self.optimizer._get_param_partition_group(param)
        bucket.elements += numel

    @property
    def reduce_stream(self):
        return self.optimizer.reduce_and_partition_stream

    @property
    def zenflow(self) -> bool:
        # ZenFlow copies transposed gradients into the bucket: left to the stock method.
        return bool(getattr(self.optimizer, "zenflow", False))  # 0.17.6's stage 3 has none

    def goes_into_buffer(self, comm_dtype, numel: int) -> bool:
        """The stock rule for copying a gradient into the bucket buffer (else it stays standalone)."""
        opt = self.optimizer
        return opt.contiguous_gradients and self.elements(comm_dtype) + numel <= opt.reduce_bucket_size


class FusedLayout(NamedTuple):
    """One coalesced gather as the fused copy-out sees it."""

    gathered: object  # the flat buffer every rank's segment was gathered into
    shard_numels: list  # each param's per-rank shard length in a segment
    numels: list  # each param's full length
    dtype: object  # the params' dtype (the copy-out casts to it)
    params: list
    world_size: int


class Zero3GatherHandles:
    """Coalesced all-gather handles of one engine's params, and what their ``wait`` reads."""

    PER_PARAM_GATHER = "all_gather_coalesced"

    def __init__(self, params):
        from deepspeed.runtime.zero import partition_parameters as pp

        self._pp = pp
        self.Coalesced = require(pp, "AllGatherCoalescedHandle", "the coalesced all-gather handle")
        self.Multiple = require(pp, "MultipleAllGatherHandles", "the multi-handle all-gather wrapper")
        self.ZeroParamStatus = require(pp, "ZeroParamStatus", "the ZeRO-3 param status enum")
        if "handle_dependency" not in inspect.signature(_undecorated(self.Coalesced.wait)).parameters:
            _unsupported("the handle_dependency argument of AllGatherCoalescedHandle.wait")
        require(self.Coalesced, "data_buffer", "the deferred-dependency buffer list")
        # Instance attributes: probe a handle of no params (construction only stores its arguments).
        probe = self.Coalesced(None, [], [], 1)
        for name in _HANDLE_FIELDS:
            require(probe, name, "a coalesced all-gather handle field")
        require(self.Multiple([]), "handles", "the multi-handle list")
        for param in params:
            if self.PER_PARAM_GATHER not in param.__dict__:
                _unsupported("the per-param `all_gather_coalesced` instance attribute")
            for name in ("ds_tensor", "ds_numel", "ds_shape", "ds_status", "ds_secondary_tensor", "ds_persist"):
                require(param, name, "a ZeRO-3 parameter attribute")

    def coalesced_in(self, handle):
        """Every AllGatherCoalescedHandle inside what all_gather_coalesced returned."""
        if isinstance(handle, self.Coalesced):
            yield handle
        elif isinstance(handle, self.Multiple):
            for inner in handle.handles:
                yield from self.coalesced_in(inner)

    def wrap_param_gathers(self, params, around) -> Patches:
        """``around(original, *args, **kwargs)`` in place of each param's ``all_gather_coalesced``.
        Returns the patches (``undo()`` puts every param's back)."""
        patches = Patches()
        for param in params:
            patches.wrap(param, self.PER_PARAM_GATHER, around)
        return patches

    def replace_waits(self, handle, make_wait) -> None:
        """Every coalesced handle inside what all_gather_coalesced returned waits with ``make_wait(it)``."""
        for coalesced in self.coalesced_in(handle):
            coalesced.wait = make_wait(coalesced)

    def stock_wait(self, handle, handle_dependency: bool) -> None:
        self.Coalesced.wait(handle, handle_dependency=handle_dependency)

    @staticmethod
    def is_complete(handle) -> bool:
        return handle.complete

    @staticmethod
    def mark_complete(handle) -> None:
        handle.complete = True

    @staticmethod
    def wait_collective(handle) -> None:
        handle.allgather_handle.wait()

    def fused_layout(self, handle, op_dtypes):
        """The layout of a gather the fused copy-out covers, else None (the stock wait then)."""
        params = handle.params
        if handle.quantization is not None or not params:
            return None  # quantized: dequantized per param dtype by the stock wait
        if any(param.ds_persist for param in params):
            return None  # never released: would pin every other param's storage in the shared buffer
        dtypes = {param.ds_tensor.dtype for param in params}
        if len(dtypes) != 1 or not dtypes <= op_dtypes:
            return None
        shard_numels = self.shard_numels(handle)
        gathered = self.gathered_buffer(handle, sum(shard_numels))
        if gathered is None or gathered.dtype not in op_dtypes:
            return None
        return FusedLayout(gathered, shard_numels, [param.ds_numel for param in params], dtypes.pop(), list(params),
                           handle.world_size)

    def hand_out(self, layout: FusedLayout, out) -> None:
        """Each param of the gather becomes its view of ``out`` and is available, as the stock wait leaves it."""
        inflight, available = self.ZeroParamStatus.INFLIGHT, self.ZeroParamStatus.AVAILABLE
        for param in layout.params:
            assert param.ds_status == inflight, f"param {param.ds_summary()} is not inflight"
        offsets = [0, *itertools.accumulate(layout.numels)][:-1]
        ops.repoint_to_slices(out, layout.params, offsets, [param.ds_shape for param in layout.params])
        for param in layout.params:
            param.ds_status = available

    @staticmethod
    def shard_numels(handle):
        """Each param's per-rank shard length inside the gathered buffer (as the stock wait computes it)."""
        if handle.use_secondary_tensor:
            return [p.ds_tensor.ds_numel * p.ds_secondary_tensor_num_of_groups for p in handle.params]
        return [p.ds_tensor.ds_numel for p in handle.params]

    @staticmethod
    def gathered_buffer(handle, shard_total: int):
        """The one flat tensor the rank segments (``handle.partitions``) are consecutive narrows of, or None."""
        partitions = handle.partitions
        if not partitions:
            return None
        flat = partitions[0]._base
        if flat is None or flat.dim() != 1 or flat.numel() != shard_total * handle.world_size:
            return None
        step = shard_total * flat.element_size()
        for rank, part in enumerate(partitions):
            if part.numel() != shard_total or part.data_ptr() != flat.data_ptr() + rank * step:
                return None
        return flat

    def keep_until_free_buffer(self, tensor) -> None:
        """handle_dependency=False: the coordinator frees these after syncing (``free_buffer``)."""
        self.Coalesced.data_buffer.append([tensor])


def _undecorated(function):
    """The function under DeepSpeed's ``instrument_w_nvtx`` (a closure without functools.wraps)."""
    for cell in function.__closure__ or ():
        if inspect.isfunction(cell.cell_contents):
            return _undecorated(cell.cell_contents)
    return function


def _unsupported(what: str):
    import deepspeed
    raise UnsupportedDeepSpeedError(
        f"zero_lifetime does not recognise DeepSpeed {deepspeed.__version__}: {what} is missing. "
        f"Supported DeepSpeed versions: {', '.join(SUPPORTED_DEEPSPEED_VERSIONS)}.")
