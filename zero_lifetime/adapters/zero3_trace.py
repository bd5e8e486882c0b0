"""ZeRO-3's recorded trace: release decisions that follow the trace DeepSpeed has now.

DeepSpeed decides which params a module releases at each step of its recorded trace in
``__params_to_release(module, step)``, an ``lru_cache`` that nothing clears (0.17.6 to
0.19.8). When the trace is re-recorded, the decisions of the old trace are reused for the same
(module, step) pairs. With two passes over one forward the trace changes whenever the number
of passes does: a first step with one backward, then two backwards every step, leaves the
single pass's "release everything after the backward" in force, and the second backward of
every later step fetches again every param the first one released (twice the fetches, each an
all-gather on several ranks). Clearing the cache right before DeepSpeed completes a new trace
makes its decisions those of that trace.
"""

from ..never_traced import never_traced
from .errors import require, unrecognised
from .zero3_params import parameter_offload

_PARAMS_TO_RELEASE = "_PartitionedParameterCoordinator__params_to_release"


def _release_decision_cache(coordinator_type):
    """The ``lru_cache`` behind ``__params_to_release`` (0.19.8 wraps it in an NVTX range
    function without ``functools.wraps``: the cache is that function's closure cell)."""
    method = require(coordinator_type, _PARAMS_TO_RELEASE, "the coordinator's cached release decisions")
    cells = getattr(method, "__closure__", None) or ()
    for candidate in (method, *(cell.cell_contents for cell in cells)):
        if callable(getattr(candidate, "cache_clear", None)):
            return candidate
    raise unrecognised(f"the coordinator's `{_PARAMS_TO_RELEASE}` is no longer an lru_cache")


def release_decision_cache(engine):
    """The cache of release decisions ``engine``'s coordinator reads (shared by every coordinator:
    its keys hold each coordinator and its model's submodules); ``cache_clear()`` drops them."""
    coordinator = require(parameter_offload(engine), "get_param_coordinator", "the param coordinator accessor")()
    return _release_decision_cache(type(coordinator))


class ReleaseDecisionsFollowTrace:
    """A pre-forward hook on the root module, ahead of DeepSpeed's own (which completes a
    trace being recorded): when a trace is about to complete, drop the cached decisions."""

    def __init__(self, engine):
        self._coordinator = require(parameter_offload(engine), "get_param_coordinator", "the param coordinator accessor")
        coordinator = self._coordinator()
        self._is_recording = require(type(coordinator), "is_record_trace", "the coordinator's trace mode")
        self._cache = _release_decision_cache(type(coordinator))
        self.traces_recorded = 0  # by DeepSpeed, each right after this hook cleared the cache
        # Bookkeeping outside the model's computation: never traced under engine.compile().
        self._handle = engine.module.register_forward_pre_hook(never_traced(self._before_forward),
                                                               prepend=True)

    def _before_forward(self, _module, _inputs) -> None:
        if self._is_recording(self._coordinator()):
            self.drop_decisions()
            self.traces_recorded += 1

    def drop_decisions(self) -> None:
        # Class-wide: other engines' coordinators recompute theirs, from their own traces.
        self._cache.cache_clear()

    def remove(self) -> None:
        self._handle.remove()
