"""ZeRO-1/2 IPG bucket internals (stage_1_and_2.py of DeepSpeed 0.19.8, 0.18.9 and 0.17.6).

The bucket state lives in ``optimizer.ipg_buckets[comm_dtype]`` (``buffer`` list,
``index``, ``elements``, ``params``, ``grads``); ``reduce_independent_p_g_buckets_and_remove_grads``
adds one param's gradient and ``reduce_ipg_grads`` reduces bucket contents.

Three features came in different releases; each is probed on its own:

* ``reduce_ipg_grads(comm_dtype=...)`` (``per_dtype_reduce``; 0.18.9 and 0.19.8): 0.17.6
  reduces every dtype's bucket in one call and then makes the reduction and current streams
  wait on each other after an overflow flush;
* the offload stream safety (``stream_safety``; 0.19.8: ``_offload_gradient_safety_enabled``,
  ``_record_gradient_stream``, ``_record_bucket_producer``, per-bucket ``copy_streams`` /
  ``reuse_events``): 0.18.9 and 0.17.6 have none and order nothing after a flush;
* ``gradient_average`` honoured by ``average_tensor``'s reduce-scatter division
  (``skippable_division``; 0.19.8): 0.18.9 and 0.17.6 always divide, so the fill never
  applies the division itself there.
"""

import contextlib
import inspect

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import is_moe_param

from ..ops_reference import SUPPORTED_DTYPES
from .errors import require
from .grad_hooks import BUCKET_ADD as _ADD
from .grad_window import after_epilogue
from .patching import Patches

_REDUCE = "reduce_ipg_grads"
_BUCKET_ATTRS = ("buffer", "index", "elements", "params", "grads", "clear")
_STREAM_SAFETY = ("_offload_gradient_safety_enabled", "_record_gradient_stream", "_record_bucket_producer")


class Zero12Buckets:
    """One ZeRO-1/2 optimizer's IPG buckets: its two bucket methods, replaced on the
    instance, and what the replacements read and record (buckets named by comm dtype)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        for name, what in (
            (_ADD, "the per-param bucket fill"),
            (_REDUCE, "the bucket reduction"),
            ("ipg_buckets", "the IPG buckets"),
            ("get_gradient_for_reduction", "the gradient accessor"),
            ("get_param_comm_dtype", "the communication dtype of a param"),
            ("get_param_id", "the param ids"),
            ("param_id", "the param id registry"),
            ("params_already_reduced", "the reduced-param flags"),
            ("reduce_bucket_size", "the bucket size"),
            ("contiguous_gradients", "the contiguous_gradients flag"),
            ("overlap_comm", "the overlap_comm flag"),
            ("reduce_scatter", "the reduce_scatter flag"),
            ("dp_process_group", "the data-parallel group"),
            ("sequence_parallel_size", "the sequence-parallel size"),
            ("extra_large_param_to_reduce", "the oversized-gradient slots"),
        ):
            require(optimizer, name, f"ZeRO-1/2 {what}")
        self.per_dtype_reduce = "comm_dtype" in inspect.signature(getattr(optimizer, _REDUCE)).parameters
        self.skippable_division = hasattr(optimizer, "gradient_average")
        # All of the stream safety or none of it: a part alone is a release nobody tested.
        self.stream_safety = hasattr(optimizer, _STREAM_SAFETY[0])
        if self.stream_safety:
            for name in _STREAM_SAFETY:
                require(optimizer, name, "the ZeRO-1/2 offload stream safety")
        for bucket in optimizer.ipg_buckets.values():
            for name in _BUCKET_ATTRS + (("copy_streams", "reuse_events") if self.stream_safety else ()):
                require(bucket, name, "an IPG bucket field")
        import deepspeed.runtime.zero.stage_1_and_2 as stage12
        self._sort_dtypes = require(stage12, "sort_dtypes", "DeepSpeed's bucket dtype order")
        self.zenflow = bool(getattr(optimizer, "zenflow", False))
        self.is_moe_param = is_moe_param
        self._autoep = getattr(optimizer, "_maybe_reduce_autoep_folding_tp_gradient", None)
        accelerator = get_accelerator()
        self.has_streams = not accelerator.resolves_data_dependency()
        self.current_stream = accelerator.current_stream
        self._patches = Patches()
        self.stock_add = self.stock_reduce = None  # the methods the replacements stand in for

    # ---- the replaced entry points -------------------------------------------------------

    def replace_methods(self, add, reduce) -> None:
        """``add(param, i)`` and ``reduce(comm_dtype=None)`` take over the stock methods."""
        self.stock_add = self._patches.replace(self.optimizer, _ADD, add).original
        self.stock_reduce = self._patches.replace(self.optimizer, _REDUCE, reduce).original

    def after_epilogue(self, callback) -> None:
        """``callback()`` after each backward's epilogue (its last reduction) returns; undone by restore()."""
        self._patches.keep(after_epilogue(self.optimizer, callback))

    def restore(self) -> None:
        self._patches.undo()

    # ---- adding a gradient ----------------------------------------------------------------

    def takes_reservation(self, param) -> bool:
        """False for what the stock add treats specially (an empty or oversized gradient,
        non-contiguous gradients, ZenFlow) and for params of a dtype the fused copy has no
        kernel for (an fp64 model): that goes through the stock add unchanged. (A 16- or
        32-bit param's gradient and bucket are 16- or 32-bit too, whatever grad_accum_dtype.)"""
        opt, numel = self.optimizer, param.numel()
        return (numel != 0 and opt.contiguous_gradients and not self.zenflow and numel <= opt.reduce_bucket_size
                and param.dtype in SUPPORTED_DTYPES)

    def add_without_copy(self, param, i):
        """The stock add, all but its copy: reduce a bucket that would overflow, check the
        param, record the gradient in the bucket. Returns (comm_dtype, gradient, offset of
        its slice in the bucket buffer), or None when the param's gradient is not ready."""
        opt = self.optimizer
        numel = param.numel()
        grad = opt.get_gradient_for_reduction(param)
        comm_dtype = opt.get_param_comm_dtype(param)
        bucket = opt.ipg_buckets[comm_dtype]
        if bucket.elements + numel > opt.reduce_bucket_size:
            self.reduce(getattr(opt, _REDUCE), comm_dtype)  # the replaced reduce: flushes the pending fill first
            self._after_overflow_reduce()
            if opt.overlap_comm:
                bucket.index = 1 - bucket.index
        if not getattr(param, "ds_grad_is_ready", True):
            return None
        if self._autoep is not None:
            self._autoep(param, grad)
        param_id = opt.get_param_id(param)
        assert not opt.params_already_reduced[param_id], (
            f"param {param_id} was already reduced: a gradient computed twice for this partition")
        assert grad is not None, f"param {param_id}: no gradient to reduce"
        offset = bucket.elements
        self._record_producer(grad, bucket)
        bucket.elements += numel
        bucket.grads.append(grad)
        bucket.params.append((i, param.param_idx_in_group, param_id))
        if self.is_moe_param(param):  # average_tensor picks its process group
            bucket.has_moe_params = True
        return comm_dtype, grad, offset

    def elements(self, comm_dtype) -> int:
        """How much of the bucket is taken (reserved slices included)."""
        return self.optimizer.ipg_buckets[comm_dtype].elements

    # ---- filling a bucket ----------------------------------------------------------------

    def buffer_for_fill(self, comm_dtype, producer_streams):
        """The buffer the reserved gradients go into, once the current stream may write it:
        after every stream that produced them and the reduction that last read the buffer."""
        bucket = self.optimizer.ipg_buckets[comm_dtype]
        if self.has_streams:
            # The fill runs on the current stream, which DeepSpeed's reduction then waits for.
            current = self.current_stream()
            for stream in set(producer_streams):
                if stream != current:
                    current.wait_stream(stream)
            self._wait_before_reusing(bucket)
            if self.optimizer.overlap_comm:
                self._note_copy_stream(bucket, current)
        else:
            self._wait_before_reusing(bucket)
        return bucket.buffer[bucket.index]

    def _wait_before_reusing(self, bucket) -> None:
        """DeepSpeed's offload safety: the buffer must not be rewritten before the
        reduction that last read it (recorded per buffer index) has finished."""
        if (self.stream_safety and self.optimizer._offload_gradient_safety_enabled
                and bucket.index in bucket.reuse_events):
            self.current_stream().wait_event(bucket.reuse_events[bucket.index])

    def _record_producer(self, grad, bucket) -> None:
        """What the stock add records for the offload stream safety (0.19.8; nothing before)."""
        if not self.stream_safety:
            return
        if self.has_streams:
            self.optimizer._record_gradient_stream(grad, self.current_stream())
        self.optimizer._record_bucket_producer(bucket)

    def _note_copy_stream(self, bucket, stream) -> None:
        """The reduction waits on every stream that copied into the bucket (0.19.8)."""
        if self.stream_safety:
            bucket.copy_streams.add(stream)

    def reduce(self, reduce_ipg_grads, comm_dtype) -> None:
        """Call ``reduce_ipg_grads`` (stock or wrapped) for ``comm_dtype``: on 0.17.6 for every dtype."""
        if self.per_dtype_reduce:
            reduce_ipg_grads(comm_dtype=comm_dtype)
        else:
            reduce_ipg_grads()

    def dtypes_reduced_by(self, comm_dtype):
        """The buckets one reduce_ipg_grads call reads, in DeepSpeed's order."""
        if comm_dtype is None or not self.per_dtype_reduce:
            return self.sorted_dtypes()
        return [comm_dtype]

    def _after_overflow_reduce(self) -> None:
        """0.17.6's ordering after a flush (0.19.8 orders with reuse_events instead)."""
        opt = self.optimizer
        if not self.per_dtype_reduce and opt.overlap_comm and self.has_streams:
            opt.reduction_stream.wait_stream(self.current_stream())
            self.current_stream().wait_stream(opt.reduction_stream)

    # ---- the layout every rank must share ----------------------------------------------

    def layouts(self, dtypes):
        """Each non-empty bucket of ``dtypes`` as (dtype name, its entries in slot order).
        An entry names one param the same way on every rank: (group, index in group, param id)."""
        buckets = self.optimizer.ipg_buckets
        return [(str(dtype), tuple(buckets[dtype].params)) for dtype in dtypes if buckets[dtype].params]

    def param_names(self, named_params):
        """param id (the third field of a layout entry) -> name, for the params the optimizer manages."""
        opt = self.optimizer
        managed = opt.param_id
        return {opt.get_param_id(p): name for name, p in named_params if id(p) in managed}

    def data_parallel_group(self):
        return self.optimizer.dp_process_group

    def data_parallel_world_size(self) -> int:
        return dist.get_world_size(group=self.optimizer.dp_process_group)

    @staticmethod
    def collective_device():
        """Where this accelerator's collectives take tensors (gloo: the CPU)."""
        return get_accelerator().current_device_name()

    def sorted_dtypes(self):
        return self._sort_dtypes(self.optimizer.ipg_buckets.keys())  # DeepSpeed's reduction order

    def divides_bucket_before_reduce(self, comm_dtype) -> bool:
        """average_tensor's reduce_scatter path divides the bucket in place first, and
        skips that when gradient_average is off (0.19.8; 0.18.9 and 0.17.6 always divide)."""
        opt = self.optimizer
        return (self.skippable_division and opt.reduce_scatter and opt.gradient_average and opt.contiguous_gradients
                and comm_dtype not in opt.extra_large_param_to_reduce and self.average_factor() != 1.0)

    def average_factor(self) -> float:
        return float(self.optimizer.sequence_parallel_size) / self.data_parallel_world_size()

    @contextlib.contextmanager
    def division_skipped(self, skip: bool):
        """average_tensor without its division (the fill already applied it)."""
        if not skip:
            yield
            return
        opt = self.optimizer
        opt.gradient_average = False
        try:
            yield
        finally:
            opt.gradient_average = True
