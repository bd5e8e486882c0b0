"""ZeRO-1/2's epilogue rule for summing micro-steps (stage_1_and_2.py).

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

_BROKEN_RULE = "self.averaged_gradients[i] is None"
_RELEASES_WITH_BROKEN_RULE = ("0.17.6", )
_RUNNING = object()  # stands in for averaged_gradients[i] while a sum runs


class Zero12EpilogueRule:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        require(optimizer, "averaged_gradients", "the ZeRO-1/2 reduced gradient partitions")
        require(optimizer, "all_grad_tensors", "the ZeRO-1/2 running gradient sums")
        self._groups = len(require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups"))
        try:
            source = inspect.getsource(type(optimizer).independent_gradient_partition_epilogue)
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
