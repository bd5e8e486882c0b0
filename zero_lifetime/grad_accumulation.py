"""Torch gradient semantics for several backwards before one step, on ZeRO-1/2.

Without ``zero_grad`` between them, torch sums the gradients of two backwards.
DeepSpeed ZeRO-1/2 rebuilds its reduced partitions (``averaged_gradients``) at
every boundary epilogue and so keeps only the last backward. We keep the
partitions of the earlier backwards and add them back after the epilogue: the
reduction is linear, so the sum of reduced partitions is the reduced sum (with CPU
offload the sum lives in the fp32 gradients instead; see the two carry adapters).
(ZeRO-3 accumulates natively once its micro step advances; see EngineBackward. So do
0.19.8's ZeRO-1/2 groups kept in a flat fp32 partition: the carries leave those alone.)
"""

from .adapters.zero12_epilogue import Zero12Epilogue
from .adapters.zero12_partition_carry import carry_for

class Zero12Accumulation:

    def __init__(self, optimizer):
        # Where the earlier backwards' sum lives: the fp32 gradients with offload, else the partitions.
        self.carry = carry_for(optimizer)
        self.epilogue = Zero12Epilogue(optimizer)  # 0.17.6: sums micro-steps the 0.18 way
        self.grads_pending = False  # a backward's reduced grads wait for step()
        self._kept = None  # the earlier backwards' sum, taken out of the running backward's way
        self._epilogue_patch = self.epilogue.wrap(after=self._after_epilogue)

    def begin_backward(self, reached) -> None:
        """``reached(param)``: did ``param`` get a gradient in this window before this backward?"""
        # None also where DeepSpeed's own accumulators sum the backward (offload, GAS > 1).
        self._kept = self.carry.take(reached) if self.grads_pending else None  # take() refuses before any change

    def _after_epilogue(self) -> None:
        if self._kept is not None:
            self.carry.add_back(self._kept)
            self._kept = None
        self.grads_pending = True

    def grads_cleared(self, step_skipped: bool = False) -> None:
        """step() took the window's gradients; ``step_skipped``: at the boundary, without an
        update (an fp16 overflow)."""
        self.grads_pending = False
        self._kept = None
        self.carry.step_done(step_skipped)

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

        engine.zero_grad() leaves ZeRO-1/2's running sum and the boundary's reduced
        partitions: a micro-step before it would still reach step(), and a step() with no
        backward after it would apply them again (torch: no gradient, no update).
        """
        self.carry.discard()
        self.grads_cleared()
        self.epilogue.forget_reduced()

    def restore(self) -> None:
        self._epilogue_patch.undo()
        self.carry.restore()
