"""The hooked backward protocol (DeepSpeed 0.19.8 and 0.18.9): prologue/epilogue hooks, micro steps.

DeepSpeed runs its backward prologue from hooks on the forward outputs
(``OutputBackwardHookManager``) at most once per forward, and queues its epilogue
at most once per "step" (``BackwardHookStateManager``). A second backward over
a retained graph therefore gets neither. These helpers re-arm both.
"""

from .engine_backward import EngineBackwardBase
from .errors import require
from .patching import wrap_method

_HOOK_MANAGERS_ATTR = "_backward_hook_managers"

# engine.backward calls of installed engines running on 0.18.9 that divided their loss by
# gradient_accumulation_steps (every engine's output hooks then stand aside, as 0.19.8's
# _ENGINE_BACKWARD_GRAPH_TRACKER has it). Global, not per thread: autograd runs hooks on its
# device threads.
_divided_loss_backwards = 0


class HookedEngineBackward(EngineBackwardBase):

    # DeepSpeed runs its own prologue and epilogue for a plain loss.backward().
    supports_torch_style_backward = True

    def __init__(self, engine):
        super().__init__(engine)
        require(engine, "_backward_prologue", "the engine backward prologue")
        state = require(self.optimizer, "_backward_hook_state", "the ZeRO backward hook state")
        for name in ("backward_active_depth", "backward_seen_this_step", "epilogue_ran_this_backward",
                     "post_backward_callback_queued"):
            require(state, name, "a ZeRO backward hook state field")
        require(self.optimizer, "clear_backward_seen_flag", "the ZeRO new-micro-step reset")
        require(engine, "_running_engine_backward", "the engine's own-backward flag")
        require(engine, "_backward_prologue_per_tensor", "the engine's output-gradient division")
        from deepspeed.runtime import engine as engine_module
        # 0.19.8 marks the graph of each engine.backward (its loss divided); 0.18.9 does not.
        self._engine_graphs = getattr(engine_module, "_ENGINE_BACKWARD_GRAPH_TRACKER", None)
        if self._engine_graphs is not None:
            require(self._engine_graphs, "is_current_graph_registered", "the engine-backward graph marks")
        else:
            require(engine, "_scale_wrt_gas", "the engine.backward scale_wrt_gas flag of the output hooks")
        from deepspeed.runtime.utils import OutputBackwardHookManager
        # An instance attribute: probe a fresh manager (construction has no side effects).
        probe = OutputBackwardHookManager(lambda: None)
        require(probe, "preprocess_done", "the output-hook once flag")
        require(probe, "preprocess_per_tensor_fn", "the output-hook per-tensor gradient scaling")
        require(probe, "hook_handles", "the output-hook handles")

    def engine_backward(self, original, loss, *args, **kwargs):
        """0.19.8's engine.backward divides the loss by gradient_accumulation_steps. 0.18.9's
        leaves that to the hooks engine.forward puts on its outputs, so over a forward that
        bypassed it (``engine.module(x)``, ``torch.func.functional_call``, a method of the
        model) nothing was divided: GAS times torch's gradient, silently; so was a gradient
        penalty's double-backward path. Here 0.18.9 divides the loss as 0.19.8 does."""
        if self._engine_graphs is not None:
            return original(loss, *args, **kwargs)
        return self._engine_backward_dividing_the_loss(original, loss, *args, **kwargs)

    def _engine_backward_dividing_the_loss(self, original, loss, retain_graph=False, scale_wrt_gas=True):
        """Every installed engine's output hooks stand aside while it runs. 0.18.9 also keeps
        the last call's ``scale_wrt_gas`` for later plain backwards (after one
        ``scale_wrt_gas=False``, as the transformers Trainer passes, a later ``loss.backward()``
        went undivided): reset to the default after each call."""
        global _divided_loss_backwards
        gas = self.engine.gradient_accumulation_steps()
        try:
            if not scale_wrt_gas or gas == 1:
                return original(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
            _divided_loss_backwards += 1
            try:
                # Told not to scale, stock returns the loss it was given: the divided one, as it
                # returns when it scales.
                return original(loss / gas, retain_graph=retain_graph, scale_wrt_gas=False)
            finally:
                _divided_loss_backwards -= 1
        finally:
            self.engine._scale_wrt_gas = True

    @property
    def _state(self):
        return self.optimizer._backward_hook_state

    def backward_finished_since_forward(self) -> bool:
        """A previous backward over the current forward ran to its end: its prologue marked it
        seen, or its epilogue ran (ZeRO-3 marks that). engine.forward resets both. A forward
        that bypasses it (``engine.module(x)``) resets neither, and engine.backward over it runs
        DeepSpeed's epilogue but no prologue: only the epilogue's mark says a backward ended
        (and then stock ZeRO-3 never advances its micro step, so each backward overwrote the
        one before: two retained backwards, or micro-steps of an accumulation window)."""
        state = self._state
        return state.backward_active_depth == 0 and (state.backward_seen_this_step or state.epilogue_ran_this_backward)

    def note_forward(self) -> None:
        """DeepSpeed itself resets its per-forward state (clear_backward_seen_flag)."""

    def check_backward_entry(self) -> None:
        """Every way into a backward is supported."""

    def start_new_micro_step(self) -> None:
        """What DeepSpeed does at the next forward: reset hook counters, advance the micro step."""
        self.optimizer.clear_backward_seen_flag()

    @staticmethod
    def output_hook_managers(outputs) -> list:
        """DeepSpeed's hook managers on a forward's outputs (they outlive the tensor objects),
        each once (a tensor returned twice lists its managers twice)."""
        managers = {id(manager): manager for tensor in outputs for manager in getattr(tensor, _HOOK_MANAGERS_ATTR, ())}
        return list(managers.values())

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

    @staticmethod
    def scale_outputs_only_when(managers, should_scale, on_divided) -> None:
        """DeepSpeed's output hooks divide each output's gradient by gradient_accumulation_steps
        in every pass through them, so a torch.autograd.grad through the outputs (an input
        gradient, a gradient penalty's inner gradient, GradNorm) returned gradients divided
        by it. The division runs only when ``should_scale()`` (a pass that accumulates .grad);
        ``on_divided()`` is called each time it did divide."""
        def in_a_pass_to_divide():
            return should_scale() and _divided_loss_backwards == 0

        for manager in managers:
            scale = manager.preprocess_per_tensor_fn
            if scale is not None:
                manager.preprocess_per_tensor_fn = _scaling_only_when(scale, in_a_pass_to_divide, on_divided)

    @staticmethod
    def output_hooks(managers) -> "OutputHooks":
        """DeepSpeed's hooks on one forward's outputs, to be moved onto views of them."""
        return OutputHooks(managers)

    def run_prologue(self) -> None:
        """DeepSpeed's backward prologue, for backwards that never pass the forward outputs."""
        self.engine._backward_prologue()

    def engine_backward_running(self) -> bool:
        """Is DeepSpeed's own backward running? This engine's backward (called by anyone, a
        pipeline schedule's included) or a pipeline stage's backward of its outputs, and on
        0.19.8 any engine's backward (it marks the graph, whose loss it divided), on 0.18.9 any
        installed engine's (``engine_backward``). Those divide by gradient_accumulation_steps
        as they mean to."""
        if self.engine._running_engine_backward or _divided_loss_backwards:
            return True
        return self._engine_graphs is not None and self._engine_graphs.is_current_graph_registered()

    def prologue_pending(self) -> bool:
        """Has no DeepSpeed prologue opened the running backward?"""
        return self._state.backward_active_depth == 0

    def note_output_hooks_ran(self, on_ran):
        """``on_ran()`` each time one of the hooks engine.forward puts on its outputs handles a
        gradient (dividing it by gradient_accumulation_steps, unless DeepSpeed decides the loss
        was divided already). The function is looked up on the engine at each forward, so
        forwards from now on are seen. Returns the patch (``undo()``)."""

        def per_output(original, grad):
            on_ran()
            return original(grad)

        return wrap_method(self.engine, "_backward_prologue_per_tensor", per_output)

    def reset_after_failed_backward(self) -> None:
        """An exception inside backward skipped DeepSpeed's epilogue: leave no backward open."""
        state = self._state
        state.backward_active_depth = 0
        state.post_backward_callback_queued = False
        state.post_backward_callback_graph_task_id = None
        state.remaining_grad_acc_hooks = 0
        # 0.18.9's engine.backward() sets this flag around loss.backward() without a
        # finally: left set by a dead one, every later loss.backward() skips DeepSpeed's
        # epilogue and reduces nothing (step() then fails). 0.19.8 counts and resets it itself.
        engine = self.engine
        if getattr(engine, "_running_engine_backward", False) and not hasattr(engine, "_running_engine_backward_count"):
            engine._running_engine_backward = False

    def restore(self) -> None:
        """Nothing patched."""


def _scaling_only_when(scale, should_scale, on_divided):

    def scale_if_accumulating(grad):
        if not should_scale():
            return grad
        scaled = scale(grad)
        # DeepSpeed hands the gradient itself back when it does not divide: 0.19.8 inside
        # engine.backward(loss), which divided the loss already; 0.18.9 with scale_wrt_gas=False.
        if scaled is not grad:
            on_divided()
        return scaled

    return scale_if_accumulating


class OutputHooks:
    """DeepSpeed's per-output hooks of one forward (each divides the gradient arriving at its
    output by gradient_accumulation_steps), grouped by the tensor they are registered on.

    On ZeRO-1/2 the outputs are the model's own tensors, so when one output is computed from
    another (a transformers model's ``loss`` from its ``logits``), the gradient that already
    passed the first output's hook passes the second's too: divided by GAS twice (DeepSpeed
    #7718). Moved onto a view that the model's own computation never used, each hook divides
    only what arrives from outside the forward."""

    def __init__(self, managers):
        self._waiting = {}  # id(tensor hook dict): [(manager, index in its handles, hook id)]
        for manager in managers:
            for index, handle in enumerate(manager.hook_handles):
                hooks = require(handle, "hooks_dict_ref", "torch's hook handle")()
                if hooks is not None and handle.id in hooks:
                    self._waiting.setdefault(id(hooks), []).append((manager, index, handle.id))
        self._registered = self.left_behind()

    def registered(self) -> int:
        """DeepSpeed's hooks on the outputs, moved or not."""
        return self._registered

    def left_behind(self) -> int:
        """DeepSpeed's hooks not moved onto a view."""
        return sum(len(waiting) for waiting in self._waiting.values())

    def on(self, tensor) -> bool:
        """Has ``tensor`` a DeepSpeed hook not yet moved?"""
        hooks = tensor._backward_hooks
        return hooks is not None and bool(self._waiting.get(id(hooks)))

    def move_one(self, tensor, view) -> None:
        """Move one of ``tensor``'s DeepSpeed hooks (one per place the tensor has in the output,
        as DeepSpeed registers them) to ``view``, and DeepSpeed's record of its hook managers
        with it (which it keeps on the first output, to keep them alive)."""
        hooks = tensor._backward_hooks
        manager, index, hook_id = self._waiting[id(hooks)].pop(0)
        hook = hooks.pop(hook_id)
        manager.hook_handles[index] = view.register_hook(hook)
        managers = getattr(tensor, _HOOK_MANAGERS_ATTR, None)
        if managers is not None:
            setattr(view, _HOOK_MANAGERS_ATTR, managers)


class FrozenEngineOutputHooks:
    """DeepSpeed's hooks on the forward outputs of an engine built without an optimizer (0.19.8
    and 0.18.9 register them on every engine; 0.17.6 none). Their prologue raises in a plain
    backward ("Direct calls to tensor.backward() are not supported", there being no ZeRO
    optimizer), and they would divide the gradient by that engine's
    gradient_accumulation_steps, which the trained engine's backward has divided already.
    Such an engine computes a function of its input: removed, nothing of DeepSpeed's backward
    runs at its outputs."""

    def __init__(self, engine):
        self._hooked = hasattr(engine, "_backward_prologue_per_tensor")  # 0.18.9 and 0.19.8
        if self._hooked:
            from deepspeed.runtime.utils import OutputBackwardHookManager
            require(OutputBackwardHookManager(lambda: None), "hook_handles", "the output-hook handles")

    def remove(self, outputs) -> None:
        """Remove DeepSpeed's hooks from ``outputs`` (one forward's tensors)."""
        if not self._hooked:
            return
        for manager in HookedEngineBackward.output_hook_managers(outputs):
            for handle in manager.hook_handles:
                handle.remove()
            manager.hook_handles.clear()
