"""ZeRO-1/2's gradient epilogue and what it leaves for step() (stage_1_and_2.py).

``independent_gradient_partition_epilogue`` ends every backward: it adds the backward's
reduced gradients to the running sum (``all_grad_tensors``) and, at a boundary, turns
that sum into the reduced partitions step() reads (``averaged_gradients``).

Each epilogue either starts the running sum of reduced gradients
(``all_grad_tensors[i]``) anew or adds to it. 0.18+ decides by the running sum itself.
0.17.6 decides by the boundary's result (``averaged_gradients[i] is None``), which is
the wrong way round: every non-boundary micro-step starts anew, so ZeRO-2 keeps only the
last micro-step's gradients (measured: GAS 2 matches torch trained on the last
micro-batch alone), and a second epilogue in the boundary micro-step adds to a sum the
first one already freed (``TypeError: 'NoneType' object is not iterable``).
``around_epilogue`` gives 0.17.6 the 0.18 rule for the duration of the call.
"""

import contextlib
import inspect

from .errors import deepspeed_version, require
from .grad_window import EPILOGUE
from .patching import InstancePatch, wrap_method

_BROKEN_RULE = "self.averaged_gradients[i] is None"
_RELEASES_WITH_BROKEN_RULE = ("0.17.6", )
_RUNNING = object()  # stands in for averaged_gradients[i] while a sum runs


class Zero12Epilogue:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        require(optimizer, EPILOGUE, "the ZeRO-1/2 gradient epilogue")
        require(optimizer, "averaged_gradients", "the ZeRO-1/2 reduced gradient partitions")
        require(optimizer, "all_grad_tensors", "the ZeRO-1/2 running gradient sums")
        self._groups = len(require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups"))
        try:
            source = inspect.getsource(getattr(type(optimizer), EPILOGUE))
            self.needs_fix = _BROKEN_RULE in source
        except (OSError, TypeError):
            # No source to read (a .pyc-only install): go by the release, never silently
            # leave 0.17.6's accumulation wrong.
            self.needs_fix = deepspeed_version() in _RELEASES_WITH_BROKEN_RULE

    @contextlib.contextmanager
    def around_epilogue(self):
        if not self.needs_fix:
            yield
            return
        averaged, running = self.optimizer.averaged_gradients, self.optimizer.all_grad_tensors
        for i in range(self._groups):
            # Add iff a sum runs (0.18's rule). A boundary result about to be rebuilt is
            # dropped here; Zero12Accumulation carries it over when torch would add.
            averaged[i] = None if running.get(i) is None else _RUNNING
        try:
            yield
        finally:
            for i in range(self._groups):
                if averaged.get(i) is _RUNNING:
                    averaged[i] = None

    def wrap(self, after) -> InstancePatch:
        """The epilogue, under 0.18's rule, then ``after()``; ``undo()`` on the result restores it."""

        def epilogue(original, *args, **kwargs):
            with self.around_epilogue():
                result = original(*args, **kwargs)
            after()
            return result

        return wrap_method(self.optimizer, EPILOGUE, epilogue)

    def forget_reduced(self) -> None:
        """Zero what the epilogues of the window summed, running sum and boundary result alike.

        With fp32 accumulation of 16-bit params the sum lives in a flat partition buffer
        in ``averaged_gradients`` (0.19.8: ``flat_partition``, whose per-param gradients
        are views of it, zeroed once through the buffer).
        """
        running = self.optimizer.all_grad_tensors
        for group in list(running):
            running[group] = None
        for grads in self.optimizer.averaged_gradients.values():
            if grads is None:
                continue
            flat = getattr(grads, "flat_partition", None)
            if flat is not None:
                flat.zero_()
                continue
            for grad in grads:
                if grad is not None:
                    grad.zero_()
