"""ZeRO-1/2's readied IPG buffers (stage_1_and_2.py of DeepSpeed 0.19.8, 0.18.9 and 0.17.6).

At a backward's first gradient stage 1/2 ready their reduction buffers and advance the micro
step (``ready_for_gradients``); the epilogue releases them (``_release_ipg_buffers``), on
ZeRO-1 at GAS > 1 only at the window's closing micro-step.
"""

from .errors import require


class Zero12ReadyBuffers:

    def __init__(self, optimizer):
        require(optimizer, "ready_for_gradients", "the ZeRO-1/2 backward-started flag")
        require(optimizer, "_release_ipg_buffers", "the ZeRO-1/2 end-of-backward buffer release")
        self._optimizer = optimizer

    def ready(self) -> bool:
        return bool(self._optimizer.ready_for_gradients)

    def release(self) -> None:
        """What the epilogue does: the buffers go and the next backward readies them again."""
        self._optimizer._release_ipg_buffers()
