"""The engine's per-backward state: prologue/epilogue hooks and micro-step bookkeeping.

DeepSpeed runs its backward prologue from hooks on the forward outputs
(``OutputBackwardHookManager``) at most once per forward, and queues its epilogue
at most once per "step" (``BackwardHookStateManager``). A second backward over
a retained graph therefore gets neither. These helpers re-arm both.
"""

import torch

from .errors import require

_HOOK_MANAGERS_ATTR = "_backward_hook_managers"


class EngineBackward:

    def __init__(self, engine):
        self.engine = engine
        self.optimizer = engine.optimizer
        require(engine, "_backward_prologue", "the engine backward prologue")
        state = require(self.optimizer, "_backward_hook_state", "the ZeRO backward hook state")
        for name in ("backward_active_depth", "backward_seen_this_step", "post_backward_callback_queued"):
            require(state, name, "a ZeRO backward hook state field")
        require(self.optimizer, "clear_backward_seen_flag", "the ZeRO new-micro-step reset")
        from deepspeed.runtime.utils import OutputBackwardHookManager
        # An instance attribute: probe a fresh manager (construction has no side effects).
        require(OutputBackwardHookManager(lambda: None), "preprocess_done", "the output-hook once flag")
        if not hasattr(torch._C, "_current_graph_task_id"):
            raise RuntimeError("zero_lifetime needs torch._C._current_graph_task_id (torch >= 2.1)")

    @property
    def _state(self):
        return self.optimizer._backward_hook_state

    def backward_finished_since_forward(self) -> bool:
        """A previous backward over the current forward ran to its end."""
        state = self._state
        return state.backward_seen_this_step and state.backward_active_depth == 0

    def start_new_micro_step(self) -> None:
        """What DeepSpeed does at the next forward: reset hook counters, advance the micro step."""
        self.optimizer.clear_backward_seen_flag()

    def clear_reduced_grads(self) -> None:
        """Start the next backward from zero: ZeRO-3 resets its micro step (copy, not add)."""
        self.optimizer.zero_grad()

    @staticmethod
    def output_hook_managers(outputs) -> list:
        """DeepSpeed's hook managers on a forward's outputs (they outlive the tensor objects)."""
        return [manager for tensor in outputs for manager in getattr(tensor, _HOOK_MANAGERS_ATTR, ())]

    @staticmethod
    def rearm_output_hooks(managers) -> None:
        """Let DeepSpeed's output hooks run its prologue again for the next backward."""
        for manager in managers:
            manager.preprocess_done = False

    @staticmethod
    def suppress_output_hooks(managers) -> None:
        """Keep DeepSpeed's prologue from running for a graph task that accumulates nothing."""
        for manager in managers:
            manager.preprocess_done = True

    def run_prologue(self) -> None:
        """DeepSpeed's backward prologue, for backwards that never pass the forward outputs."""
        self.engine._backward_prologue()

    def reset_after_failed_backward(self) -> None:
        """An exception inside backward skipped DeepSpeed's epilogue: leave no backward open."""
        state = self._state
        state.backward_active_depth = 0
        state.post_backward_callback_queued = False
        state.post_backward_callback_graph_task_id = None
        state.remaining_grad_acc_hooks = 0

    def discard_interrupted_reduction(self) -> None:
        """Drop the gradients an interrupted backward left in the reduction buckets.

        Otherwise the next backward adds the same params to a bucket again (ZeRO-3
        asserts on the duplicates) and the failed step's partial gradients leak into it.
        """
        optimizer = self.optimizer
        for bucket in getattr(optimizer, "ipg_buckets", {}).values():
            if hasattr(bucket, "clear_params"):
                bucket.clear_params()
            else:
                bucket.params.clear()
                if hasattr(bucket, "grads"):
                    bucket.grads.clear()
                bucket.elements = 0
        reduced = getattr(optimizer, "params_already_reduced", None)
        if isinstance(reduced, dict):
            for key in reduced:
                reduced[key] = False
        elif isinstance(reduced, list):
            reduced[:] = [False] * len(reduced)
        # Drop param.grad ourselves first: ZeRO-3's zero_grad() calls record_stream on
        # a leftover grad, which fails on the CPU accelerator ("unknown parameter type").
        for param in self.engine.module.parameters():
            param.grad = None
        optimizer.zero_grad()
