"""ZeRO-3's two per-param copy loops as one fused launch each, on one engine.

* Gradient buckets: stock DeepSpeed copies every gradient into the IPG bucket buffer as
  it arrives (one copy launch per param). Here a gradient only reserves its slice; the
  whole bucket is filled by one ``ops.bucket_fill`` when the bucket is flushed, and each
  gradient is then re-pointed at its slice, as the stock copy leaves it. Cost: until the
  flush the gradients keep their own storage (at most ``reduce_bucket_size`` elements
  more than stock at the peak).
* Coalesced all-gathers: stock ``AllGatherCoalescedHandle.wait`` builds each param with
  one ``torch.cat`` of its shards. Here one ``ops.gather_copy_out`` writes every param
  into ONE buffer per gather and each ``param.data`` becomes a view of it; the buffer's
  storage goes when the last of its params is released (``free_param``); on the CPU it
  goes back to ``ops``' gather-buffer cache for the next gather. A handle this
  path does not cover (quantized, persistent params, mixed dtypes, an unexpected layout)
  keeps the stock wait.

The gather half only runs with more than one rank: one rank gets ``NoGatherCoalescedHandle``
(nothing to gather), and a group of one param gets the sequential ``AllGatherHandle``. It needs
no optimizer (``Zero3FusedGathers``): an engine built without one gets it alone.
Nothing is patched on a class: both halves are per-instance attributes of this engine's
optimizer and params, so other engines stay stock.
"""

import weakref

import torch
from deepspeed.accelerator import get_accelerator

from .adapters.zero3_buckets import ADD_GRAD, REDUCE_BUCKET, Zero3Buckets, Zero3GatherHandles
from .ops_reference import SUPPORTED_DTYPES
from .reserved_fill import Reservations, fill_and_repoint


class Zero3FusedCopies:
    """Both halves on an engine with a ZeRO-3 optimizer."""

    def __init__(self, engine):
        self._accelerator = get_accelerator()
        self.buckets = Zero3Buckets(engine.optimizer)
        self._bucket_counts = {"bucket_fills": 0, "filled_grads": 0}
        self._pending = {}  # comm dtype -> Reservations (of params)
        self.buckets.override(ADD_GRAD, self._add_grad_to_bucket)
        self.buckets.override(REDUCE_BUCKET, self._reduce_bucket)
        try:
            self.gathers = Zero3FusedGathers(list(engine.module.parameters()))
        except BaseException:
            self.buckets.restore()  # a refused gather probe leaves no bucket patched
            raise

    @property
    def counts(self) -> dict:
        return {**self._bucket_counts, **self.gathers.counts}

    def uninstall(self) -> None:
        """Stock methods back: pending gradients are filled now; handles already in flight wait the stock way."""
        self._fill_all_pending()
        self.buckets.restore()
        self.gathers.uninstall()

    def wait(self, handle, handle_dependency: bool = True) -> None:
        self.gathers.wait(handle, handle_dependency)

    # ---- gradient buckets -----------------------------------------------------------------

    @torch.no_grad()
    def _add_grad_to_bucket(self, param) -> None:
        buckets = self.buckets
        comm_dtype = buckets.comm_dtype(param)
        if buckets.elements(comm_dtype) == 0:
            # A bucket emptied elsewhere (step(), an interrupted backward) drops its reservations.
            self._pending.pop(comm_dtype, None)
        if not self._fusable_grad(comm_dtype, param.grad):
            # Copied now at the bucket's fill state, which counts the reserved slices too.
            return buckets.stock(ADD_GRAD)(param)
        accelerator = self._accelerator
        if not accelerator.resolves_data_dependency():
            # As stock: everything queued on the reduce stream from now on (the fill
            # included) runs after the stream that produced this gradient. Only the
            # reduce stream waits; the autograd stream never waits on reductions.
            buckets.reduce_stream.wait_stream(accelerator.current_stream())
        numel = param.grad.numel()
        if buckets.goes_into_buffer(comm_dtype, numel):
            # The param, not its gradient: the fill reads whatever .grad holds at the flush.
            self._pending.setdefault(comm_dtype, Reservations()).reserve(param, buckets.elements(comm_dtype), numel)
        buckets.append(comm_dtype, param, numel)

    def _fusable_grad(self, comm_dtype, grad) -> bool:
        if self.buckets.zenflow:  # ZenFlow copies transposed gradients: the stock method does
            return False
        buffer = self.buckets.buffer(comm_dtype)
        return grad.dtype in SUPPORTED_DTYPES and (buffer is None or buffer.dtype in SUPPORTED_DTYPES)

    @torch.no_grad()
    def _reduce_bucket(self, comm_dtype) -> None:
        self._fill(comm_dtype)
        return self.buckets.stock(REDUCE_BUCKET)(comm_dtype)

    def _fill(self, comm_dtype) -> None:
        pending = self._pending.pop(comm_dtype, None)
        if pending is None or not self.buckets.has_params(comm_dtype):
            return
        accelerator = self._accelerator
        reduce_stream = self.buckets.reduce_stream
        # The fill reads the old storage on the reduce stream: not reusable before it ran.
        keep_until_read = (None if accelerator.is_synchronized_device() else
                           lambda grad: grad.record_stream(reduce_stream))
        with accelerator.stream(reduce_stream):
            grads = [param.grad for param in pending.items]
            fill_and_repoint(self.buckets.buffer(comm_dtype), grads, pending.offsets, 1.0, keep_until_read)
        self._bucket_counts["bucket_fills"] += 1
        self._bucket_counts["filled_grads"] += len(grads)

    def _fill_all_pending(self) -> None:
        # After uninstall the stock flush would read buffer slices nobody wrote.
        with torch.no_grad():
            for comm_dtype in list(self._pending):
                self._fill(comm_dtype)


class Zero3FusedGathers:
    """The gather half: each coalesced all-gather of ``params`` copied out in one fused launch."""

    def __init__(self, params):
        from . import ops

        self._ops = ops
        self._accelerator = get_accelerator()
        self.handles = Zero3GatherHandles(params)
        self.counts = {"fused_gathers": 0, "stock_gathers": 0}
        self._installed = True
        self._gather_patches = self.handles.wrap_param_gathers(params, self._all_gather_coalesced)

    def uninstall(self) -> None:
        """Stock gathers back; handles already in flight wait the stock way."""
        self._installed = False
        self._gather_patches.undo()

    def _all_gather_coalesced(self, original, *args, **kwargs):
        handle = original(*args, **kwargs)
        if self._installed:
            self.handles.replace_waits(handle, self._fused_wait_of)
        return handle

    def _fused_wait_of(self, handle):
        # A weak reference: the handle holds this function, and a cycle would keep the
        # gathered buffer alive until the next garbage collection.
        handle_ref = weakref.ref(handle)

        def wait(handle_dependency=True):
            self._wait(handle_ref(), handle_dependency)

        return wait

    def wait(self, handle, handle_dependency: bool = True) -> None:
        """Wait one ``AllGatherCoalescedHandle`` as installed gathers do: one fused copy-out
        where it applies, else the stock wait."""
        self._wait(handle, handle_dependency)

    def _wait(self, handle, handle_dependency: bool) -> None:
        handles = self.handles
        if handles.is_complete(handle):
            return
        layout = handles.fused_layout(handle, SUPPORTED_DTYPES) if self._installed else None
        if layout is None:
            self.counts["stock_gathers"] += 1
            return handles.stock_wait(handle, handle_dependency)
        handles.wait_collective(handle)
        gathered = layout.gathered
        # Cast on the way (autocast gathers in its comm dtype; params keep ds_tensor's).
        out = self._ops.gather_buffer(sum(layout.numels), layout.dtype, gathered.device)
        self._ops.gather_copy_out(gathered, out, layout.shard_numels, layout.numels, layout.world_size)
        handles.hand_out(layout, out)
        accelerator = self._accelerator
        if not accelerator.is_synchronized_device():
            if handle_dependency:
                gathered.record_stream(accelerator.current_stream())
            else:  # the coordinator syncs, then drops these (AllGatherCoalescedHandle.free_buffer)
                handles.keep_until_free_buffer(gathered)
        handles.mark_complete(handle)
        self.counts["fused_gathers"] += 1
