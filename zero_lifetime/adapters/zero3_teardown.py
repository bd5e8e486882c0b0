"""ZeRO-3 engine teardown: what stock DeepSpeed keeps of an engine after ``destroy()``.

Two module-level holders keep a destroyed ZeRO-3 engine's model, and with it every param's
partition, alive for the rest of the process (0.17.6 to 0.19.8): ``FWD_MODULE_STACK`` in
``parameter_offload``, to which each engine's root module is pushed at setup and never
popped, and the coordinator's release-decision ``lru_cache`` (``maxsize=None``), whose keys
hold the coordinator and the model's submodules. Users who build engine after engine in one
process (a hyperparameter search, a reference model rebuilt per phase) lose that memory per
engine. After an installed engine's ``destroy()`` both let go of it (the cache through
the trace adapter, which owns it); ``release_after_destroy`` does the same for an engine that
is not installed (the benchmark's stock engines).
"""

from typing import Callable

from .errors import require, unrecognised


class DestroyedEngineRelease:
    """Probed at install; ``release(module)`` after DeepSpeed's own ``destroy()``.
    ``drop_decisions``: drops the coordinators' cached release decisions (``zero3_trace``)."""

    def __init__(self, drop_decisions: Callable[[], None]):
        from deepspeed.runtime.zero import parameter_offload
        self._module_stack = require(parameter_offload, "FWD_MODULE_STACK", "ZeRO-3's forward module stack")
        if not isinstance(self._module_stack, list):
            raise unrecognised("ZeRO-3's forward module stack (`parameter_offload.FWD_MODULE_STACK`) is no "
                               "longer a list")
        self._drop_decisions = drop_decisions

    def release(self, root_module) -> None:
        # The one entry this engine's setup pushed (another engine built on the same module
        # pushed its own), by identity, in place: DeepSpeed reads the list as its global.
        for index in range(len(self._module_stack) - 1, -1, -1):
            if self._module_stack[index] is root_module:
                del self._module_stack[index]
                break
        self._drop_decisions()


def release_after_destroy(engine) -> Callable[[], None]:
    """For a ZeRO-3 engine that is not installed: probed before its ``destroy()``, the callable
    returned lets go after it of what stock keeps, as an installed engine's ``destroy()`` does."""
    from .zero3_trace import release_decision_cache
    teardown = DestroyedEngineRelease(release_decision_cache(engine).cache_clear)
    root_module = engine.module
    return lambda: teardown.release(root_module)
