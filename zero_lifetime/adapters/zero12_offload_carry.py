"""ZeRO-1/2 with CPU optimizer offload: summing several backwards before one step().

With offload, the boundary backward copies each reduced gradient into the fp32
partition's ``.grad`` on the CPU, overwriting it, and records its norm for clipping in
``norm_for_param_grads``. A second backward before step() would overwrite the first (or,
from its second on, add DeepSpeed's saved copy of the previous backward only, as if they
were micro-steps). ``take`` keeps the fp32 gradients, zeroes them and restarts
DeepSpeed's micro-step count, so the next backward writes its own gradients alone;
``add_back`` adds the kept ones and recomputes the norms of the sums.

With several micro-steps per step the count also drives DeepSpeed's own accumulation of
the earlier micro-steps, so it cannot be restarted: refused there.
"""

from deepspeed.accelerator import get_accelerator

from .errors import require

_INITIAL_MICRO_STEP_ID = -1  # what ZeRO-1/2's step() resets micro_step_id to


class Zero12OffloadCarry:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        require(optimizer, "single_partition_of_fp32_groups", "the ZeRO-1/2 fp32 partitions")
        require(optimizer, "grad_position", "the offloaded gradients' places in the fp32 buffers")
        require(optimizer, "norm_for_param_grads", "the offloaded gradients' norms")
        require(optimizer, "micro_step_id", "the ZeRO micro-step counter")
        self.gradient_accumulation_steps = int(require(
            optimizer, "gradient_accumulation_steps", "the ZeRO-1/2 gradient accumulation steps"))

    def _fp32_grads(self):
        return [partition.grad for partition in self.optimizer.single_partition_of_fp32_groups]

    def take(self):
        """Before another backward of the same step: what the fp32 gradients hold."""
        if self.gradient_accumulation_steps != 1:
            raise NotImplementedError(
                "zero_lifetime: a second backward without zero_grad() before step() is not supported "
                "with ZeRO-1/2 CPU optimizer offload and gradient_accumulation_steps > 1 "
                f"(here {self.gradient_accumulation_steps}): DeepSpeed's offload accumulation would "
                "lose or repeat gradients. Call engine.zero_grad() between the backwards, sum the "
                "losses, or use gradient_accumulation_steps 1.")
        get_accelerator().synchronize()  # the offload copies are asynchronous on a GPU
        kept = []
        for grad in self._fp32_grads():
            kept.append(None if grad is None else grad.clone())
            if grad is not None:
                grad.zero_()  # a param the next backward does not reach keeps the kept sum only
        self.optimizer.micro_step_id = _INITIAL_MICRO_STEP_ID
        return kept

    def add_back(self, kept) -> None:
        """After that backward's epilogue: the sums, and their norms for clipping."""
        opt = self.optimizer
        get_accelerator().synchronize()
        grads = self._fp32_grads()
        for grad, earlier in zip(grads, kept):
            if grad is not None and earlier is not None:
                grad.add_(earlier)
        for param_id, norm in list(opt.norm_for_param_grads.items()):
            group, _, dest_offset, num_elements = opt.grad_position[param_id]
            summed = grads[group].view(-1).narrow(0, dest_offset, num_elements)
            opt.norm_for_param_grads[param_id] = summed.to(norm.dtype).norm(2)
