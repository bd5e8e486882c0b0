"""ZeRO-1/2 IPG bucket internals (DeepSpeed 0.19.8, stage_1_and_2.py).

The bucket state lives in ``optimizer.ipg_buckets[comm_dtype]`` (``buffer`` list,
``index``, ``elements``, ``params``, ``grads``, ``copy_streams``, ``reuse_events``);
``reduce_independent_p_g_buckets_and_remove_grads`` adds one param's gradient and
``reduce_ipg_grads`` reduces what a bucket holds.
"""

import contextlib

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import is_moe_param

from .errors import require

_BUCKET_ATTRS = ("buffer", "index", "elements", "params", "grads", "copy_streams", "reuse_events")


class Zero12Buckets:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        for name, what in (
            ("reduce_independent_p_g_buckets_and_remove_grads", "the per-param bucket fill"),
            ("reduce_ipg_grads", "the bucket reduction"),
            ("ipg_buckets", "the IPG buckets"),
            ("get_gradient_for_reduction", "the gradient accessor"),
            ("get_param_comm_dtype", "the communication dtype of a param"),
            ("get_param_id", "the param ids"),
            ("params_already_reduced", "the reduced-param flags"),
            ("reduce_bucket_size", "the bucket size"),
            ("contiguous_gradients", "the contiguous_gradients flag"),
            ("overlap_comm", "the overlap_comm flag"),
            ("_offload_gradient_safety_enabled", "the offload stream-safety flag"),
            ("_record_gradient_stream", "the gradient stream recording"),
            ("_record_bucket_producer", "the bucket producer events"),
            ("reduce_scatter", "the reduce_scatter flag"),
            ("gradient_average", "the gradient averaging flag"),
            ("dp_process_group", "the data-parallel group"),
            ("sequence_parallel_size", "the sequence-parallel size"),
            ("extra_large_param_to_reduce", "the oversized-gradient slots"),
        ):
            require(optimizer, name, f"ZeRO-1/2 {what}")
        for bucket in optimizer.ipg_buckets.values():
            for name in _BUCKET_ATTRS:
                require(bucket, name, "an IPG bucket field")
        import deepspeed.runtime.zero.stage_1_and_2 as stage12
        self._sort_dtypes = require(stage12, "sort_dtypes", "DeepSpeed's bucket dtype order")
        self.zenflow = bool(getattr(optimizer, "zenflow", False))
        self.is_moe_param = is_moe_param
        self._autoep = getattr(optimizer, "_maybe_reduce_autoep_folding_tp_gradient", None)
        accelerator = get_accelerator()
        self.has_streams = not accelerator.resolves_data_dependency()
        self.current_stream = accelerator.current_stream

    def fold_autoep(self, param, grad) -> None:
        if self._autoep is not None:
            self._autoep(param, grad)

    def wait_before_reusing(self, bucket) -> None:
        """DeepSpeed's offload safety: the buffer must not be rewritten before the
        reduction that last read it (recorded per buffer index) has finished."""
        if self.optimizer._offload_gradient_safety_enabled and bucket.index in bucket.reuse_events:
            self.current_stream().wait_event(bucket.reuse_events[bucket.index])

    def sorted_dtypes(self):
        return self._sort_dtypes(self.optimizer.ipg_buckets.keys())  # DeepSpeed's reduction order

    def divides_bucket_before_reduce(self, comm_dtype) -> bool:
        """average_tensor's reduce_scatter path divides the bucket in place first."""
        opt = self.optimizer
        return (opt.reduce_scatter and opt.gradient_average and opt.contiguous_gradients
                and comm_dtype not in opt.extra_large_param_to_reduce and self.average_factor() != 1.0)

    def average_factor(self) -> float:
        opt = self.optimizer
        return float(opt.sequence_parallel_size) / dist.get_world_size(group=opt.dp_process_group)

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
