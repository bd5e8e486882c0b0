"""Torch gradient semantics for several backwards before one step, on ZeRO-1/2.

Without ``zero_grad`` between them, torch sums the gradients of two backwards.
DeepSpeed ZeRO-1/2 rebuilds its reduced partitions (``averaged_gradients``) at
every boundary epilogue and so keeps only the last backward. We keep the
partitions of the earlier backwards and add them back after the epilogue: the
reduction is linear, so the sum of reduced partitions is the reduced sum (with CPU
offload the sum lives in the fp32 gradients instead; see the two carry adapters).
(ZeRO-3 accumulates natively once its micro step advances; see EngineBackward.)
"""

from .adapters.errors import require
from .adapters.zero12_epilogue import Zero12EpilogueRule
from .adapters.zero12_offload_carry import Zero12OffloadCarry
from .adapters.zero12_partition_carry import Zero12PartitionCarry


class Zero12Accumulation:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        require(optimizer, "averaged_gradients", "the ZeRO-1/2 reduced gradient partitions")
        require(optimizer, "all_grad_tensors", "the ZeRO-1/2 running gradient sums")
        self._original_epilogue = require(optimizer, "independent_gradient_partition_epilogue",
                                          "the ZeRO-1/2 gradient epilogue")
        offload = bool(getattr(optimizer, "cpu_offload", False))
        # Where the earlier backwards' sum lives: the fp32 gradients with offload, else the partitions.
        self.carry = Zero12OffloadCarry(optimizer) if offload else Zero12PartitionCarry(optimizer)
        self.rule = Zero12EpilogueRule(optimizer)  # 0.17.6: sums micro-steps the 0.18 way
        self.grads_pending = False  # a backward's reduced grads wait for step()
        self._kept = None  # the earlier backwards' sum, taken out of the running backward's way
        optimizer.independent_gradient_partition_epilogue = self._epilogue

    def begin_backward(self) -> None:
        # None also where DeepSpeed's own accumulators sum the backward (offload, GAS > 1).
        self._kept = self.carry.take() if self.grads_pending else None  # take() refuses before any change

    def _epilogue(self, *args, **kwargs):
        with self.rule.around_epilogue():
            result = self._original_epilogue(*args, **kwargs)
        if self._kept is not None:
            self.carry.add_back(self._kept)
            self._kept = None
        self.grads_pending = True
        return result

    def grads_cleared(self) -> None:
        self.grads_pending = False
        self._kept = None

    def backward_died(self) -> None:
        """A backward ended with an exception before its epilogue: it adds nothing.

        What earlier backwards of the step summed stays for the next backward or step(),
        as torch keeps .grad (torch would also keep what the dead backward had reached;
        DeepSpeed's buckets drop that, and so does put_back).
        """
        if self._kept is not None:
            self.carry.put_back(self._kept)
            self._kept = None

    def forget_window(self) -> None:
        """zero_grad() before step(): drop what earlier micro-steps of the window summed.

        ZeRO-1/2 keep a running sum across micro-steps (``all_grad_tensors``) or, with
        fp32 accumulation of 16-bit params, sum into a flat partition buffer in
        ``averaged_gradients``; engine.zero_grad() leaves both, so a micro-step before
        it would still reach step(). The boundary's reduced partitions stay too: a
        step() with no backward after zero_grad() would apply them again (torch: no
        gradient, no update).
        """
        self.grads_cleared()
        running = self.optimizer.all_grad_tensors
        for group in list(running):
            running[group] = None
        for grads in self.optimizer.averaged_gradients.values():
            if grads is None:
                continue
            flat = getattr(grads, "flat_partition", None)  # 0.19.8's compact buffer
            if flat is not None:
                flat.zero_()  # its per-param gradients are views of it
                continue
            for grad in grads:
                if grad is not None:
                    grad.zero_()

    def restore(self) -> None:
        self.optimizer.__dict__.pop("independent_gradient_partition_epilogue", None)
