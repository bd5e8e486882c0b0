"""ZeRO-1/2 with CPU optimizer offload: summing several backwards before one step().

With offload, the boundary backward copies each reduced gradient into the fp32
partition's ``.grad`` on the CPU, overwriting it, and records its norm for clipping in
``norm_for_param_grads``. Earlier micro-steps reach it through DeepSpeed's CPU
accumulators, which a backward fills only when it is not the window's lone boundary
micro-step (``micro_step_id`` > 0 or not the boundary). So after such a lone backward a
second one overwrites it (stock: the first is lost; from the third on, the previous one is
re-added as if it were a micro-step).

``take`` keeps the fp32 gradients there, zeroes them and restarts the micro-step count, so
the next backward writes its own gradients alone; ``add_back`` adds the kept ones and
recomputes the norms of the sums; ``put_back`` undoes ``take`` when that backward dies.
After any other backward the accumulators already sum the next one on ZeRO-2 with 0.19.8
(measured against torch; not 0.17.6 or 0.18.9, which have no deferred finalizer: refused there,
and on 0.18.9 measured off torch with the refusal bypassed).
ZeRO-1 reduces in the boundary micro-step only, and its counter stays at 0 there, so each
of its boundary backwards is a lone one.

Groups that 0.19.8 accumulates in a flat fp32 partition (``groups_summing_backwards``) are
left alone: the boundary copies that partition's running sum into the fp32 gradients.
"""

from deepspeed.accelerator import get_accelerator

from .errors import deepspeed_version, require
from .grad_window import INITIAL_MICRO_STEP_ID_12, ZERO12_OFFLOAD_FINALIZER, at_boundary
from .zero12_partition_carry import groups_summing_backwards


class _Kept:
    """What ``take`` moved out of the optimizer's way."""

    __slots__ = ("grads", "norms", "micro_step_id")

    def __init__(self, grads, norms, micro_step_id):
        self.grads = grads
        self.norms = norms
        self.micro_step_id = micro_step_id


class Zero12OffloadCarry:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        require(optimizer, "single_partition_of_fp32_groups", "the ZeRO-1/2 fp32 partitions")
        require(optimizer, "grad_position", "the offloaded gradients' places in the fp32 buffers")
        require(optimizer, "norm_for_param_grads", "the offloaded gradients' norms")
        require(optimizer, "micro_step_id", "the ZeRO micro-step counter")
        require(optimizer, "params_in_partition", "the ZeRO-1/2 params of this rank's partitions")
        require(optimizer, "get_param_id", "the ZeRO-1/2 param ids")
        self.gradient_accumulation_steps = int(require(
            optimizer, "gradient_accumulation_steps", "the ZeRO-1/2 gradient accumulation steps"))
        self.stage = 2 if require(optimizer, "partition_gradients", "the ZeRO-1/2 stage flag") else 1
        # 0.19.8 (with its deferred offload finalizer) sums a further backward of a micro-step
        # in its accumulators; 0.17.6 and 0.18.9 do not (measured against torch).
        self.accumulators_sum_backwards = hasattr(optimizer, ZERO12_OFFLOAD_FINALIZER)
        require(optimizer, "is_gradient_accumulation_boundary", "the ZeRO accumulation boundary flag")
        self._summed_by_deepspeed = groups_summing_backwards(optimizer)

    def _fp32_grads(self):
        return [partition.grad for partition in self.optimizer.single_partition_of_fp32_groups]

    def take(self, reached):
        """Before another backward of the same step: what the fp32 gradients hold for the
        params ``reached(param)`` says got a gradient in this window (the others' places hold
        a gradient of an earlier step, which the backward about to run must not add to)."""
        opt = self.optimizer
        if len(self._summed_by_deepspeed) == len(opt.single_partition_of_fp32_groups):
            return None
        # The backward before this one (micro_step_id moves on only when this one starts).
        lone = opt.micro_step_id <= 0 and at_boundary(opt)
        if not lone and self.stage == 2 and self.accumulators_sum_backwards:
            return None  # DeepSpeed's micro-step accumulators sum this backward too
        if self.stage == 2 and not self.accumulators_sum_backwards and self.gradient_accumulation_steps > 1:
            raise NotImplementedError(
                "zero_lifetime: a second backward without zero_grad() before step() is not supported "
                "with ZeRO-2 CPU optimizer offload and gradient_accumulation_steps > 1 on DeepSpeed "
                f"{deepspeed_version()}: its offload accumulators keep one backward per micro-step. "
                "Call engine.zero_grad() between the backwards, sum the losses, or use DeepSpeed 0.19.8.")
        if not lone:
            # ZeRO-1 keeps micro_step_id at 0 in 0.17.6 and 0.19.8; what a release that
            # advances it would do to the earlier backward is unknown, so refuse it.
            raise NotImplementedError(
                "zero_lifetime: a second backward without zero_grad() before step() is not supported "
                f"with ZeRO-1 CPU optimizer offload when DeepSpeed's micro-step counter ({opt.micro_step_id}) "
                "has advanced in the boundary micro-step. Call engine.zero_grad() between the backwards "
                "or sum the losses.")
        get_accelerator().synchronize()  # the offload copies are asynchronous on a GPU
        kept = _Kept([], dict(opt.norm_for_param_grads), opt.micro_step_id)
        for group, grad in enumerate(self._fp32_grads()):
            if grad is None or group in self._summed_by_deepspeed:
                kept.grads.append(None)
                continue
            kept.grads.append(grad.clone())
            grad.zero_()  # a param the next backward does not reach keeps the kept sum only
        self._drop_unreached(kept.grads, reached)
        opt.micro_step_id = INITIAL_MICRO_STEP_ID_12
        return kept

    def _drop_unreached(self, grads, reached) -> None:
        """Zero the places of params with no gradient in this window: DeepSpeed overwrites a
        place only when its param gets one, so they hold an earlier step's (measured: a param
        first reached by the second backward of a step was stepped with g(t-1) + g(t))."""
        opt = self.optimizer
        for group, params in enumerate(opt.params_in_partition):
            if grads[group] is None:
                continue
            for param in params:
                if reached(param):
                    continue
                position = opt.grad_position.get(opt.get_param_id(param))
                if position is not None:
                    _, _, dest_offset, num_elements = position
                    grads[group].view(-1).narrow(0, dest_offset, num_elements).zero_()

    def add_back(self, kept) -> None:
        """After that backward's epilogue: the sums, and their norms for clipping."""
        opt = self.optimizer
        get_accelerator().synchronize()
        grads = self._fp32_grads()
        for grad, earlier in zip(grads, kept.grads):
            if grad is not None and earlier is not None:
                grad.add_(earlier)
        for param_id, norm in list(opt.norm_for_param_grads.items()):
            group, _, dest_offset, num_elements = opt.grad_position[param_id]
            summed = grads[group].view(-1).narrow(0, dest_offset, num_elements)
            opt.norm_for_param_grads[param_id] = summed.to(norm.dtype).norm(2)

    def put_back(self, kept) -> None:
        """That backward died before its epilogue: the state ``take`` found, as it was.

        Overwritten, not added to: whatever the dead backward reduced is dropped, as
        DeepSpeed's buckets drop what it left in them.
        """
        opt = self.optimizer
        get_accelerator().synchronize()
        for grad, earlier in zip(self._fp32_grads(), kept.grads):
            if grad is not None and earlier is not None:
                grad.copy_(earlier)
        opt.norm_for_param_grads.clear()
        opt.norm_for_param_grads.update(kept.norms)
        opt.micro_step_id = kept.micro_step_id

    def holds_reduced_gradients(self) -> bool:
        """install() refuses an engine whose offloaded gradients wait for step() (grad_window)."""
        return False

    def step_done(self, skipped: bool = False) -> None:
        """Nothing kept past step(): the fp32 gradients are DeepSpeed's own (and with offload Muon
        runs inside step(), which an overflow skips whole)."""

    def discard(self) -> None:
        """zero_grad() zeroes the fp32 gradients the sum lives in."""

    def restore(self) -> None:
        """No method patched."""
