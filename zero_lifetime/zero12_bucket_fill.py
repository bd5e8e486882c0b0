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

With more than one data-parallel rank, every backward also checks that the ranks reduced
the same bucket layouts (``bucket_order_check``).
"""

from .adapters.zero12_buckets import Zero12Buckets
from .bucket_order_check import BucketOrderCheck
from .reserved_fill import Reservations, fill_and_repoint


class _Pending(Reservations):
    """Gradients waiting for the fill of one bucket buffer, and the streams that made them."""

    __slots__ = ("streams", )

    def __init__(self):
        super().__init__()
        self.streams = []


class Zero12BucketFill:

    def __init__(self, optimizer, named_params=(), on_order_mismatch=None):
        """``on_order_mismatch``: with more than one rank, each backward checks that the ranks
        reduced the same bucket layouts, and calls it (to drop the mixed sums) before raising.
        On one rank there is nothing to compare: no check is built."""
        self.buckets = Zero12Buckets(optimizer)
        self._pending = {}  # comm dtype -> _Pending
        self.fills = 0  # fused fills run (for stats and tests)
        self.fused_grads = 0
        self.prescaled_fills = 0  # fills that also did DeepSpeed's division by the world size
        self.order_check = None
        if on_order_mismatch is not None and self.buckets.data_parallel_world_size() > 1:
            self.order_check = BucketOrderCheck(self.buckets, named_params, on_order_mismatch)
        self.buckets.replace_methods(add=self._add, reduce=self._reduce)
        if self.order_check is not None:
            self.buckets.after_epilogue(self.order_check.check)

    # ---- DeepSpeed entry points --------------------------------------------------------

    def _add(self, param, i):
        buckets = self.buckets
        if not buckets.takes_reservation(param):
            return buckets.stock_add(param, i)
        added = buckets.add_without_copy(param, i)
        if added is None:
            return None
        comm_dtype, grad, offset = added
        pending = self._pending.get(comm_dtype)
        if pending is None:
            pending = self._pending[comm_dtype] = _Pending()
        pending.reserve(grad, offset, param.numel())
        if buckets.has_streams:
            pending.streams.append(buckets.current_stream())
        return None

    def _reduce(self, comm_dtype=None):
        buckets = self.buckets
        dtypes = buckets.dtypes_reduced_by(comm_dtype)
        if self.order_check is not None:
            self.order_check.note_reduction(dtypes)
        if not any(self._can_prescale(dtype) for dtype in dtypes):
            for dtype in dtypes:
                self._flush(dtype)
            return buckets.reduce(buckets.stock_reduce, comm_dtype)
        # One dtype at a time (what DeepSpeed does inside one call), so each bucket's
        # reduction knows whether its fill already divided it.
        for dtype in dtypes:
            prescale = self._can_prescale(dtype)
            self._flush(dtype, scale=buckets.average_factor() if prescale else 1.0)
            with buckets.division_skipped(prescale):
                buckets.stock_reduce(comm_dtype=dtype)
        return None

    def _can_prescale(self, comm_dtype) -> bool:
        # Every element the bucket holds came through the fused fill (an oversized grad
        # bypasses the buffer and is divided by DeepSpeed itself).
        pending = self._pending.get(comm_dtype)
        return (pending is not None and self.buckets.divides_bucket_before_reduce(comm_dtype)
                and self.buckets.elements(comm_dtype) == pending.numel)

    # ---- the fused fill ------------------------------------------------------------------

    def _flush(self, comm_dtype, scale: float = 1.0) -> None:
        pending = self._pending.pop(comm_dtype, None)
        if pending is None or not pending.items:
            return
        buffer = self.buckets.buffer_for_fill(comm_dtype, pending.streams)
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
        if self.order_check is not None:
            self.order_check.forget()

    def restore(self) -> None:
        self.flush_pending()
        self.buckets.restore()
