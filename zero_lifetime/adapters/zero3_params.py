"""ZeRO-3 parameter gather/release: the coordinator and the parameter attributes."""

import torch
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from .errors import require

# 0.19.8 counts, on each param, the GatheredParameters contexts holding it; 0.18.9 and 0.17.6
# record nothing (None): there a context is invisible to us.
_USER_CONTEXT_DEPTH = getattr(partition_parameters, "DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR", None)

# Added to ``param.ds_active_sub_modules`` while a param is pinned: DeepSpeed's
# coordinator never releases a param whose active-module set is non-empty, so the
# pin needs no patch of the release path. Negative, so it never collides with a
# module ds_id (those count up from 0).
PIN_MARK = -7352

# Per-module backward counters set in forward and consumed by the first backward;
# restoring them lets a second backward fetch and release module by module again.
_MODULE_BACKWARD_COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining")

_RELEASE = "_PartitionedParameterCoordinator__release_param"
_INFLIGHT = "_PartitionedParameterCoordinator__inflight_param_registry"


def parameter_offload(engine):
    """ZeRO-3's parameter offload manager (module hooks, param coordinator): the ZeRO-3
    optimizer's ``parameter_offload``, or the engine's optimizer itself where the engine was
    built without an optimizer (DeepSpeed then runs only the manager, DeepSpeedZeRoOffload)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    if isinstance(engine.optimizer, DeepSpeedZeRoOffload):
        return engine.optimizer
    return require(engine.optimizer, "parameter_offload", "the ZeRO-3 parameter offload manager")


def full_numel(param) -> int:
    """The param's size on any stage: a released ZeRO-3 param's .numel() is 0 whatever its size."""
    return param.ds_numel if hasattr(param, "ds_numel") else param.numel()


class Zero3Params:
    """Gather and release single ZeRO-3 params with the coordinator's accounting."""

    AVAILABLE = ZeroParamStatus.AVAILABLE
    INFLIGHT = ZeroParamStatus.INFLIGHT

    def __init__(self, engine):
        self._offload = parameter_offload(engine)
        coordinator = self.coordinator()
        require(type(coordinator), _RELEASE, "the coordinator's single-param release")
        require(coordinator, _INFLIGHT, "the coordinator's in-flight param registry")
        sample = next(iter(engine.module.parameters()))
        for attr in ("ds_id", "ds_status", "ds_tensor", "ds_active_sub_modules", "ds_numel", "all_gather"):
            require(sample, attr, "a ZeRO-3 parameter attribute")

    def keeps_released_leaf_data(self) -> bool:
        """DeepSpeed's "fast sharding" of leaf modules chosen by stage3_module_granularity_threshold:
        at a leaf module's release it sets the data of every param its trace releases to one
        element, even a param that stays in use (one we pinned), and leaves such params
        AVAILABLE."""
        return bool(require(self.coordinator(), "fast_sharding_for_leaf_module",
                            "the coordinator's leaf-module fast sharding flag"))

    def coordinator(self):
        return require(self._offload, "get_param_coordinator", "the param coordinator accessor")()

    def gather(self, param) -> None:
        """Make ``param`` gathered now (a collective: every rank calls it in the same order)."""
        if param.ds_status == self.INFLIGHT:
            registry = getattr(self.coordinator(), _INFLIGHT)
            handle = registry.pop(param, None)
            if handle is not None:
                handle.wait()
            if param.ds_status == self.AVAILABLE:
                return
        if param.ds_status != self.AVAILABLE:
            param.all_gather()

    def release(self, param) -> bool:
        """Release through the coordinator; it skips params still used by an active module."""
        if param.ds_persist or param.ds_status != self.AVAILABLE:
            return False
        getattr(self.coordinator(), _RELEASE)(param)
        return param.ds_status != self.AVAILABLE

    def replace_inference_placeholders(self, params) -> int:
        """DeepSpeed frees a param by swapping in an empty tensor (``free_param``). Made under
        ``torch.inference_mode`` that tensor is an inference tensor, and ``param.data =`` gives
        the param its dispatch keys: autograd no longer sees the param until it is gathered
        again, and a backward over a graph from before that release fails in DeepSpeed's own
        gradient hooks (0.19.8, 0.18.9: ``AttributeError`` in ``count_used_parameters_in_backward``,
        which looks at every param). Each released one gets a normal empty tensor back.
        Returns how many."""
        replaced = 0
        with torch.inference_mode(False):
            for param in params:
                if param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.is_inference():
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                    replaced += 1
        return replaced

    @staticmethod
    def sees_user_contexts() -> bool:
        """Whether this DeepSpeed records which params a GatheredParameters context holds."""
        return _USER_CONTEXT_DEPTH is not None

    @staticmethod
    def in_user_context(param) -> bool:
        """``param`` is inside a user's GatheredParameters context, which partitions it at its
        exit; False where DeepSpeed does not record it (0.18.9, 0.17.6)."""
        return _USER_CONTEXT_DEPTH is not None and getattr(param, _USER_CONTEXT_DEPTH, 0) > 0

    def release_regathered(self, param) -> bool:
        """Release a param we gathered ourselves outside the coordinator (``all_gather``)."""
        if param.ds_persist or param.ds_status != self.AVAILABLE or param.ds_active_sub_modules:
            return False
        param.partition()
        return True

    def _drain_backward_registry(self) -> bool:
        """Release what modules in 0.19.8's registry of modules in backward hold, as its
        epilogue does; False where the release keeps no such registry (0.18.9, 0.17.6)."""
        drain = getattr(self.coordinator(), "release_backward_leftovers", None)
        if drain is None:
            return False
        drain()
        return True

    def release_modules_left_in_backward(self, params) -> None:
        """At the end of a backward: release what modules still hold whose post-backward
        hook never ran (a module whose input needs no grad, or one a torch.autograd.grad did
        not ask for). 0.19.8 keeps a registry of modules in backward and drains it in its
        epilogue, as here; 0.18.9 and 0.17.6 keep none and hold such params until step():
        there each param's module marks go (never a pin) and it is released."""
        if self._drain_backward_registry():
            return
        for param in params:
            held = param.ds_active_sub_modules
            if param.ds_status != self.AVAILABLE or not held or held == {PIN_MARK}:
                continue
            pinned = PIN_MARK in held
            held.clear()
            if pinned:
                held.add(PIN_MARK)
            else:
                self.release(param)

    def release_backward_leftovers(self, params) -> None:
        """After an interrupted backward: modules whose post-backward never ran still hold params."""
        # Without a registry (0.18.9, 0.17.6) clearing each param's active modules suffices.
        self._drain_backward_registry()
        for param in params:
            param.ds_active_sub_modules.clear()
            self.release(param)

    @staticmethod
    def module_counters(modules):
        """The backward counters each module holds right after a forward."""
        # Runs after every forward over every module: no generator per module.
        pre_backward, grads_remaining = _MODULE_BACKWARD_COUNTERS
        return [(m, (d[pre_backward], d.get(grads_remaining))) for m in modules
                if pre_backward in (d := m.__dict__)]

    @staticmethod
    def restore_module_counters(snapshot) -> None:
        for module, values in snapshot:
            for name, value in zip(_MODULE_BACKWARD_COUNTERS, values):
                if value is not None:
                    module.__dict__[name] = value

    @staticmethod
    def pin(param) -> None:
        param.ds_active_sub_modules.add(PIN_MARK)

    @staticmethod
    def unpin(param) -> None:
        param.ds_active_sub_modules.discard(PIN_MARK)


class PinnedParamsStayGathered:
    """A ``GatheredParameters`` context partitions every param it was given as it exits, a
    param a live graph pinned too, and DeepSpeed refuses to free that one ("Cannot free a
    ZeRO-3 parameter while it is still active in submodules"). Each param's ``partition()``
    here leaves pinned params out, so the context leaves them as it found them: gathered.
    After an update (``modifier_rank``) DeepSpeed would copy a param into its partition and
    free it, which a pinned one cannot be: the rest are partitioned, then a clear error names
    the pinned ones, whose update did not reach their partitions."""

    def __init__(self, params, names):
        self._originals = []
        for param in params:
            original = require(param, "partition", "a ZeRO-3 parameter's partition()")
            param.partition = _partition_skipping_pinned(param, original, names)
            self._originals.append((param, original))

    def undo(self) -> None:
        for param, original in self._originals:
            param.partition = original
        self._originals.clear()


class PinnedParamUpdatedError(RuntimeError):
    """GatheredParameters(modifier_rank=...) exited over params a live graph pinned."""


def _partition_skipping_pinned(param, original, names):

    def partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True):
        params = [param] if param_list is None else param_list
        pinned = [p for p in params if PIN_MARK in p.ds_active_sub_modules]
        if not pinned or not free_data:
            return original(param_list=param_list, hierarchy=hierarchy, has_been_updated=has_been_updated,
                            free_data=free_data)
        unpinned = [p for p in params if PIN_MARK not in p.ds_active_sub_modules]
        if unpinned:
            original(param_list=unpinned, hierarchy=hierarchy, has_been_updated=has_been_updated, free_data=free_data)
        if has_been_updated:
            raise PinnedParamUpdatedError(
                f"zero_lifetime: GatheredParameters(modifier_rank=...) ended over {len(pinned)} param(s) that a "
                f"live graph holds under policy \"pin\": {', '.join(names.get(id(p), '?') for p in pinned[:8])}"
                f"{' ...' if len(pinned) > 8 else ''}. Their update stays in the gathered params and did not reach "
                f"DeepSpeed's partitions (which would free data the graph needs). Update them when no graph "
                f"holds them (after its last backward), or use policy \"regather\".")
        return None

    return partition
