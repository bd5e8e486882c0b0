"""ZeRO-3 forwards that bypass the engine: ``engine.module(x)``, or a method of the model (or a
submodule) called directly.

DeepSpeed's module hooks gather and release each module's params however the module is
called, but the engine's forward is where install puts the lifetime tracker's saved-tensor
hooks. Without them a second backward over such a forward found its saved params released
(stock and installed: ``The size of tensor a (0) must match ...``). Here the outermost module
of such a forward pushes the same hooks as it starts, and a one-shot forward hook on it pops
them as it returns, also when it raises (only that module gets one: a hook on every module
would break graphs under engine.compile() in every forward).

Not inside another pair of saved-tensor hooks: a checkpointed region's (what it saves is its
own, as under the engine's forward), or the user's activation offloading around the call (it
keeps what is saved, params too, as stock: the two cannot be told apart cheaply, and
``engine(x)`` chains with the user's instead). Nor inside a backward (a checkpoint's
recomputation).
"""

import torch

from .never_traced import never_traced
from .outer_saved_tensor_hooks import hooks_in_force

_NOT_PUSHED = object()  # a forward runs, under saved-tensor hooks that are not ours


class BypassingForwards:

    def __init__(self, saved_tensors_hooks, engine_call_running, on_started, on_returned):
        """``saved_tensors_hooks()``: the tracker's context; ``engine_call_running()``: the
        engine's forward or a backward runs; ``on_started()``, ``on_returned(module)``: such a
        forward's outermost module starts, and returns (after DeepSpeed's hooks of it)."""
        self._saved_tensors_hooks = saved_tensors_hooks
        self._engine_call_running = engine_call_running
        self._on_started = on_started
        self._on_returned = on_returned
        self._running = None  # the pushed hooks, or _NOT_PUSHED, while such a forward runs

    def before_module_forward(self, module) -> None:
        """Every module's pre-forward hook, after DeepSpeed's (its params are gathered)."""
        if self._running is not None or self._engine_call_running() or torch._C._current_graph_task_id() != -1:
            return
        self._on_started()
        if hooks_in_force() is None:
            hooks = self._saved_tensors_hooks()
            hooks.__enter__()
            self._running = hooks
        else:
            self._running = _NOT_PUSHED
        handle = None

        def returned(_module, _inputs, _output):
            handle.remove()
            hooks, self._running = self._running, None
            if hooks is not _NOT_PUSHED:
                hooks.__exit__(None, None, None)
            self._on_returned(module)

        handle = module.register_forward_hook(never_traced(returned), always_call=True)
