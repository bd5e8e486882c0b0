"""Detect the start and the end of each backward that runs through the engine.

A "backward" is one autograd graph task. It is entered from the first of our
hooks that fires inside it (a forward-output hook, a pre-AccumulateGrad hook or
a saved-tensor unpack); its end is a callback queued on that same graph task.
Nested graph tasks (reentrant checkpointing) belong to the backward that is
already open.
"""

import threading
from typing import Callable, Optional

import torch


def current_graph_task() -> int:
    return torch._C._current_graph_task_id()


def run_after_backward(callback: Callable[[], None]) -> None:
    """``callback()`` once the running backward's queued callbacks (DeepSpeed's epilogue
    among them) have run, so an exception it raises leaves their state complete; now where
    no backward runs."""
    if current_graph_task() == -1:
        callback()
    else:
        torch.autograd.Variable._execution_engine.queue_callback(callback)


class BackwardScope:

    def __init__(self, on_start: Callable[[], None], on_end: Callable[[], None]):
        self._on_start = on_start
        self._on_end = on_end
        self._lock = threading.Lock()
        self.active_task: Optional[int] = None

    @property
    def open(self) -> bool:
        return self.active_task is not None

    def enter(self) -> bool:
        """Open a backward for the running graph task; False if one is open or none runs."""
        task = current_graph_task()
        if task == -1:
            return False
        with self._lock:
            if self.active_task is not None:
                return False
            self.active_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._on_start()
        return True

    def _finish(self) -> None:
        try:
            self._on_end()
        finally:
            self.active_task = None

    def abandon(self) -> bool:
        """Close a backward whose graph task died (an exception skips queued callbacks)."""
        if self.active_task is None or current_graph_task() != -1:
            return False
        self._finish()
        return True
