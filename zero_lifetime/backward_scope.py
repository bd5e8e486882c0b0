"""Detect the start and the end of each backward that runs through the engine.

A "backward" is one autograd graph task. It is entered from the first of our
hooks that fires inside it (a forward-output hook, a pre-AccumulateGrad hook or
a saved-tensor unpack); its end is a callback queued on that same graph task.
Nested graph tasks (reentrant checkpointing) belong to the backward that is
already open. A graph task that raises drops its queued callbacks without calling
them: the dropped callback tells the scope at once that its backward died.
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


class _EndOfTask:
    """The callback queued on the graph task of a backward the scope opened.

    Torch calls it when the task completes, then drops it. A task that raised drops it
    uncalled, before the exception reaches the caller: ``__del__`` then reports the death."""

    __slots__ = ("_scope", "_task", "_called")

    def __init__(self, scope: "BackwardScope", task: int):
        self._scope = scope
        self._task = task
        self._called = False

    def __call__(self) -> None:
        self._called = True
        self._scope._finish()

    def __del__(self) -> None:
        if not self._called:
            self._scope._task_died(self._task)


class BackwardScope:

    def __init__(self, on_start: Callable[[], None], on_end: Callable[[], None],
                 on_died: Callable[[], None]):
        """``on_died()`` runs when the open backward's graph task dies, as torch drops the
        task, if that happens on a Python thread (the caller of backward, before the exception
        reaches it). Dropped on an autograd device thread (CUDA), the caller may already run
        on: the death then waits for ``abandon``."""
        self._on_start = on_start
        self._on_end = on_end
        self._on_died = on_died
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
        torch.autograd.Variable._execution_engine.queue_callback(_EndOfTask(self, task))
        self._on_start()
        return True

    def _task_died(self, task: int) -> None:
        # A stale report (the task was abandoned already, another backward may be open) is
        # ignored. Threads that Python did not start (torch's device threads) are _DummyThread.
        if self.active_task == task and not isinstance(threading.current_thread(), threading._DummyThread):
            self._on_died()

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
