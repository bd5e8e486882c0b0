"""DeepSpeed's per-param gradient hooks: how they are made, and where they enter.

``deepspeed.utils.torch.register_grad_hook`` uses ``register_post_accumulate_grad_hook``
on torch >= 2.1. Below that it hooks the param's ``AccumulateGrad`` node without
keeping a reference (dropped in 0.16.3 / 0.16.6); autograd holds that node weakly, so
it dies at once and the hooks never fire: empty IPG buckets (DeepSpeed #7595).
"""

import deepspeed.runtime.zero.stage3 as stage3_module
import deepspeed.runtime.zero.stage_1_and_2 as stage12_module
import deepspeed.utils.torch as ds_torch_utils

from .errors import require
from .patching import wrap_method

_KEEP_ALIVE_ATTR = "_zero_lifetime_grad_accumulators"  # ours, on the optimizer


def deepspeed_hooks_are_dead() -> bool:
    """True when DeepSpeed registered its hooks on nodes nobody keeps alive."""
    return not ds_torch_utils.required_torch_version(min_version=2.1)


class GradHooks:

    def __init__(self, optimizer, stage: int):
        self.optimizer = optimizer
        self.stage = stage
        require(optimizer, "_grad_acc_hooks", "the gradient hook handles")
        if stage == 3:
            self._groups = require(optimizer, "fp16_groups", "the ZeRO-3 param groups")
            self._entry_name = "reduce_ready_partitions_and_remove_grads"
            self._create_name = "create_reduce_and_remove_grad_hooks"
            self._module = stage3_module
            require(optimizer, "_leaf_module_hooks", "the ZeRO-3 leaf-module hook handles")
        else:
            self._groups = require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups")
            self._entry_name = "process_gradients"
            self._create_name = "create_gradient_handling_hooks"
            self._module = stage12_module
        require(optimizer, self._entry_name, "the entry point of DeepSpeed's gradient hooks")
        require(optimizer, self._create_name, "DeepSpeed's gradient hook creation")
        require(self._module, "register_grad_hook", "DeepSpeed's gradient hook registration")

    def managed_params(self):
        return [p for group in self._groups for p in group]

    def recreate(self, register_grad_hook) -> None:
        """Drop DeepSpeed's hooks and let it make them again through ``register_grad_hook``."""
        optimizer = self.optimizer
        for handle in optimizer._grad_acc_hooks:
            handle.remove()
        optimizer._grad_acc_hooks.clear()
        if self.stage == 3:  # made again by the same call
            for handle in optimizer._leaf_module_hooks:
                handle.remove()
            optimizer._leaf_module_hooks.clear()
        original = self._module.register_grad_hook
        self._module.register_grad_hook = register_grad_hook
        try:
            getattr(optimizer, self._create_name)()
        finally:
            self._module.register_grad_hook = original

    def keep_alive(self, node) -> None:
        """Hold a hooked ``AccumulateGrad`` node for as long as the optimizer lives (so the
        hooks outlive uninstall(), as DeepSpeed's fix does)."""
        self.optimizer.__dict__.setdefault(_KEEP_ALIVE_ATTR, []).append(node)

    def wrap_entry(self, on_param):
        """Call ``on_param(param)`` whenever one of DeepSpeed's hooks takes a gradient.
        Returns the patch (``undo()``)."""

        def entry(original, param, *args, **kwargs):
            on_param(param)
            return original(param, *args, **kwargs)

        return wrap_method(self.optimizer, self._entry_name, entry)
