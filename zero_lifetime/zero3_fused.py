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
(nothing to gather), and a group of one param gets the sequential ``AllGatherHandle``.
Nothing is patched on a class: both halves are per-instance attributes of this engine's
optimizer and params, so other engines stay stock.
"""

import weakref

import torch
from deepspeed.accelerator import get_accelerator

from .adapters.zero3_buckets import ADD_GRAD, REDUCE_BUCKET, Zero3Buckets, Zero3GatherHandles
from .ops_reference import SUPPORTED_DTYPES
from .reserved_fill import Reservations, fill_and_repoint

_OP_DTYPES = frozenset(SUPPORTED_DTYPES)


class Zero3FusedCopies:

    def __init__(self, engine):
        from . import ops

        self._ops = ops
        self._accelerator = get_accelerator()
        self.buckets = Zero3Buckets(engine.optimizer)
        self._params = list(engine.module.parameters())
        self.handles = Zero3GatherHandles(self._params)
        self.counts = {"bucket_fills": 0, "filled_grads": 0, "fused_gathers": 0, "stock_gathers": 0}
        self._pending = {}  # comm dtype -> Reservations (of params)
        self._installed = True
        self.buckets.override(ADD_GRAD, self._add_grad_to_bucket)
        self.buckets.override(REDUCE_BUCKET, self._reduce_bucket)
        self._wrapped_gathers = []
        for param in self._params:
            original = param.__dict__[Zero3GatherHandles.PER_PARAM_GATHER]
            wrapper = self._wrap_gather(original)
            param.__dict__[Zero3GatherHandles.PER_PARAM_GATHER] = wrapper
            self._wrapped_gathers.append((param, original, wrapper))

    def uninstall(self) -> None:
        """Stock methods back: pending gradients are filled now; handles already in flight wait the stock way."""
        self._installed = False
        self._fill_all_pending()
        self.buckets.restore()
        for param, original, wrapper in self._wrapped_gathers:
            if param.__dict__.get(Zero3GatherHandles.PER_PARAM_GATHER) is wrapper:
                param.__dict__[Zero3GatherHandles.PER_PARAM_GATHER] = original
        self._wrapped_gathers.clear()

    # ---- gradient buckets -----------------------------------------------------------------

    @torch.no_grad()
    def _add_grad_to_bucket(self, param) -> None:
        buckets = self.buckets
        comm_dtype = buckets.comm_dtype(param)
        bucket = buckets.bucket_of_dtype(comm_dtype)
        if bucket.elements == 0:
            # A bucket emptied elsewhere (step(), an interrupted backward) drops its reservations.
            self._pending.pop(comm_dtype, None)
        if not self._fusable_grad(bucket, param.grad):
            # Copied now at bucket.elements, which counts the reserved slices too.
            return buckets.stock(ADD_GRAD)(param)
        accelerator = self._accelerator
        if not accelerator.resolves_data_dependency():
            # As stock: everything queued on the reduce stream from now on (the fill
            # included) runs after the stream that produced this gradient. Only the
            # reduce stream waits; the autograd stream never waits on reductions.
            buckets.reduce_stream.wait_stream(accelerator.current_stream())
        numel = param.grad.numel()
        if buckets.goes_into_buffer(bucket, numel):
            # The param, not its gradient: the fill reads whatever .grad holds at the flush.
            self._pending.setdefault(comm_dtype, Reservations()).reserve(param, bucket.elements, numel)
        bucket.params.append(param)
        buckets.note_partition_group(bucket, param)
        bucket.elements += numel

    def _fusable_grad(self, bucket, grad) -> bool:
        if self.buckets.zenflow:  # ZenFlow copies transposed gradients: the stock method does
            return False
        return grad.dtype in _OP_DTYPES and (bucket.buffer is None or bucket.buffer.dtype in _OP_DTYPES)

    @torch.no_grad()
    def _reduce_bucket(self, comm_dtype) -> None:
        self._fill(comm_dtype)
        return self.buckets.stock(REDUCE_BUCKET)(comm_dtype)

    def _fill(self, comm_dtype) -> None:
        pending = self._pending.pop(comm_dtype, None)
        bucket = self.buckets.bucket_of_dtype(comm_dtype)
        if pending is None or not bucket.params:
            return
        accelerator = self._accelerator
        # The fill reads the old storage on the reduce stream: not reusable before it ran.
        keep_until_read = (None if accelerator.is_synchronized_device() else
                           lambda grad: grad.record_stream(accelerator.current_stream()))
        with accelerator.stream(self.buckets.reduce_stream):
            grads = [param.grad for param in pending.items]
            fill_and_repoint(bucket.buffer, grads, pending.offsets, 1.0, keep_until_read)
        self.counts["bucket_fills"] += 1
        self.counts["filled_grads"] += len(grads)

    def _fill_all_pending(self) -> None:
        # After uninstall the stock flush would read buffer slices nobody wrote.
        with torch.no_grad():
            for comm_dtype in list(self._pending):
                self._fill(comm_dtype)

    # ---- coalesced all-gathers ------------------------------------------------------------

    def _wrap_gather(self, original):

        def all_gather_coalesced(*args, **kwargs):
            handle = original(*args, **kwargs)
            if self._installed:
                for coalesced in self.handles.coalesced_in(handle):
                    coalesced.wait = self._fused_wait_of(coalesced)
            return handle

        return all_gather_coalesced

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
        if handle.complete:
            return
        layout = self._fusable_layout(handle) if self._installed else None
        if layout is None:
            self.counts["stock_gathers"] += 1
            return self.handles.stock_wait(handle, handle_dependency)
        gathered, shard_numels, dtype = layout
        handle.allgather_handle.wait()
        params = handle.params
        numels = [param.ds_numel for param in params]
        # Cast on the way (autocast gathers in its comm dtype; params keep ds_tensor's).
        out = self._ops.gather_buffer(sum(numels), dtype, gathered.device)
        self._ops.gather_copy_out(gathered, out, shard_numels, numels, handle.world_size)
        offset = 0
        for param, numel in zip(params, numels):
            assert self.handles.is_inflight(param), f"expected param {param.ds_summary()} to be inflight"
            param.data = out.narrow(0, offset, numel).view(param.ds_shape)
            self.handles.mark_available(param)
            offset += numel
        accelerator = self._accelerator
        if not accelerator.is_synchronized_device():
            if handle_dependency:
                gathered.record_stream(accelerator.current_stream())
            else:  # the coordinator syncs, then drops these (AllGatherCoalescedHandle.free_buffer)
                self.handles.keep_until_free_buffer(gathered)
        handle.complete = True
        self.counts["fused_gathers"] += 1

    def _fusable_layout(self, handle):
        """(gathered flat buffer, shard numels, param dtype) when the fused copy-out applies, else None."""
        params = handle.params
        if handle.quantization is not None or not params:
            return None  # quantized: dequantized per param dtype by the stock wait
        if any(param.ds_persist for param in params):
            return None  # never released: would pin every other param's storage in the shared buffer
        dtypes = {param.ds_tensor.dtype for param in params}
        if len(dtypes) != 1 or not dtypes <= _OP_DTYPES:
            return None
        shard_numels = self.handles.shard_numels(handle)
        gathered = self.handles.gathered_buffer(handle, sum(shard_numels))
        if gathered is None or gathered.dtype not in _OP_DTYPES:
            return None
        return gathered, shard_numels, dtypes.pop()
