"""DeepSpeed's per-param gradient hooks: how they are made, and where they enter.

``deepspeed.utils.torch.register_grad_hook`` uses ``register_post_accumulate_grad_hook``
on torch >= 2.1. Below that it hooks the param's ``AccumulateGrad`` node without
keeping a reference (dropped in 0.16.3 / 0.16.6); autograd holds that node weakly, so
it dies at once and the hooks never fire: empty IPG buckets (DeepSpeed #7595).

ZeRO-3 leaf modules (``set_z3_leaf_modules``, MoE blocks) get no per-param hooks: one hook
on the module reduces all its params' gradients, zero-filling those that got none (experts
a batch did not use). From 0.18 it is a full backward hook, which fires in every pass
through the module, ``torch.autograd.grad`` included; 0.17.6 hooks the module's inputs at
each forward and reduces once, when the last of them has its gradient.
"""

import deepspeed.runtime.zero.stage3 as stage3_module
import deepspeed.runtime.zero.stage_1_and_2 as stage12_module
import deepspeed.utils.torch as ds_torch_utils

from .errors import require
from .grad_window import gradient_held_back
from .patching import wrap_method

_KEEP_ALIVE_ATTR = "_zero_lifetime_grad_accumulators"  # ours, on the optimizer
# Stages 1-3: puts one param's finished gradient into its reduction bucket (zero12_buckets
# replaces the same method for the fused fill; the name lives here only).
BUCKET_ADD = "reduce_independent_p_g_buckets_and_remove_grads"


def deepspeed_hooks_are_dead() -> bool:
    """True when DeepSpeed registered its hooks on nodes nobody keeps alive."""
    return not ds_torch_utils.required_torch_version(min_version=2.1)


def _was_removed(handle) -> bool:
    # A hook dict that died with its node (torch < 2.1's dead hooks) says nothing: not removed.
    hooks = require(handle, "hooks_dict_ref", "torch's hook handle")()
    return hooks is not None and handle.id not in hooks


class LeafHookGate:
    """DeepSpeed's leaf-module backward hooks, each run only when ``should_run()``;
    ``undo()`` puts DeepSpeed's own back."""

    def __init__(self, handles, should_run):
        self._gated = []  # (hooks dict, handle id, DeepSpeed's hook, ours)
        for handle in handles:
            hooks = handle.hooks_dict_ref()
            original = hooks[handle.id]

            def gated(module, grad_input, grad_output, _original=original):
                if should_run():
                    return _original(module, grad_input, grad_output)
                return None

            # In place, under the same id: the order of the module's hooks and DeepSpeed's
            # handle (destroy() removes it) stay as they were.
            hooks[handle.id] = gated
            self._gated.append((hooks, handle.id, original, gated))

    def undo(self) -> None:
        for hooks, hook_id, original, gated in self._gated:
            if hooks.get(hook_id) is gated:
                hooks[hook_id] = original
        self._gated.clear()


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
            self._leaf_params = require(optimizer, "leaf_parameters", "the ZeRO-3 leaf modules' params")
        else:
            self._groups = require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups")
            self._entry_name = "process_gradients"
            self._create_name = "create_gradient_handling_hooks"
            self._module = stage12_module
        require(optimizer, self._entry_name, "the entry point of DeepSpeed's gradient hooks")
        require(optimizer, BUCKET_ADD, "DeepSpeed's add of a gradient to its reduction bucket")
        require(optimizer, self._create_name, "DeepSpeed's gradient hook creation")
        require(self._module, "register_grad_hook", "DeepSpeed's gradient hook registration")

    def reduces_grads_at_boundary(self) -> bool:
        """True when DeepSpeed made no gradient hooks: ZeRO-1 with contiguous_gradients and
        overlap_comm off (and no fp32 grad accumulation attribute). Its boundary backward's
        epilogue then reduces every managed param's .grad itself (``reduce_gradients``),
        and .grad accumulates across backwards and micro-steps until then."""
        return self.stage != 3 and not self.optimizer._grad_acc_hooks

    def removed_by_destroy(self) -> bool:
        """True when DeepSpeed removed every gradient hook it holds, as its ``destroy()`` does:
        a stock-destroyed engine, whose gradients would reach no bucket."""
        handles = self.optimizer._grad_acc_hooks
        return bool(handles) and all(_was_removed(handle) for handle in handles)

    def managed_params(self):
        return [p for group in self._groups for p in group]

    def leaf_modules(self) -> list:
        """ZeRO-3 leaf modules (set_z3_leaf_modules, or chosen by stage3_module_granularity_threshold)."""
        return list(self._leaf_params) if self.stage == 3 else []

    def leaf_module_params(self) -> list:
        """The params of ZeRO-3 leaf modules, which one hook per module reduces."""
        return [p for params in self._leaf_params.values() for p in params] if self.stage == 3 else []

    def _leaf_backward_hook_handles(self) -> list:
        by_dict = {id(module._backward_hooks) for module in self._leaf_params}
        handles = []
        for handle in self.optimizer._leaf_module_hooks:
            hooks = require(handle, "hooks_dict_ref", "torch's hook handle")()
            if hooks is not None and id(hooks) in by_dict:
                handles.append(handle)
        return handles

    def leaf_reduction_is_per_forward(self) -> bool:
        """True on 0.17.6: a leaf module's gradients are reduced once per forward (the last of
        its inputs' hooks), so a second pass through one forward reduces none of them."""
        return self.stage == 3 and bool(self._leaf_params) and not self._leaf_backward_hook_handles()

    def gate_leaf_module_hooks(self, should_run):
        """Run DeepSpeed's leaf-module backward hooks only when ``should_run()``. Returns the
        gate (``undo()``), or None where there are no such hooks (ZeRO-1/2, no leaf modules,
        0.17.6's per-forward input hooks)."""
        handles = self._leaf_backward_hook_handles() if self.stage == 3 else []
        return LeafHookGate(handles, should_run) if handles else None

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
        """Call ``on_param(param)`` whenever one of DeepSpeed's hooks is called for a param;
        DeepSpeed's hook goes on only where it returns True. Returns the patch (``undo()``)."""

        def entry(original, param, *args, **kwargs):
            if not on_param(param):
                return None
            return original(param, *args, **kwargs)

        return wrap_method(self.optimizer, self._entry_name, entry)

    def wrap_bucket_add(self, on_add):
        """Call ``on_add(param)`` before DeepSpeed adds ``param``'s finished gradient to a
        reduction bucket: not for a tiled-compute shard (its gradient is not finished) nor an
        empty ZeRO-1/2 param (DeepSpeed skips those). Returns the patch (``undo()``)."""
        stage = self.stage

        def add(original, param, *args, **kwargs):
            if not gradient_held_back(param) and (stage == 3 or param.numel() != 0):
                on_add(param)
            return original(param, *args, **kwargs)

        return wrap_method(self.optimizer, BUCKET_ADD, add)
