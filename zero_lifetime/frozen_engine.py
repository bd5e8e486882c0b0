"""install() on an engine built without an optimizer (ZeRO-3 or stage 0): a frozen model.

Such an engine (``deepspeed.initialize(model=m, config=...)`` with no optimizer, as TRL and
DeepSpeed-Chat build reward and reference models) on ZeRO-3 only partitions its params:
DeepSpeed runs its parameter offload manager and no ZeRO optimizer, so there are no gradients
to reduce or buckets to fill. Gradients may still flow through it to the model that is trained (a
differentiable reward, a perceptual loss, a frozen discriminator): two backwards over one
forward then failed on the second (``Expected weight to be of same shape as normalized_shape,
but got weight of shape [0]``), DeepSpeed having released the params that its layers saved.

Here the engine's forward (``engine(x)``, or ``engine.module(x)`` and methods of the model)
runs under the tracker's saved-tensor hooks, and each backward through its outputs sets back
DeepSpeed's per-module counters and releases what it gathered again, as for a trained engine
(``Zero3Lifetime``). Its all-gathers copy out in one fused launch each, as a trained engine's
(``Zero3FusedGathers``; on more than one rank). DeepSpeed's hooks on its forward outputs are
removed: they would run a backward prologue that raises without an optimizer, and divide the
gradient by this engine's gradient_accumulation_steps, which the trained engine's backward
divides already.

A stage-0 engine without optimizer (TRL builds its reward and reference models so when the
trained model is on ZeRO-1/2) keeps its params whole: only those output hooks are removed. On
0.18.9 and 0.19.8 a backward through its ``engine(x)`` raised stock in fp32, and in bf16
(DeepSpeed's BF16_Optimizer over a dummy) went through divided by its gradient_accumulation_steps.
"""

import warnings

from .backward_scope import BackwardScope
from .never_traced import never_traced
from .reporting import get_logger
from .tensor_containers import tensors_in

logger = get_logger()


class FrozenEngineInstallation:
    """What install() patched on one ZeRO-3 or stage-0 engine without an optimizer."""

    def __init__(self, engine, policy: str, max_pinned_bytes: int):
        from .adapters.deepcompile import require_no_deepcompile
        from .adapters.engine_backward_hooked import FrozenEngineOutputHooks
        from .adapters.errors import require_supported_version
        from .adapters.patching import Patches

        require_supported_version()
        require_no_deepcompile(engine)
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        self.policy = policy
        self.max_pinned_bytes = max_pinned_bytes
        self._output_hooks = FrozenEngineOutputHooks(engine)
        self._patches = Patches()
        self._failed_backwards = 0
        self.scope = BackwardScope(self._on_backward_start, self._on_backward_end, self._on_backward_died)
        self.tracker = self.lifetime = self.trace = self.teardown = self.module_hooks = self.fused_gathers = None
        try:
            if self.stage == 3:
                self._install_lifetime(engine, policy, max_pinned_bytes)
            self._patches.apply(engine, "forward", self._forward)
            self._patches.apply(engine, "destroy", self._destroy)
        except BaseException:
            self.restore()  # never leave an engine half-patched
            raise

    def _install_lifetime(self, engine, policy, max_pinned_bytes) -> None:
        from .adapters.zero3_module_hooks import DeepSpeedModuleHooks
        from .adapters.zero3_teardown import DestroyedEngineRelease
        from .adapters.zero3_trace import ReleaseDecisionsFollowTrace
        from .hooks_after_deepspeed import HooksAfterDeepSpeed
        from .selective_checkpoint import keep_module_hooks_outside
        from .tracker import make_tracker
        from .zero3_fused import Zero3FusedGathers
        from .zero3_lifetime import Zero3Lifetime

        deepspeed_module_hooks = DeepSpeedModuleHooks(engine)
        self.module_hooks = HooksAfterDeepSpeed(engine.module, deepspeed_module_hooks)
        selective_checkpoint_patches = keep_module_hooks_outside(deepspeed_module_hooks)
        if selective_checkpoint_patches is not None:
            self._patches.keep(selective_checkpoint_patches)
        self.tracker = make_tracker(policy, max_pinned_bytes)
        self.fused_gathers = Zero3FusedGathers(list(engine.module.parameters()))
        self.lifetime = Zero3Lifetime(engine, self.tracker, self.module_hooks)
        self.trace = ReleaseDecisionsFollowTrace(engine)
        self.teardown = DestroyedEngineRelease(self.trace.drop_decisions)
        # Bookkeeping with side effects: never traced under engine.compile().
        self.module_hooks.forward_hook(engine.module, never_traced(self._on_root_forward))

    def restore(self) -> None:
        """Undo everything installed, in reverse order; safe on a partial install."""
        self._patches.undo()
        if self.fused_gathers is not None:
            self.fused_gathers.uninstall()
        if self.module_hooks is not None:
            self.module_hooks.remove()
        if self.trace is not None:
            self.trace.remove()
        if self.lifetime is not None:
            self.lifetime.release_everything_held()
            self.lifetime.remove_hooks()
        if self.tracker is not None:
            self.tracker.unregister_all()

    # ---- engine method wrappers ----------------------------------------------------------

    def _forward(self, original):

        def forward(*args, **kwargs):
            if self.lifetime is None:  # stage 0: params whole, nothing to keep
                output = original(*args, **kwargs)
            else:
                self.recover_if_backward_died()
                self.module_hooks.keep_after_deepspeeds()  # before the root's hooks run
                output = self.lifetime.run_forward(original, *args, **kwargs)
            self._output_hooks.remove(list(tensors_in(output)))
            return output

        return forward

    def _destroy(self, original):
        from .install import destroy_uninstalling  # install imports this module
        return destroy_uninstalling(self.engine, self.teardown, original)

    # ---- backward detection ----------------------------------------------------------------

    def _on_root_forward(self, module, inputs, output):
        self.lifetime.after_forward()
        for tensor in tensors_in(output):
            if tensor.grad_fn is not None:
                tensor.register_hook(self._on_output_grad)
        return None

    def _on_output_grad(self, grad):
        if not self.scope.open:
            self.scope.enter()
        return None

    def _on_backward_start(self) -> None:
        self.lifetime.replace_inference_placeholders()
        self.lifetime.backward_started()

    def _on_backward_end(self) -> None:
        self.lifetime.backward_ended()

    def _on_backward_died(self) -> None:
        self.recover_if_backward_died()

    def recover_if_backward_died(self) -> None:
        """An exception inside a backward skips its end callback: clean up as torch drops its
        task, or else at the next forward."""
        if not self.scope.abandon():
            return
        self._failed_backwards += 1
        self.lifetime.backward_died()
        logger.warning("zero_lifetime: a backward ended with an exception; released what it held")

    # ---- stats -----------------------------------------------------------------------------

    def stats(self) -> dict:
        result = {"stage": self.stage, "policy": self.policy, "without_optimizer": True,
                  "failed_backwards": self._failed_backwards}
        if self.lifetime is not None:
            result.update(self.lifetime.stats())
            result.update(self.fused_gathers.counts)
            result["traces_recorded"] = self.trace.traces_recorded
        return result


def params_requiring_grad(model) -> tuple:
    """(how many of ``model``'s params require grad, the bytes of their full gradients)."""
    from .adapters.zero3_params import full_numel
    params = [param for param in model.parameters() if param.requires_grad]
    return len(params), sum(full_numel(param) * param.element_size() for param in params)


def warn_if_params_require_grad(model, zero_stage: int) -> None:
    """Such an engine has nothing to reduce, step or free gradients with, so a param of it that
    requires grad gets its full gradient in ``.grad`` on every rank (under ZeRO-3, beside an
    empty partition): a reward model loaded as is costs a full-size gradient per rank, silently."""
    count, nbytes = params_requiring_grad(model)
    if count:
        warnings.warn(
            f"zero_lifetime: {count} params of this engine without optimizer require grad: a backward "
            f"through it writes each one's full gradient to .grad on every rank ({_readable(nbytes)}"
            f"{', unpartitioned under ZeRO-3' if zero_stage == 3 else ''}), which nothing reduces, applies "
            "or frees. If the model is frozen, call engine.module.requires_grad_(False) before the first "
            "backward; if it is trained, build its engine with an optimizer.",
            RuntimeWarning, stacklevel=3)


def _readable(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"
