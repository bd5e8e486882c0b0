"""Torch gradient semantics for several backwards before one step, on ZeRO-1/2.

Without ``zero_grad`` between them, torch sums the gradients of two backwards.
DeepSpeed ZeRO-1/2 rebuilds its reduced partitions (``averaged_gradients``) at
every boundary epilogue and so keeps only the last backward. We keep the
partitions of the earlier backwards and add them back after the epilogue: the
reduction is linear, so the sum of reduced partitions is the reduced sum.
(ZeRO-3 accumulates natively once its micro step advances; see EngineBackward.)
"""

from .adapters.errors import require
from .adapters.zero12_epilogue import Zero12EpilogueRule
from .adapters.zero12_offload_carry import Zero12OffloadCarry


class Zero12Accumulation:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        require(optimizer, "averaged_gradients", "the ZeRO-1/2 reduced gradient partitions")
        require(optimizer, "all_grad_tensors", "the ZeRO-1/2 running gradient sums")
        self._original_epilogue = require(optimizer, "independent_gradient_partition_epilogue",
                                          "the ZeRO-1/2 gradient epilogue")
        self.cpu_offload = bool(getattr(optimizer, "cpu_offload", False))
        self.offload_carry = Zero12OffloadCarry(optimizer) if self.cpu_offload else None
        self.rule = Zero12EpilogueRule(optimizer)  # 0.17.6: sums micro-steps the 0.18 way
        self.grads_pending = False  # a backward's reduced grads wait for step()
        self._carry = None  # partitions of earlier backwards, added back after the epilogue
        optimizer.independent_gradient_partition_epilogue = self._epilogue

    def begin_backward(self) -> None:
        if not self.grads_pending:
            self._carry = None
            return
        if self.offload_carry is not None:
            self._carry = self.offload_carry.take()  # refuses what it cannot sum, before any change
            return
        averaged = self.optimizer.averaged_gradients
        self._carry = {
            group: [t.detach().clone() for t in tensors]
            for group, tensors in averaged.items() if tensors is not None
        }

    def _epilogue(self, *args, **kwargs):
        with self.rule.around_epilogue():
            result = self._original_epilogue(*args, **kwargs)
        if self._carry is not None and self.offload_carry is not None:
            self.offload_carry.add_back(self._carry)
            self._carry = None
        if self._carry:
            averaged = self.optimizer.averaged_gradients
            for group, earlier in self._carry.items():
                current = averaged.get(group)
                if current is None:
                    continue
                for now, before in zip(current, earlier):
                    now.add_(before)
            self._carry = None
        self.grads_pending = True
        return result

    def grads_cleared(self) -> None:
        self.grads_pending = False
        self._carry = None

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
                flat.zero_()
            for grad in grads:
                if grad is not None:
                    grad.zero_()

    def restore(self) -> None:
        self.optimizer.__dict__.pop("independent_gradient_partition_epilogue", None)
