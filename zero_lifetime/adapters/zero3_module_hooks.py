"""ZeRO-3's module hooks, and whether they were registered again since we last looked.

DeepSpeed keeps the handles of the forward hooks that gather a module's params and arm its
backward in ``parameter_offload.forward_hooks`` and ``backward_hooks`` (0.17.6 to 0.19.8).
Code that runs the model gathered without them (TRL's ``unwrap_model_for_generation``, used by
its GRPO, PPO and online-DPO trainers) removes them, empties both lists and registers them
again with ``_register_deepspeed_module``. Torch runs a module's hooks in registration order,
so the new ones then run after every hook registered at install.
"""

from .errors import require, unrecognised
from .patching import Patches
from .zero3_params import parameter_offload

_HOOK_LISTS = ("forward_hooks", "backward_hooks")
# What DeepSpeed's forward hooks of a module call on the offload manager: gather its params
# before, release them after (0.17.6 to 0.19.8).
_FORWARD_FUNCTIONS = ("pre_sub_module_forward_function", "post_sub_module_forward_function")


class DeepSpeedModuleHooks:
    """Probed at install; ``registered_anew()`` says whether DeepSpeed's module hooks were
    registered again since the previous call (or since install)."""

    def __init__(self, engine):
        self._offload = parameter_offload(engine)
        for name in _HOOK_LISTS:
            if not isinstance(require(self._offload, name, "ZeRO-3's module hook handles"), list):
                raise unrecognised(f"ZeRO-3's module hook handles (`parameter_offload.{name}`) are no longer a list")
        for name in _FORWARD_FUNCTIONS:
            require(self._offload, name, "what ZeRO-3's module forward hooks call")
        self._seen = self._now()

    def wrap_forward_functions(self, around) -> Patches:
        """``around(original, module)`` in place of the gather before each module's forward
        and the release after it. Returns the patches (``undo()`` puts them back)."""
        patches = Patches()
        for name in _FORWARD_FUNCTIONS:
            patches.wrap(self._offload, name, around)
        return patches

    def _now(self) -> tuple:
        # The lists themselves are kept, not their id(): a list put in place of a freed one
        # may get its id. The newest handle's id tells lists refilled in place apart
        # (handle ids only grow).
        now = []
        for name in _HOOK_LISTS:
            handles = getattr(self._offload, name)
            now.append((handles, len(handles), getattr(handles[-1], "id", None) if handles else None))
        return tuple(now)

    def registered_anew(self) -> bool:
        now = self._now()
        changed = any(seen[0] is not current[0] or seen[1:] != current[1:] for seen, current in zip(self._seen, now))
        self._seen = now
        return changed
