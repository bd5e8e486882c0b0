"""DeepSpeed's per-micro-step gradient accumulators, stage by stage (0.19.8 and 0.17.6).

Within one gradient-accumulation window DeepSpeed overwrites its accumulators at the
first backward and adds to them afterwards. Three gaps follow, all fixed through the
names probed here:

* a param whose first gradient of the window comes in a later micro-step is *added*
  to what its accumulator held from the previous window;
* with CPU optimizer offload only params that get a gradient in the boundary
  micro-step reach the fp32 optimizer buffers; the others are never updated;
* a param that gets no gradient in a window keeps what its stores held from an
  earlier one, and step() applies that again (ZeRO-3, and ZeRO-1/2 with offload).

0.19.8 defers the offload boundary copy to ``_finalize_*offload_gradient_accumulation``
over a window id set, which is reused here. 0.17.6 and 0.18.9 have no such finalizer (they copy per
param as each is reduced): ``offload_window_legacy`` does that copy there.
"""

from .errors import require, unsupported_feature
from .patching import InstancePatch, Patches, wrap_method
from .zero12_ready_buffers import Zero12ReadyBuffers

EPILOGUE = "independent_gradient_partition_epilogue"  # ends every backward, stages 1-3
INITIAL_MICRO_STEP_ID_12 = -1  # what ZeRO-1/2's step() resets micro_step_id to
# ZeRO-1/2's deferred boundary copy of offloaded gradients (0.19.8; 0.17.6 has none).
ZERO12_OFFLOAD_FINALIZER = "_finalize_cpu_offload_gradient_accumulation"
_Z3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
# DeepSpeed's tiled compute (TiledMLP, TiledFusedLogitsLoss) backwards a module shard by shard,
# each shard a backward of its own, and sets this False on the module's params until the last
# shard: DeepSpeed's hooks then leave the summing gradient in .grad and reduce it whole at the
# last. Absent means ready, as DeepSpeed reads it.
_GRAD_READY_FLAG = "ds_grad_is_ready"


def gradient_held_back(param) -> bool:
    """Will DeepSpeed leave this gradient in ``param.grad`` for a later backward to reduce?"""
    return not getattr(param, _GRAD_READY_FLAG, True)


def after_epilogue(optimizer, callback) -> InstancePatch:
    """``callback()`` after each of DeepSpeed's gradient epilogues returns (it reduces what the
    buckets still hold and marks every param unreduced again); ``undo()`` on the result puts
    back what was there before."""

    def epilogue(original, *args, **kwargs):
        result = original(*args, **kwargs)
        callback()
        return result

    return wrap_method(optimizer, EPILOGUE, epilogue)


def bucket_setup_method(optimizer) -> str:
    """The ZeRO-1/2 method that allocates the IPG buckets and advances the micro step, once per
    backward: ``setup_buckets`` (0.18.9, 0.19.8) or ``backward_prologue`` (0.17.6)."""
    return "setup_buckets" if hasattr(optimizer, "setup_buckets") else "backward_prologue"


def gradients_left_for_step(optimizer, stage: int) -> bool:
    """Optimizer offload: did a backward leave gradients for a step() still to come, in stores
    that install's micro-step window clears as stale at the first step?"""
    if not require(optimizer, "offload_optimizer" if stage == 3 else "cpu_offload", "the optimizer offload flag"):
        # ZeRO-3 without offload has no such record: its reduced gradients are also set by the
        # epilogue stock runs for a torch.autograd.grad (README, Known limitations).
        return False
    # Recorded as each offloaded gradient is copied out; step() resets the record.
    return bool(require(optimizer, "norm_for_param_grads", "the offloaded gradients' norms"))


def zero3_gradients_wait_for_step(optimizer) -> bool:
    """ZeRO-3 without offload: did a backward end (DeepSpeed's epilogue) since the last step()
    or the optimizer's zero_grad() (which step() runs)? Its gradients then wait in the partitions
    for the next step(). (A stock engine.zero_grad() resets neither record read here; with
    offload, see gradients_left_for_step.)"""
    if require(optimizer, "offload_optimizer", "the ZeRO-3 optimizer offload flag"):
        return False
    if require(optimizer, "micro_step_id", "the ZeRO micro-step counter") > 0:
        return True
    # 0.18.9 and 0.19.8 advance the micro step only at the next forward (0.17.6: in the epilogue).
    if hasattr(optimizer, "clear_backward_seen_flag"):
        return bool(require(optimizer, "_epilogue_ran_this_backward", "the ZeRO-3 backward-ended flag"))
    return False


def at_boundary(optimizer) -> bool:
    """Is the current micro-step the window's last? (ZeRO-1/2 and 3)"""
    # A method in 0.19.8; a plain attribute the engine sets before each backward in 0.17.6.
    flag = optimizer.is_gradient_accumulation_boundary
    return bool(flag() if callable(flag) else flag)


class GradWindowAdapter:

    def __init__(self, optimizer, stage: int):
        self.optimizer = optimizer
        self.stage = stage
        require(optimizer, "micro_step_id", "the ZeRO micro-step counter")
        require(optimizer, EPILOGUE, "the ZeRO gradient epilogue")
        require(optimizer, "is_gradient_accumulation_boundary", "the ZeRO accumulation boundary flag")
        if stage == 3:
            require(optimizer, _Z3_GRAD_PARTITIONS, "the ZeRO-3 gradient partitions")
            self.offload = bool(require(optimizer, "offload_optimizer", "the ZeRO-3 optimizer offload flag"))
            if not self.offload:
                require(optimizer, "averaged_gradients", "the ZeRO-3 gradients step() reads")
                require(optimizer, "fp16_groups", "the ZeRO-3 param groups")
            self._finalizer = ("_offload_boundary_param_ids", "_finalize_offload_gradient_accumulation")
        else:
            self._ready_buffers = Zero12ReadyBuffers(optimizer)
            self.offload = bool(require(optimizer, "cpu_offload", "the ZeRO-1/2 CPU offload flag"))
            self._finalizer = ("_offload_accumulated_param_ids", ZERO12_OFFLOAD_FINALIZER)
            if self.offload:
                require(optimizer, "accumulated_grads_in_cpu", "the ZeRO-1/2 offload accumulators")
                require(optimizer, "get_param_id", "the ZeRO-1/2 param ids")
                require(optimizer, "reduce_ready_partitions_and_remove_grads", "the ZeRO-1/2 bucket entry")
                require(optimizer, "single_partition_of_fp32_groups", "the ZeRO-1/2 fp32 partitions")
                require(optimizer, "local_overflow", "the ZeRO-1/2 offload overflow flag")
        if self.offload:
            require(optimizer, "grad_position", "the offloaded gradients' places in the fp32 buffers")
            require(optimizer, "norm_for_param_grads", "the offloaded gradients' norms")
            if stage == 3:
                require(optimizer, "fp32_partitioned_groups_flat", "the ZeRO-3 fp32 partitions")
                require(optimizer, "_swappable_optimizer_subgroup", "the ZeRO-3 NVMe subgroup test")
                require(optimizer, "get_param_id", "the ZeRO-3 param ids")
        # The deferred boundary copy (0.19.8); 0.17.6 has neither name.
        self.can_finalize = hasattr(optimizer, self._finalizer[1])
        self._legacy = None
        if self.offload and self.can_finalize:
            require(optimizer, self._finalizer[0], "the offload window's param ids")
        elif self.offload:
            from .offload_window_legacy import LegacyOffloadWindow
            self._legacy = LegacyOffloadWindow(optimizer, stage, self.at_boundary)
        # Stage 1/2 allocate their buckets and advance the micro step here, once per backward.
        self._setup_buckets = bucket_setup_method(optimizer)

    def wrap_epilogue(self, around) -> InstancePatch:
        """``around(original, *args, **kwargs)`` runs in place of the epilogue (of whatever
        wrapped it before); ``undo()`` on the result puts that back."""
        return wrap_method(self.optimizer, EPILOGUE, around)

    @property
    def epilogue_drops_frozen_gradients(self) -> bool:
        """ZeRO-3 without offload: the epilogue hands step() zeros (``averaged_gradients``) for
        every param that does not require grad as it runs, whatever its partition holds."""
        return self.stage == 3 and not self.offload

    def keep_gradients_of_frozen(self, params) -> None:
        """After the epilogue: step() reads what ``params`` (frozen now, with gradients from
        earlier backwards of the window) hold in their partitions, as torch's step() applies
        the .grad of a frozen param."""
        partitions = getattr(self.optimizer, _Z3_GRAD_PARTITIONS)
        wanted = {id(p) for p in params}
        averaged = self.optimizer.averaged_gradients  # {sub-group index: one entry per param}
        for group_index, group in enumerate(self.optimizer.fp16_groups):
            for index, param in enumerate(group):
                if id(param) in wanted and param.ds_id in partitions and group_index in averaged:
                    averaged[group_index][index] = partitions[param.ds_id]

    def first_backward_of_window(self) -> bool:
        """Called as a backward starts, before DeepSpeed's hooks advance anything."""
        # Stage 1/2 advance micro_step_id from -1 at the first hook of each backward;
        # stage 3 advances it from 0 at the next forward after a backward.
        return self.optimizer.micro_step_id == (0 if self.stage == 3 else -1)

    gradient_held_back = staticmethod(gradient_held_back)

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

    @property
    def keeps_gradients_across_windows(self) -> bool:
        """Does any store step() reads outlive a window? (ZeRO-1/2 rebuild theirs.)"""
        return self.stage == 3 or self.offload

    def forget_window(self) -> None:
        """zero_grad() before step(): reset what step() resets, so the next backward
        starts a window (copies into the accumulators instead of adding)."""
        if self.stage != 3:  # ZeRO-3's own zero_grad() resets its micro step
            self.optimizer.micro_step_id = INITIAL_MICRO_STEP_ID_12
            if self._ready_buffers.ready():
                # ZeRO-1 readies its buckets once a window and releases them only at the closing
                # epilogue: left ready, the next backward would not advance the micro step, and
                # every backward of the window would look like its first (whose window record
                # starts empty: with offload, step() then zeroed the earlier micro-steps' params).
                self._ready_buffers.release()
            if self.offload:
                # Set by any offloaded fp16 gradient that was not finite; step() would skip
                # on it although zero_grad() dropped that gradient (ZeRO-3 checks at step()).
                self.optimizer.local_overflow = False
        if self.offload and self.can_finalize:
            setattr(self.optimizer, self._finalizer[0], set())

    def discard_gradients(self, params) -> None:
        """Zero every reduced gradient of ``params`` that step() would read.

        For params with no gradient since the last step() or zero_grad(): DeepSpeed
        leaves their stores as an earlier window wrote them.
        """
        optimizer = self.optimizer
        if self.offload:
            # Each param's id and place in the fp32 buffers (None: not in this rank's partition).
            param_ids = [optimizer.get_param_id(param) for param in params]
            located = [(param, param_id, optimizer.grad_position.get(param_id))
                       for param, param_id in zip(params, param_ids)]
            if self.stage == 3:
                self._refuse_swapped(located)
        if self.stage == 3:
            partitions = getattr(optimizer, _Z3_GRAD_PARTITIONS)
            for param in params:
                partition = partitions.get(param.ds_id)
                if partition is not None:
                    partition.zero_()
        if not self.offload:
            return
        window_ids = getattr(optimizer, self._finalizer[0]) if self.can_finalize else set()
        for param, param_id, position in located:
            if self.stage != 3:
                accumulated = optimizer.accumulated_grads_in_cpu.get(param_id)
                if accumulated is not None:
                    accumulated.zero_()
            optimizer.norm_for_param_grads.pop(param_id, None)
            window_ids.discard(param.ds_id if self.stage == 3 else param_id)
            if position is None:
                continue
            if self.stage == 3:
                group, offset, numel = position
                fp32_grad = optimizer.fp32_partitioned_groups_flat[group].grad
            else:
                group, _, offset, numel = position
                fp32_grad = optimizer.single_partition_of_fp32_groups[group].grad
            if fp32_grad is not None:
                fp32_grad.view(-1).narrow(0, offset, numel).zero_()

    def _refuse_swapped(self, located) -> None:
        """Before anything is cleared, so a refusal leaves every store as step() would find it."""
        for _, _, position in located:
            if position is not None and self.optimizer._swappable_optimizer_subgroup(position[0]):
                raise unsupported_feature(
                    "NVMe optimizer offload with a param that got a gradient in an earlier step "
                    "and none in this one", "its stale gradient is swapped out to NVMe, where "
                    "zero_lifetime cannot clear it")

    def at_boundary(self) -> bool:
        return at_boundary(self.optimizer)

    def finalize_offloaded(self, params) -> None:
        """DeepSpeed's own boundary copy into the fp32 buffers, for ``params`` only."""
        if not params:
            return
        optimizer = self.optimizer
        if self._legacy is not None:
            self._legacy.finalize(params)
            return
        ids_attr, finalize = self._finalizer[0], getattr(optimizer, self._finalizer[1])
        if self.stage == 3:
            ids = {p.ds_id for p in params}
        else:
            ids = {optimizer.get_param_id(p) for p in params}
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
        ``param.grad`` by torch, or moved into ``param.grad_accum`` where DeepSpeed accumulates
        in another dtype) is never reduced, and with offload the boundary adds the previous
        window's CPU accumulator to gradients torch already summed. Returns an undo callable,
        or None for other stages."""
        optimizer = self.optimizer
        if self.stage != 1:
            return None
        require(optimizer, "reduce_gradients", "the ZeRO-1 boundary reduction")
        require(optimizer, self._setup_buckets, "the ZeRO-1/2 bucket setup")
        require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups")
        require(optimizer, "overlap_comm", "the ZeRO overlap_comm flag")
        require(optimizer, "reduce_ready_partitions_and_remove_grads", "the ZeRO-1/2 bucket entry")
        window_sum = require(optimizer, "get_gradient_for_reduction", "the ZeRO-1/2 gradient accessor")
        group_of = {id(p): i for i, group in enumerate(optimizer.bit16_groups) for p in group}

        def reduce_gradients(original, *args, **kwargs):
            # Without overlap_comm DeepSpeed walks every param with a gradient itself.
            if optimizer.overlap_comm:
                for group in optimizer.bit16_groups:
                    for param in group:
                        if window_sum(param) is not None and not processed_this_backward(param):
                            optimizer.reduce_ready_partitions_and_remove_grads(param, group_of[id(param)])
            return original(*args, **kwargs)

        def setup_buckets(original, *args, **kwargs):
            result = original(*args, **kwargs)
            if self.offload and self.at_boundary():
                # torch already summed the window in param.grad: copy, do not add the CPU one.
                optimizer.micro_step_id = 0
            return result

        patches = Patches()
        patches.wrap(optimizer, "reduce_gradients", reduce_gradients)
        patches.wrap(optimizer, self._setup_buckets, setup_buckets)
        return patches.undo

    def restore(self) -> None:
        if self._legacy is not None:
            self._legacy.restore()
