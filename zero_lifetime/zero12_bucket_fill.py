"""ZeRO-1/2: fill each IPG bucket with one fused ``bucket_fill`` per flush.

DeepSpeed copies every gradient into the bucket as its hook fires (one copy kernel per
param). Here a hook only reserves the gradient's slice of the bucket; the copies are
made in one ``ops.bucket_fill`` right before anything reads the bucket (its reduction,
at overflow or at the end of backward), and then each gradient is re-pointed at its
slice, as DeepSpeed does. The price: the reserved gradients stay alive until the
flush, at most one bucket's worth.

With reduce_scatter (DeepSpeed's default) DeepSpeed divides the whole bucket by the
data-parallel world size before reducing it: one more pass over the bucket. The fill
applies that factor while copying, and the reduction then skips its division.

Cases DeepSpeed treats specially (non-contiguous gradients, ZenFlow, a gradient larger
than the bucket) go through its own code unchanged.
"""

from .adapters.zero12_buckets import Zero12Buckets
from .reserved_fill import Reservations, fill_and_repoint


class _Pending(Reservations):
    """Gradients waiting for the fill of one bucket buffer, and the streams that made them."""

    __slots__ = ("streams", )

    def __init__(self):
        super().__init__()
        self.streams = []


class Zero12BucketFill:

    def __init__(self, optimizer):
        self.buckets = Zero12Buckets(optimizer)
        self.optimizer = optimizer
        self._original_add = optimizer.reduce_independent_p_g_buckets_and_remove_grads
        self._original_reduce = optimizer.reduce_ipg_grads
        self._pending = {}  # comm dtype -> _Pending
        self.fills = 0  # fused fills run (for stats and tests)
        self.fused_grads = 0
        self.prescaled_fills = 0  # fills that also did DeepSpeed's division by the world size
        optimizer.reduce_independent_p_g_buckets_and_remove_grads = self._add
        optimizer.reduce_ipg_grads = self._reduce

    # ---- DeepSpeed entry points --------------------------------------------------------

    def _add(self, param, i):
        opt = self.optimizer
        numel = param.numel()
        if numel == 0 or not opt.contiguous_gradients or self.buckets.zenflow or numel > opt.reduce_bucket_size:
            return self._original_add(param, i)
        grad = opt.get_gradient_for_reduction(param)
        comm_dtype = opt.get_param_comm_dtype(param)
        bucket = opt.ipg_buckets[comm_dtype]
        if bucket.elements + numel > opt.reduce_bucket_size:
            self.buckets.reduce(opt.reduce_ipg_grads, comm_dtype)  # flushes the pending fill first
            self.buckets.after_overflow_reduce()
            if opt.overlap_comm:
                bucket.index = 1 - bucket.index
        if not getattr(param, "ds_grad_is_ready", True):
            return None
        self.buckets.fold_autoep(param, grad)
        param_id = opt.get_param_id(param)
        assert not opt.params_already_reduced[param_id], (
            f"param {param_id} was already reduced: a gradient computed twice for this partition")
        assert grad is not None, f"param {param_id}: no gradient to reduce"
        pending = self._pending.get(comm_dtype)
        if pending is None:
            pending = self._pending[comm_dtype] = _Pending()
        pending.reserve(grad, bucket.elements, numel)
        if self.buckets.has_streams:
            pending.streams.append(self.buckets.current_stream())
        self.buckets.record_producer(grad, bucket)
        bucket.elements += numel
        bucket.grads.append(grad)
        bucket.params.append((i, param.param_idx_in_group, param_id))
        if self.buckets.is_moe_param(param):  # average_tensor picks its process group
            bucket.has_moe_params = True
        return None

    def _reduce(self, comm_dtype=None):
        dtypes = self.buckets.dtypes_reduced_by(comm_dtype)
        if not any(self._can_prescale(dtype) for dtype in dtypes):
            for dtype in dtypes:
                self._flush(dtype)
            return self.buckets.reduce(self._original_reduce, comm_dtype)
        # One dtype at a time (what DeepSpeed does inside one call), so each bucket's
        # reduction knows whether its fill already divided it.
        for dtype in dtypes:
            prescale = self._can_prescale(dtype)
            self._flush(dtype, scale=self.buckets.average_factor() if prescale else 1.0)
            with self.buckets.division_skipped(prescale):
                self._original_reduce(comm_dtype=dtype)
        return None

    def _can_prescale(self, comm_dtype) -> bool:
        # Every element the bucket holds came through the fused fill (an oversized grad
        # bypasses the buffer and is divided by DeepSpeed itself).
        pending = self._pending.get(comm_dtype)
        return (pending is not None and self.buckets.divides_bucket_before_reduce(comm_dtype)
                and self.optimizer.ipg_buckets[comm_dtype].elements == pending.numel)

    # ---- the fused fill ------------------------------------------------------------------

    def _flush(self, comm_dtype, scale: float = 1.0) -> None:
        pending = self._pending.pop(comm_dtype, None)
        if pending is None or not pending.items:
            return
        bucket = self.optimizer.ipg_buckets[comm_dtype]
        buffer = bucket.buffer[bucket.index]
        if self.buckets.has_streams:
            # Read every gradient only after the stream that produced it; the fill itself
            # runs on the current stream, which DeepSpeed's reduction then waits for.
            current = self.buckets.current_stream()
            for stream in set(pending.streams):
                if stream != current:
                    current.wait_stream(stream)
            self.buckets.wait_before_reusing(bucket)
            if self.optimizer.overlap_comm:
                self.buckets.note_copy_stream(bucket, current)
        else:
            self.buckets.wait_before_reusing(bucket)
        fill_and_repoint(buffer, pending.items, pending.offsets, scale)
        self.fills += 1
        self.prescaled_fills += scale != 1.0
        self.fused_grads += len(pending.items)

    def flush_pending(self) -> None:
        """Copy every reserved gradient into its bucket now (what runs before a bucket is read)."""
        for dtype in list(self._pending):
            self._flush(dtype)

    def discard(self) -> None:
        """A backward died: its reserved slices are stale (the buckets are reset too)."""
        self._pending.clear()

    def restore(self) -> None:
        self.flush_pending()
        self.optimizer.__dict__.pop("reduce_independent_p_g_buckets_and_remove_grads", None)
        self.optimizer.__dict__.pop("reduce_ipg_grads", None)
