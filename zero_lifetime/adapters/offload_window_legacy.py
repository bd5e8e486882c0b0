"""CPU-offload gradient accumulation on DeepSpeed 0.17.6 and 0.18.9, which have no deferred finalizer.

0.17.6 copies an offloaded gradient into the fp32 optimizer buffer as each param is
reduced in the boundary backward, and keeps earlier micro-steps in accumulators:

* ZeRO-2 keeps them in ``accumulated_grads_in_cpu`` but only the first micro-step is
  stored there; later ones add the buffer into the gradient without storing the sum,
  so with GAS >= 3 every middle micro-step is lost (measured, stock).
  ``store_running_sum`` stores it after each non-boundary accumulation.
* A param whose last gradient of the window came before the boundary backward never
  reaches the fp32 buffer (which still holds an older window). ``finalize`` copies its
  accumulator there with DeepSpeed's own norm bookkeeping, as 0.19.8's
  ``_finalize_*offload_gradient_accumulation`` do.

ZeRO-1 needs neither: its boundary reduction takes every param with a gradient
(see ``GradWindowAdapter.patch_stage1_boundary``).
"""

from deepspeed import comm as dist

from .errors import require, unsupported_feature
from .patching import Patches

_Z3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
_ACCUMULATE = "async_accumulate_grad_in_cpu_via_gpu"


class LegacyOffloadWindow:

    def __init__(self, optimizer, stage: int, at_boundary):
        self.optimizer = optimizer
        self.stage = stage
        self._at_boundary = at_boundary
        self._patches = Patches()
        names = {
            2: ("grad_position", "accumulated_grads_in_cpu", "temp_grad_buffer_for_gpu_offload",
                "fp16_master_weights_and_gradients", "use_grad_accum_attribute", "get_param_gradient_attribute",
                "set_norm_for_param_grad_in_gpu", "update_offload_overflow_tracker_for_param_grad",
                "async_inplace_copy_grad_to_fp32_buffer_from_gpu", "gradient_accumulation_steps", _ACCUMULATE),
            3: ("grad_position", _Z3_GRAD_PARTITIONS, "norm_for_param_grads", "fp32_partitioned_groups_flat",
                "_constant_buffered_norm2", "_swappable_optimizer_subgroup", "dp_process_group", "get_param_id"),
        }.get(stage, ())
        for name in names:
            require(optimizer, name, "the ZeRO CPU-offload accumulation")
        if stage == 2:
            self._patch_running_sum()

    # ---- ZeRO-2: store the running sum ---------------------------------------------------

    def _patch_running_sum(self) -> None:
        opt = self.optimizer

        def accumulate(original, param):
            result = original(param)
            if opt.micro_step_id > 0 and not self._at_boundary():
                self._store_running_sum(param)
            return result

        self._patches.wrap(opt, _ACCUMULATE, accumulate)

    def _store_running_sum(self, param) -> None:
        opt = self.optimizer
        param_id = opt.get_param_id(param)
        _, source_offset, _, num_elements = opt.grad_position[param_id]
        grad = opt.get_param_gradient_attribute(param).data.view(-1)
        if opt.fp16_master_weights_and_gradients:  # the accumulator holds this rank's slice only
            grad = grad.narrow(0, source_offset, num_elements)
        opt.accumulated_grads_in_cpu[param_id].data.copy_(grad)

    # ---- the boundary copy for params the boundary backward did not reduce ---------------

    def finalize(self, params) -> None:
        if self.stage == 3:
            self._finalize_stage3(params)
        elif self.stage == 2:
            self._finalize_stage2(params)

    def _finalize_stage2(self, params) -> None:
        opt = self.optimizer
        for param in params:
            param_id = opt.get_param_id(param)
            if param_id not in opt.grad_position or param_id not in opt.accumulated_grads_in_cpu:
                continue  # not in this rank's partition, or never accumulated
            _, source_offset, _, num_elements = opt.grad_position[param_id]
            buffer = opt.temp_grad_buffer_for_gpu_offload.view(-1).narrow(0, 0, param.numel())
            accumulated = opt.accumulated_grads_in_cpu[param_id].view(-1)
            if opt.fp16_master_weights_and_gradients:
                buffer.narrow(0, source_offset, num_elements).copy_(accumulated)
            else:
                buffer.copy_(accumulated)
            restored = buffer.view_as(param).clone()
            if opt.use_grad_accum_attribute:
                param.grad_accum = restored
            else:
                param.grad = restored
            opt.set_norm_for_param_grad_in_gpu(param)
            opt.update_offload_overflow_tracker_for_param_grad(param)
            opt.async_inplace_copy_grad_to_fp32_buffer_from_gpu(param)  # clears the gradient again

    def _finalize_stage3(self, params) -> None:
        opt = self.optimizer
        partitions = getattr(opt, _Z3_GRAD_PARTITIONS)
        rank = dist.get_rank(opt.dp_process_group)
        for param in params:
            grad_buffer = partitions.get(param.ds_id)
            if grad_buffer is None or param.partition_numel() * rank >= param.ds_numel:
                continue  # no gradient yet, or this rank's shard is padding only
            param_id = opt.get_param_id(param)
            group, dest_offset, _ = opt.grad_position[param_id]
            if opt._swappable_optimizer_subgroup(group):
                raise unsupported_feature("NVMe optimizer offload with a param that gets no gradient in the "
                                          "boundary micro-step", "its gradients would be swapped out of order")
            opt.norm_for_param_grads[param_id] = opt._constant_buffered_norm2(grad_buffer)
            fp32_grad = opt.fp32_partitioned_groups_flat[group].grad.narrow(0, dest_offset, grad_buffer.numel())
            fp32_grad.copy_(grad_buffer.float())

    def restore(self) -> None:
        self._patches.undo()
