"""DeepSpeed's per-micro-step gradient accumulators, stage by stage (0.19.8).

Within one gradient-accumulation window DeepSpeed overwrites its accumulators at the
first backward and adds to them afterwards. Two gaps follow, both fixed through the
names probed here:

* a param whose first gradient of the window comes in a later micro-step is *added*
  to what its accumulator held from the previous window;
* with CPU optimizer offload only params that get a gradient in the boundary
  micro-step reach the fp32 optimizer buffers; the others are never updated.
"""

from .errors import require

_Z3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class GradWindowAdapter:

    def __init__(self, optimizer, stage: int):
        self.optimizer = optimizer
        self.stage = stage
        require(optimizer, "micro_step_id", "the ZeRO micro-step counter")
        require(optimizer, "independent_gradient_partition_epilogue", "the ZeRO gradient epilogue")
        require(optimizer, "is_gradient_accumulation_boundary", "the ZeRO accumulation boundary flag")
        if stage == 3:
            require(optimizer, _Z3_GRAD_PARTITIONS, "the ZeRO-3 gradient partitions")
            self.offload = bool(require(optimizer, "offload_optimizer", "the ZeRO-3 optimizer offload flag"))
            if self.offload:
                require(optimizer, "_offload_boundary_param_ids", "the ZeRO-3 offload window's params")
                require(optimizer, "_finalize_offload_gradient_accumulation", "the ZeRO-3 offload finalize")
        else:
            self.offload = bool(require(optimizer, "cpu_offload", "the ZeRO-1/2 CPU offload flag"))
            if self.offload:
                require(optimizer, "accumulated_grads_in_cpu", "the ZeRO-1/2 offload accumulators")
                require(optimizer, "_offload_accumulated_param_ids", "the ZeRO-1/2 offload window's params")
                require(optimizer, "_finalize_cpu_offload_gradient_accumulation", "the ZeRO-1/2 offload finalize")
                require(optimizer, "get_param_id", "the ZeRO-1/2 param ids")
                require(optimizer, "reduce_ready_partitions_and_remove_grads", "the ZeRO-1/2 bucket entry")

    def first_backward_of_window(self) -> bool:
        """Called as a backward starts, before DeepSpeed's hooks advance anything."""
        # Stage 1/2 advance micro_step_id from -1 at the first hook of each backward;
        # stage 3 advances it from 0 at the next forward after a backward.
        return self.optimizer.micro_step_id == (0 if self.stage == 3 else -1)

    def clear_stale_accumulator(self, param) -> None:
        """Zero what ``param``'s accumulator kept from an earlier window."""
        if self.stage == 3:
            partition = getattr(self.optimizer, _Z3_GRAD_PARTITIONS).get(param.ds_id)
            if partition is not None:
                partition.zero_()
        elif self.stage == 2 and self.offload:  # stage 1 never adds to it (see patch_stage1_boundary)
            cpu_grad = self.optimizer.accumulated_grads_in_cpu.get(self.optimizer.get_param_id(param))
            if cpu_grad is not None:
                cpu_grad.zero_()

    def at_boundary(self) -> bool:
        return bool(self.optimizer.is_gradient_accumulation_boundary())

    def finalize_offloaded(self, params) -> None:
        """DeepSpeed's own boundary copy into the fp32 buffers, for ``params`` only."""
        if not params:
            return
        optimizer = self.optimizer
        if self.stage == 3:
            ids_attr, ids = "_offload_boundary_param_ids", {p.ds_id for p in params}
            finalize = optimizer._finalize_offload_gradient_accumulation
        else:
            ids_attr, ids = "_offload_accumulated_param_ids", {optimizer.get_param_id(p) for p in params}
            finalize = optimizer._finalize_cpu_offload_gradient_accumulation
        window_ids = getattr(optimizer, ids_attr)
        # The finalize walks the window's id set; narrow it to the params the boundary
        # backward did not process, then put the whole set back for step().
        setattr(optimizer, ids_attr, window_ids & ids)
        try:
            finalize()
        finally:
            setattr(optimizer, ids_attr, window_ids)
        if self.stage != 3:
            for param in params:  # the finalize restored it from CPU only to copy it
                param.grad = None

    # ---- stage 1 -------------------------------------------------------------------

    def patch_stage1_boundary(self, processed_this_backward):
        """Stage 1 reduces only at the boundary, through the hooks of the boundary
        backward: a param whose gradients came only in earlier micro-steps (kept in
        ``param.grad`` by torch) is never reduced, and with offload the boundary adds the
        previous window's CPU accumulator to gradients torch already summed. Returns an
        undo callable, or None for other stages."""
        optimizer = self.optimizer
        if self.stage != 1:
            return None
        require(optimizer, "reduce_gradients", "the ZeRO-1 boundary reduction")
        require(optimizer, "setup_buckets", "the ZeRO-1/2 bucket setup")
        require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups")
        require(optimizer, "overlap_comm", "the ZeRO overlap_comm flag")
        group_of = {id(p): i for i, group in enumerate(optimizer.bit16_groups) for p in group}
        original_reduce = optimizer.reduce_gradients
        original_setup = optimizer.setup_buckets

        def reduce_gradients(*args, **kwargs):
            # Without overlap_comm DeepSpeed walks every param with a gradient itself.
            if optimizer.overlap_comm:
                for group in optimizer.bit16_groups:
                    for param in group:
                        if param.grad is not None and not processed_this_backward(param):
                            optimizer.reduce_ready_partitions_and_remove_grads(param, group_of[id(param)])
            return original_reduce(*args, **kwargs)

        def setup_buckets(*args, **kwargs):
            result = original_setup(*args, **kwargs)
            if self.offload and optimizer.is_gradient_accumulation_boundary():
                # torch already summed the window in param.grad: copy, do not add the CPU one.
                optimizer.micro_step_id = 0
            return result

        optimizer.reduce_gradients = reduce_gradients
        optimizer.setup_buckets = setup_buckets

        def undo():
            optimizer.__dict__.pop("reduce_gradients", None)
            optimizer.__dict__.pop("setup_buckets", None)

        return undo
