"""install(engine) / uninstall(engine) / stats(engine): the public entry points."""

import contextlib
import threading
import warnings
import weakref
from typing import Optional

import torch

from . import config, module_zero_grad
from .adapters.engine_boundary import boundary_set_by_hand
from .adapters.engine_config import raw_config
from .adapters.errors import UnsupportedDeepSpeedError, require_supported_version
from .adapters.patching import Patches
from .adapters.grad_window import gradients_left_for_step, zero3_gradients_wait_for_step
from .adapters.zero_optimizer import runs_without_optimizer
from .backward_scope import BackwardScope
from .chained_engines import ChainedInputs, OutputDivision
from .embedding_max_norm import warn_if_renormalizing_embeddings
from .frozen_engine import FrozenEngineInstallation, warn_if_params_require_grad
from .integrations.accelerate_steps import (HINT as ACCELERATE_STEP_NOTE, add_hint_if_stale_graph,
                                           step_called_by_accelerate_backward)
from .never_traced import never_traced
from .reporting import StatsReporter, get_logger
from .output_views import OutputViews
from .plain_backward import PlainBackwardCheck
from .tensor_containers import tensors_in

logger = get_logger()

POLICIES = config.POLICIES
_ATTR = "_zero_lifetime_installation"
_DESTROYED = "_zero_lifetime_destroyed"  # set by an installed engine's destroy()
_install_lock = threading.Lock()

BACKWARD_BEFORE_INSTALL_MESSAGE = (
    "zero_lifetime.install: a backward ran since the last step() and its gradients wait for the next; "
    "installed now, they would be cleared at that step as stale (ZeRO-3, and ZeRO-1/2 with optimizer "
    "offload, keep earlier steps' gradients in the same stores). Call install() before the first "
    "backward, or right after a step().")
DESTROYED_MESSAGE = ("zero_lifetime.install: this engine was destroyed (engine.destroy()) and cannot train any "
                     "more; build a new one with deepspeed.initialize")
SEMANTICS_NOTE = ("zero_lifetime: gradients now follow torch semantics: two backwards with zero_grad() "
                  "between them give the second loss's gradients; without it they give the sum.")


def mark_destroyed(engine) -> None:
    """Set by an installed engine's destroy(): install() refuses the engine from then on."""
    object.__setattr__(engine, _DESTROYED, True)


def destroy_uninstalling(engine, teardown, original):
    """An installed engine's destroy(): release what we hold and unpatch before DeepSpeed tears
    its optimizer down (``original``), then refuse the engine from then on. ``teardown`` (ZeRO-3)
    releases what stock keeps of the engine after it."""

    def destroy(*args, **kwargs):
        uninstall(engine)
        try:
            return original(*args, **kwargs)
        finally:
            mark_destroyed(engine)
            if teardown is not None:
                teardown.release(engine.module)

    return destroy


def _check_engine(engine):
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except ImportError as exc:  # pragma: no cover - deepspeed is a dependency
        raise ImportError("zero_lifetime.install needs DeepSpeed installed") from exc
    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(f"zero_lifetime.install expects a deepspeed.runtime.engine.DeepSpeedEngine "
                        f"(what deepspeed.initialize returns), got {type(engine).__module__}."
                        f"{type(engine).__qualname__}")


class StepWithoutBackwardError(TypeError):
    """step() with no backward since the previous step() (or since install), where DeepSpeed
    fails on the missing gradients, or (optimizer offload) would step on zeroed ones. A
    TypeError, as DeepSpeed's own failure there mostly is."""


_STEP_WITHOUT_BACKWARD = (
    "zero_lifetime: step() with no backward since the previous step() (or since install): "
    "DeepSpeed has no gradients to step with (torch would leave the weights as they are). "
    "Skip step() for a batch whose backward you skip.")


class Installation:
    """What install() patched on one engine, and the state it keeps."""

    def __init__(self, engine, policy: str, max_pinned_bytes: int, check_bucket_order: bool = True):
        from .adapters.deepcompile import require_no_deepcompile
        from .adapters.engine_backward import make_engine_backward
        from .adapters.grad_hooks import GradHooks
        from .adapters.zero3_params import full_numel
        from .adapters.zero_optimizer import require_zero1_accumulation_it_reduces_right, require_zero_optimizer

        require_supported_version()
        self.engine = engine
        self.policy = policy
        self.max_pinned_bytes = max_pinned_bytes
        self.stage = int(engine.zero_optimization_stage())
        if self.stage not in (1, 2, 3):
            raise ValueError(f"zero_lifetime supports ZeRO stages 1, 2 and 3; this engine runs stage {self.stage} "
                             "with an optimizer (one built without, a frozen model, is installed on stage 0 too)")
        require_zero_optimizer(engine, self.stage)
        require_zero1_accumulation_it_reduces_right(engine, self.stage)
        require_no_deepcompile(engine)
        boundary_set_by_hand(engine)  # probed: read after every step()
        self._grad_hooks = GradHooks(engine.optimizer, self.stage)
        if self._grad_hooks.removed_by_destroy():  # stock destroy(), before install
            raise RuntimeError(DESTROYED_MESSAGE)
        if gradients_left_for_step(engine.optimizer, self.stage):
            raise RuntimeError(BACKWARD_BEFORE_INSTALL_MESSAGE)
        self.backward = None
        self.scope = BackwardScope(self._on_backward_start, self._on_backward_end, self._on_backward_died)
        self._engine_calls = 0  # engine forward/backward calls running (nested ones counted)
        # Not zero-size params: no values to reduce or apply (0.19.8 leaves them out of its
        # optimizer, older releases' hooks skip them), nothing to gather or clear.
        self._trainable = [p for p in engine.module.parameters() if p.requires_grad and full_numel(p) != 0]
        self._accumulating = False  # the running backward writes .grad (not autograd.grad)
        self._forwards_running = 0
        # Params given a gradient by a backward DeepSpeed does not count as one (inside this
        # engine's forward, or a tiled-compute shard after it), for the next backward.
        self._gradients_before_backward = {}
        # Params whose tiled-compute shards ran outside the engine's calls and whose last
        # shard (the one that makes their gradient ready) has not come yet.
        self._shards_pending = set()
        self._latest_forward = _ForwardOutputs()
        self._latest_output_hook = self._make_output_hook(self._latest_forward)  # its outputs' hook
        # Forwards whose outputs may still be backpropagated through (pruned as their hook
        # managers die): a backward over several of them must run DeepSpeed's prologue once.
        self._live_forwards = []
        self._entered_via_outputs = False
        self._entry_forward = None  # the forward whose output opened the backward being opened
        self._failed_backwards = 0
        # Read only when DeepSpeed's step() fails: a backward before install leaves DeepSpeed
        # gradients to step with, so a failure on the missing ones still means none since.
        self._backward_since_step = False
        # A backward's gradients wait in DeepSpeed's stores: since then no optimizer step() or clear.
        self._gradients_held = False
        self._own_clears = 0  # the optimizer's step(), its epilogue or our clears running: a zero_grad() there is theirs
        self._stepped_by_accelerate_backward = False  # the latest step(): a stale graph's error says so
        self._patches = Patches()  # the engine's methods, wrapped
        self._handles = []
        self.tracker = None
        self.grad_guard = self.lifetime = self.fused = self.trace = self.teardown = None
        self.accumulation = self.bucket_fill = self.window = None
        self.zero1_sums = None  # ZeRO-1: the window's sums in param.grad survive a dead backward
        self.module_hooks = None  # ours that run after DeepSpeed's, kept so when it registers its own again
        self.trl_fused_head = None  # ZeRO-3: TRL's fused LM head, told that saved params come back gathered
        self.chained = None  # undoes this engine's output division on engine outputs it is fed
        self.output_views = None  # divides each output's gradient once, not once per output it passes
        self.plain_backward = None  # a loss.backward() over a forward that bypassed engine(...)
        try:
            self.backward = make_engine_backward(engine)
            self._install_components(engine, policy, max_pinned_bytes, check_bucket_order)
        except BaseException:
            self.restore()  # never leave an engine half-patched
            raise

    def _install_components(self, engine, policy, max_pinned_bytes, check_bucket_order) -> None:
        from .adapters.zero3_module_hooks import DeepSpeedModuleHooks
        from .grad_hook_guard import GradHookGuard
        from .hooks_after_deepspeed import HooksAfterDeepSpeed
        from .micro_step_window import MicroStepWindow
        from .tracker import make_tracker

        self.grad_guard = GradHookGuard(engine, self._grad_hooks)  # refuses unmanaged params first
        # A torch.autograd.grad (scope open, nothing accumulating) reduces nothing.
        self.grad_guard.run_leaf_hooks_only_when(self._pass_accumulates)
        deepspeed_module_hooks = DeepSpeedModuleHooks(engine) if self.stage == 3 else None
        self.module_hooks = HooksAfterDeepSpeed(engine.module, deepspeed_module_hooks)  # ZeRO-1/2 register none
        if self.stage == 3:
            from .selective_checkpoint import keep_module_hooks_outside
            selective_checkpoint_patches = keep_module_hooks_outside(deepspeed_module_hooks)
            if selective_checkpoint_patches is not None:
                self._patches.keep(selective_checkpoint_patches)
            from .adapters.zero3_teardown import DestroyedEngineRelease
            from .adapters.zero3_trace import ReleaseDecisionsFollowTrace
            from .integrations.trl_fused_head import TrlFusedHead
            from .zero3_fused import Zero3FusedCopies
            from .zero3_lifetime import Zero3Lifetime
            self.tracker = make_tracker(policy, max_pinned_bytes)
            self.fused = Zero3FusedCopies(engine)
            self.lifetime = Zero3Lifetime(engine, self.tracker, self.module_hooks)
            self.trace = ReleaseDecisionsFollowTrace(engine)
            self.teardown = DestroyedEngineRelease(self.trace.drop_decisions)
            self.trl_fused_head = TrlFusedHead()
            self.trl_fused_head.settle_if_trl_imported()
        else:
            from .adapters.zero12_flat_buffers import detach_flat_buffers
            from .grad_accumulation import Zero12Accumulation
            from .zero12_bucket_fill import Zero12BucketFill
            detach_flat_buffers(engine.optimizer)  # DeepSpeed 0.18.9: else step() fails on >= 2 gloo ranks
            self.accumulation = Zero12Accumulation(engine.optimizer)
            self.bucket_fill = Zero12BucketFill(engine.optimizer, engine.module.named_parameters(),
                                                on_order_mismatch=self._drop_mixed_gradients if check_bucket_order
                                                else None)
        # Wraps the epilogue on top of Zero12Accumulation; restore() unwinds in reverse.
        self.window = MicroStepWindow(engine.optimizer, self.stage, self._trainable,
                                      begun_before_install=self._gradients_wait_for_step(engine.optimizer))
        if self.stage == 1:
            from .zero1_window_sums import Zero1WindowSums
            # The engine's own count: the optimizer's flag is set by DeepSpeed's prologue, after
            # the backward has begun.
            self.zero1_sums = Zero1WindowSums(engine.is_gradient_accumulation_boundary)
        # Over every layer above that replaces DeepSpeed's bucket add or wraps its epilogue
        # (restore() undoes self._patches before those).
        self._patches.keep(self.grad_guard.refuse_gradients_added_twice())
        self.reporter = StatsReporter(engine, self.stats)
        self.plain_backward = PlainBackwardCheck(engine, self.backward, lambda: self.engine.zero_grad())
        # Bookkeeping with side effects: never traced under engine.compile() (see Zero3Lifetime).
        self.module_hooks.forward_hook(engine.module, never_traced(self._on_root_forward))
        # Before DeepSpeed's post-accumulate grad hooks: open the backward (and gather
        # a released ZeRO-3 param) before any gradient reaches DeepSpeed.
        for param in self._trainable:
            self._handles.append(param.register_hook(self._make_before_accumulate(param)))
        if self.backward.supports_torch_style_backward:  # the path whose output hooks divide
            self.chained = ChainedInputs(engine, lambda t: bool(self.backward.output_hook_managers((t,))))
            self.output_views = OutputViews(self.backward.output_hooks)
        self._patch("forward", self._forward)
        self._patch("backward", self._backward)
        self._patch("zero_grad", self._zero_grad)
        self._patches.apply(engine.optimizer, "zero_grad", self._optimizer_zero_grad)
        # DeepSpeed's own callers of the optimizer's zero_grad(), whichever engine method runs
        # them (the pipeline engine reduces and steps outside engine.backward and engine.step):
        # the ZeRO-1/2 epilogue on 0.17.6, and step().
        self._patches.keep(self.window.adapter.wrap_epilogue(self._inside_own_clear))
        self._patches.wrap(engine.optimizer, "step", self._marked_optimizer_step)
        module_zero_grad.register(self)
        self._patch("step", self._step)
        if self.backward.supports_torch_style_backward:  # engine.scale() comes with it (0.18+)
            self._patch("scale", self._scale)
        self._patch("destroy", self._destroy)
        logger.info(SEMANTICS_NOTE)

    def _gradients_wait_for_step(self, optimizer) -> bool:
        """Did a backward before install leave gradients for a step() still to come? (With
        optimizer offload install refused those above.)"""
        if self.accumulation is not None:  # ZeRO-1/2
            return self.accumulation.carry.holds_reduced_gradients()
        return zero3_gradients_wait_for_step(optimizer)

    # ---- patching ---------------------------------------------------------------------

    def _patch(self, name, wrapper_factory):
        self._patches.apply(self.engine, name, wrapper_factory)

    def restore(self) -> None:
        """Undo everything installed, in reverse order; safe on a partial install."""
        module_zero_grad.unregister(self)
        self._patches.undo()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.module_hooks is not None:
            self.module_hooks.remove()
        if self.trl_fused_head is not None:
            self.trl_fused_head.release()
        if self.window is not None:
            self.window.restore()
        if self.bucket_fill is not None:
            self.bucket_fill.restore()
        if self.accumulation is not None:
            self.accumulation.restore()
        if self.fused is not None:  # fills pending gradients before the stock methods return
            self.fused.uninstall()
        if self.trace is not None:
            self.trace.remove()
        if self.lifetime is not None:
            self.lifetime.release_everything_held()
            self.lifetime.remove_hooks()
        if self.tracker is not None:
            self.tracker.unregister_all()
        if self.grad_guard is not None:
            self.grad_guard.restore()
        if self.plain_backward is not None:
            self.plain_backward.restore()
        if self.backward is not None:
            self.backward.restore()

    # ---- engine method wrappers ----------------------------------------------------------

    def _forward(self, original):

        def forward(*args, **kwargs):
            self.recover_if_backward_died()
            self.module_hooks.keep_after_deepspeeds()  # before the root's hooks run
            if self.trl_fused_head is not None and not self.trl_fused_head.settled:
                self.trl_fused_head.settle_if_trl_imported()  # TRL imported after install
            division = OutputDivision()
            if self.chained is not None:
                args, kwargs = self.chained.undo_division_on_inputs(args, kwargs, division)
            with self._engine_call(), self._forward_running():
                if self.lifetime is None:
                    output = original(*args, **kwargs)
                else:
                    output = self.lifetime.run_forward(original, *args, **kwargs)
            # DeepSpeed attached its output hook managers inside the original forward.
            tensors = list(tensors_in(output))
            managers = self.backward.output_hook_managers(tensors)
            if self.output_views is not None and self.engine.gradient_accumulation_steps() > 1:
                output = self.output_views.divided_at_views(output, managers, self._latest_output_hook)
                tensors = list(tensors_in(output))
            self._latest_forward.set_managers(managers)
            self.backward.scale_outputs_only_when(managers, self._pass_accumulates, division.note)
            if self.chained is not None:
                self.chained.mark_outputs(tensors)
            return output

        return forward

    def _backward(self, original):

        def backward(loss, *args, **kwargs):
            self.recover_if_backward_died()
            try:
                with self._engine_call():
                    return self.backward.engine_backward(original, loss, *args, **kwargs)
            except BaseException as error:
                self.recover_if_backward_died()  # after DeepSpeed's own handlers have run
                if self._stepped_by_accelerate_backward:
                    add_hint_if_stale_graph(error)
                raise

        return backward

    def _zero_grad(self, original):

        def zero_grad(*args, **kwargs):
            self.recover_if_backward_died()
            if self.accumulation is not None:
                self.accumulation.forget_window()
            with self._own_clear():
                result = original(*args, **kwargs)
                # engine.zero_grad() only drops param.grad; the reduced gradients the ZeRO
                # optimizer holds must go too, or a following backward would add to them.
                self.backward.clear_reduced_grads()
            self.window.grads_cleared()
            if self.zero1_sums is not None:
                self.zero1_sums.window_cleared()
            self._forget_carried_gradients()  # gone with the .grad they were in
            self._gradients_held = False
            return result

        return zero_grad

    def _optimizer_zero_grad(self, original):
        """The ZeRO optimizer's zero_grad() (what deepspeed.initialize returns) clears p.grad
        only (ZeRO-1/2) or resets the micro step (ZeRO-3): called by the user, it clears as
        engine.zero_grad() does. DeepSpeed's own calls (in step(), an epilogue) stay as they are."""

        def zero_grad(*args, **kwargs):
            if self._inside_a_clear_or_engine_call() or not self._gradients_held:
                return original(*args, **kwargs)
            self.engine.zero_grad()  # the patched one
            return None

        return zero_grad

    def _inside_own_clear(self, original, *args, **kwargs):
        with self._own_clear():
            return original(*args, **kwargs)

    def _marked_optimizer_step(self, original, *args, **kwargs):
        with self._own_clear():
            result = original(*args, **kwargs)
        self._gradients_held = False  # applied (or skipped on overflow, DeepSpeed clears them then)
        return result

    def _inside_a_clear_or_engine_call(self) -> bool:
        """A zero_grad() made by DeepSpeed (in step(), a backward's epilogue) or by our own clears."""
        return bool(self._own_clears or self._engine_calls or self.scope.open)

    @contextlib.contextmanager
    def _own_clear(self):
        self._own_clears += 1
        try:
            yield
        finally:
            self._own_clears -= 1

    def before_module_zero_grad(self, param_ids) -> None:
        """torch's Module.zero_grad() is about to clear the .grad of ``param_ids``: over every
        trainable param of this engine it is engine.zero_grad(); over some of them, while
        DeepSpeed holds their gradients, it is refused before anything changes."""
        if self._inside_a_clear_or_engine_call():
            return
        cleared = [p for p in self._trainable if id(p) in param_ids]
        if not cleared:
            return
        if len(cleared) == len(self._trainable):
            self.engine.zero_grad()  # the patched one
        elif self._gradients_held and any(self.window.reached_in_window(p) for p in cleared):
            raise RuntimeError(module_zero_grad.PARTIAL_CLEAR_MESSAGE.format(cleared=len(cleared),
                                                                             total=len(self._trainable)))

    def _drop_mixed_gradients(self) -> None:
        """The ranks reduced different bucket layouts: every sum of the window is mixed."""
        self.engine.zero_grad()  # the patched one: the window's sums go too

    def _step(self, original):

        def step(*args, **kwargs):
            self.recover_if_backward_died()
            if self.lifetime is not None:
                self.lifetime.drain_deferred_if_idle()  # pins that died on another thread: before the step's peak
            if self.zero1_sums is not None:
                self.zero1_sums.refuse_if_lost()
            boundary = self.engine.is_gradient_accumulation_boundary()
            if boundary and self.window.adapter.offload and not self._backward_since_step:
                # DeepSpeed would step on the fp32 gradients as they are (zeroed: torch's moments
                # would still move the weights) and rewrite every weight, failing every live
                # graph, where torch does nothing: refused as without offload, where it fails.
                raise StepWithoutBackwardError(_STEP_WITHOUT_BACKWARD)
            if boundary:
                self.window.before_step()
            try:
                result = original(*args, **kwargs)
            except (TypeError, KeyError) as error:
                # DeepSpeed's own failures there: TypeError after a step (its gradient lists
                # are None), KeyError before the first backward (they were never made).
                if self._backward_since_step:
                    raise
                raise StepWithoutBackwardError(_STEP_WITHOUT_BACKWARD) from error
            self._backward_since_step = False
            self._stepped_by_accelerate_backward = step_called_by_accelerate_backward()
            if boundary and self.engine.gradient_accumulation_steps() > 1 and boundary_set_by_hand(self.engine):
                # A boundary set by hand holds until set again. accelerate sets it just before
                # its own backward, so a backward of the next micro step before that one (a first
                # loss through engine.backward or loss.backward) found this window's True, and
                # ZeRO-2 closed the new window there, dropping it. With GAS > 1 the micro step
                # after a closed window never closes one: DeepSpeed asks callers to set the flag
                # before each backward, and whoever does so overrides this.
                self.engine.set_gradient_accumulation_boundary(False)
            if self.accumulation is not None:
                self.accumulation.grads_cleared(step_skipped=boundary and not self.engine.was_step_applied())
            if boundary and self.zero1_sums is not None:
                self.zero1_sums.window_cleared()
            if self.engine.was_step_applied():
                self._weights_changed()
            if boundary:
                self.reporter.after_step()
            return result

        return step

    def _weights_changed(self) -> None:
        """A backward through a graph saved before this step must fail, as in torch (a param
        modified in place). DeepSpeed writes the new weights through ``.data``, which torch's
        check does not see, so the stale graph would run with the new weights, silently."""
        if self.lifetime is not None:  # ZeRO-3: saved params go through the tracker's hooks
            # Its refusal is raised inside autograd, also under loss.backward(): it carries the note.
            self.lifetime.weights_changed(ACCELERATE_STEP_NOTE if self._stepped_by_accelerate_backward else "")
        else:
            for param in self._trainable:  # ZeRO-1/2: torch's own check then fires
                torch.autograd.graph.increment_version(param)

    def _destroy(self, original):
        return destroy_uninstalling(self.engine, self.teardown, original)

    def _scale(self, original):

        def scale(loss, retain_graph=None):
            # retain_graph is accepted for the upstream proposal's spelling
            # (engine.scale(loss, retain_graph=True)); it belongs to the .backward() call.
            return original(loss)

        return scale

    # ---- backward detection ----------------------------------------------------------------

    def _on_root_forward(self, module, inputs, output):
        self.backward.note_forward()
        if self.lifetime is not None:
            self.lifetime.after_forward()
        forward = _ForwardOutputs()
        self._latest_forward = forward
        self._latest_output_hook = self._make_output_hook(forward)  # the views of _forward get it too
        self._live_forwards = [f for f in self._live_forwards if f.alive()] + [forward]
        for tensor in tensors_in(output):
            if tensor.grad_fn is not None:
                tensor.register_hook(self._latest_output_hook)
        return None

    def _make_output_hook(self, forward):

        def on_output_grad(grad):
            if not self.scope.open:
                self._entered_via_outputs = True
                self._entry_forward = forward
                self.scope.enter()
            return None

        return on_output_grad

    def _make_before_accumulate(self, param):

        def before_accumulate(grad):
            if not param.requires_grad:
                return None  # frozen since the forward: AccumulateGrad adds nothing to .grad
            if grad.layout is not torch.strided:  # DeepSpeed's hook, next, would fail on it
                from .grad_hook_guard import SparseGradientError, sparse_gradient_message
                raise SparseGradientError(sparse_gradient_message(self.grad_guard.name_of(param), grad.layout))
            if not self.scope.open and self._joins_next_backward(param):
                # DeepSpeed's hooks take these gradients but reduce them in the user's backward
                # that follows, as part of that one: so do we. (A torch.autograd.grad there
                # writes no .grad: nothing to carry.)
                if _will_accumulate(param):
                    self._gradients_before_backward[id(param)] = param
                return None
            self.enter_from_inner_hook()
            if self._accumulating:
                self.window.note_gradient(param)
                if self.plain_backward.prologue_unsure:
                    self.plain_backward.before_first_gradient()
            if self.lifetime is not None:
                self.lifetime.before_accumulate(param)
            return None

        return before_accumulate

    def _joins_next_backward(self, param) -> bool:
        """Is this a backward DeepSpeed does not count as one of its own? One inside this
        engine's forward (DeepSpeed's TiledFusedLogitsLoss backwards each shard there), or a
        shard of its tiled compute run by the training loop between the forward and the user's
        backward (a TiledFusedLogitsLoss on the engine's output): DeepSpeed holds the shards'
        gradients back (ds_grad_is_ready=False) and keeps its backward closed for them up to
        the last shard, which makes them ready, and reduces them all in the user's backward."""
        if self._forwards_running:
            return True
        if self._engine_calls:
            return False
        if self.window.adapter.gradient_held_back(param):
            self._shards_pending.add(id(param))
            return True
        if id(param) in self._shards_pending:  # the last shard
            self._shards_pending.discard(id(param))
            return True
        return False

    def _forget_carried_gradients(self) -> None:
        """What backwards that joined the next one left for it: taken by it, or dropped."""
        self._gradients_before_backward = {}
        self._shards_pending = set()

    def enter_from_inner_hook(self) -> None:
        """Open a backward that reached us without passing the forward outputs."""
        if not self.scope.open:
            self._entered_via_outputs = False
            self._entry_forward = None
            self.scope.enter()

    def _pass_accumulates(self) -> bool:
        """False inside a torch.autograd.grad through this engine (scope open, nothing
        accumulating); True in a backward, and where no pass of ours is open."""
        return self._accumulating or not self.scope.open

    def _task_accumulates(self) -> bool:
        """Does the running graph task write any param's .grad (backward, not autograd.grad)?
        Also when the params it reaches are all inside reentrant checkpoints (LoRA adapters
        under HF gradient checkpointing): they accumulate in the nested tasks those run."""
        unreached = False
        for param in self._trainable:
            if not param.requires_grad:  # frozen for now (a GAN's D in the G step): no node
                continue
            accumulates = _will_accumulate(param)
            if accumulates is None:  # a leaf passed to autograd.grad(): it never accumulates
                return False
            if accumulates:
                return True
            unreached = True
        return unreached and _reentrant_checkpoint_below()

    def _on_backward_start(self) -> None:
        if self.lifetime is not None:  # first: _task_accumulates looks at the params too
            self.lifetime.replace_inference_placeholders()
        entry, self._entry_forward = self._entry_forward, None
        managers = entry.managers() if entry is not None else []
        # DeepSpeed's hooks on the outputs of every other forward stay quiet in this
        # backward: one prologue per backward. (Two prologues leave its backward depth
        # at 2, and stock 0.19.8 then skips the epilogue: nothing is reduced.)
        self.backward.suppress_output_hooks(
            [m for f in self._live_forwards if f is not entry for m in f.managers()])
        self._accumulating = self._task_accumulates()
        if not self._accumulating:
            # torch.autograd.grad: nothing reaches .grad, so DeepSpeed's prologue and
            # epilogue must not run (its epilogue would reduce empty buckets).
            self.backward.suppress_output_hooks(managers)
        else:
            self.backward.note_backward_start()  # first: the cleanup after a refusal below reads it
            self.window.refuse_backward_if_begun_before_install()  # before any change
            if self.zero1_sums is not None:
                self.zero1_sums.refuse_if_lost()
                self.zero1_sums.backward_started()
            self.backward.check_backward_entry()  # before anything reaches DeepSpeed
            if self.backward.backward_finished_since_forward():
                self.backward.start_new_micro_step()
            self.window.begin_backward()
            if self.accumulation is not None:  # before this backward's gradients are noted
                self.accumulation.begin_backward(self.window.reached_in_window)
            self.grad_guard.begin_backward(taken_earlier=self._gradients_before_backward)
            self.plain_backward.begin(entry_hooks_missing=self._entered_via_outputs and not managers)
            for param in self._gradients_before_backward.values():
                self.window.note_gradient(param)
            self._forget_carried_gradients()  # a tiled compute cut short: its shards join this one
            if self._entered_via_outputs:
                self.backward.rearm_output_hooks(managers)
            else:
                # Gradients reach params before the forward outputs (a gradient penalty's
                # double-backward nodes run first): DeepSpeed's prologue must run now, once.
                self.backward.suppress_output_hooks(managers)
                self.backward.run_prologue()
        if self.lifetime is not None:
            self.lifetime.backward_started()

    def _on_backward_end(self) -> None:
        if self.lifetime is not None:
            self.lifetime.backward_ended()
        if self._accumulating:
            self._accumulating = False
            self._backward_since_step = True
            self._gradients_held = True
            if self.zero1_sums is not None:
                self.zero1_sums.backward_finished()
            self.grad_guard.check_backward(self.window.params_this_backward())
            self.plain_backward.end()

    # ---- faults ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _forward_running(self):
        self._forwards_running += 1
        try:
            yield
        finally:
            self._forwards_running -= 1

    @contextlib.contextmanager
    def _engine_call(self):
        """Counts a running engine forward or backward: a backward dying inside one is
        cleaned up by that call's wrapper, not as torch drops it (_on_backward_died)."""
        self._engine_calls += 1
        try:
            yield
        finally:
            self._engine_calls -= 1

    def _on_backward_died(self) -> None:
        """Torch drops a dead backward's task before its exception reaches the caller: clean
        up then, as the next engine call would, so that a plain backward right after it is
        seen. Inside an engine forward or backward, that call's wrapper cleans up later."""
        if self._engine_calls == 0:
            self.recover_if_backward_died()

    def recover_if_backward_died(self) -> None:
        """An exception inside a backward skips its end callback: clean up as torch drops its
        task (_on_backward_died), or else at the next engine call."""
        # A dead backward reduced nothing on purpose: no gradient check when closing it.
        accumulating, self._accumulating = self._accumulating, False
        if not self.scope.abandon():
            self._accumulating = accumulating
            return
        self._failed_backwards += 1
        self.backward.reset_after_failed_backward()
        if accumulating:
            # A dead torch.autograd.grad reduced nothing and zeroed nothing: the gradients of
            # the backwards before it must stay as they are.
            keep_grads = self.zero1_sums is not None and self.zero1_sums.backward_died(
                reached_window_sums=self.window.reached_window_sums())
            with self._own_clear():  # its optimizer.zero_grad() is the stock one
                self.backward.discard_interrupted_reduction(keep_param_grads=keep_grads)
            if self.bucket_fill is not None:
                self.bucket_fill.discard()
            if self.accumulation is not None:
                self.accumulation.backward_died()
        if self.lifetime is not None:
            self.lifetime.backward_died()
        logger.warning("zero_lifetime: a backward ended with an exception; released what it held")

    # ---- stats -----------------------------------------------------------------------------

    def stats(self) -> dict:
        result = {
            "stage": self.stage,
            "policy": self.policy,
            "pinned_params": 0,
            "pinned_bytes": 0,
            "peak_pinned_bytes": 0,
            "deferred_releases": 0,
            "regathers": 0,
            "live_handles": 0,
            "pin_budget_fallbacks": 0,
            "failed_backwards": self._failed_backwards,
        }
        result["grad_hooks_recreated"] = bool(self.grad_guard.recreated_hooks)
        if self.bucket_fill is not None:
            check = self.bucket_fill.order_check
            result.update(bucket_fills=self.bucket_fill.fills, filled_grads=self.bucket_fill.fused_grads,
                          prescaled_fills=self.bucket_fill.prescaled_fills,
                          bucket_order_checks=check.checks if check is not None else 0)
        if self.fused is not None:
            result.update(self.fused.counts)
        if self.lifetime is not None:
            result.update(self.lifetime.stats())
            result["traces_recorded"] = self.trace.traces_recorded
        return result


def _will_accumulate(param) -> Optional[bool]:
    """Will the running graph task write ``param``'s .grad? None when ``param`` is an input
    of a torch.autograd.grad (which writes no .grad)."""
    # Look the AccumulateGrad node up now, never cache it: a node made while a ZeRO-3 param
    # is released records its empty shape and would reject real grads.
    with torch.enable_grad():
        node = param.view_as(param).grad_fn.next_functions[0][0]
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None


# torch's reentrant checkpoint (torch.utils.checkpoint, use_reentrant=True) and DeepSpeed's
# (deepspeed.checkpointing) are both an autograd.Function named CheckpointFunction.
_REENTRANT_CHECKPOINT_NODE = "CheckpointFunctionBackward"


def _reentrant_checkpoint_below() -> bool:
    """Is there a reentrant checkpoint's backward in the graph below the running autograd node
    (the hook's that opens the backward)? It recomputes its part of the forward and backwards
    that as a nested graph task: the params in that part are not in this task's graph. Only in
    a plain backward (torch's own test, which the checkpoint itself makes: autograd.grad, or a
    backward with ``inputs``, makes it raise); walked only when no param of the engine is in
    the task's own graph, about 1 us a node."""
    if not torch.autograd._is_checkpoint_valid():
        return False
    node = torch._C._current_autograd_node()
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if type(node).__name__ == _REENTRANT_CHECKPOINT_NODE:
            return True
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


class _ForwardOutputs:
    """DeepSpeed's output hook managers of one forward, held weakly (hooks keep them alive)."""

    def __init__(self):
        self._refs = None  # set when the engine forward returns (never, if it raised)

    def set_managers(self, managers) -> None:
        self._refs = [weakref.ref(m) for m in managers]

    def managers(self) -> list:
        return [m for m in (r() for r in self._refs or ()) if m is not None]

    def alive(self) -> bool:
        return any(r() is not None for r in self._refs or ())


def install(engine, policy: Optional[str] = None, max_pinned_bytes: Optional[int] = None,
            strict: Optional[bool] = None, check_bucket_order: Optional[bool] = None):
    """Install zero_lifetime on a DeepSpeed engine; returns the installation handle.

    policy: "regather" (default; memory like stock ZeRO-3, released params are
    gathered again when a retained graph needs them) or "pin" (params stay gathered
    while a live graph references them, up to ``max_pinned_bytes``; -1 = no limit).
    strict=False: on an unrecognised DeepSpeed, warn and patch nothing instead of raising.
    check_bucket_order (ZeRO-1/2, more than one rank; default True): after each backward,
    one 16-byte all-reduce checks that every rank reduced the same gradients in the same
    bucket layout, and raises RanksDisagreeError where DeepSpeed would silently mix them.
    Options not given here come from the DeepSpeed config's "zero_lifetime" section.
    Installing twice returns the same handle. An engine built without an optimizer (a frozen
    reward or reference model, ZeRO-3 or stage 0) is installed as a frozen model
    (``frozen_engine``): on ZeRO-3 the lifetime tracker alone.
    """
    _check_engine(engine)
    if engine.__dict__.get(_DESTROYED):
        # E.g. a Trainer's second train(): accelerate destroyed the engine and the Trainer
        # kept it. DeepSpeed removed its hooks, so it cannot train, installed or not.
        raise RuntimeError(DESTROYED_MESSAGE)
    given = {"policy": policy, "max_pinned_bytes": max_pinned_bytes, "strict": strict,
             "check_bucket_order": check_bucket_order}
    try:
        raw = raw_config(engine)
    except UnsupportedDeepSpeedError:
        if strict is not False:
            raise
        raw = {}
    options = config.resolve(raw, **given)
    policy, max_pinned_bytes, strict = options["policy"], options["max_pinned_bytes"], options["strict"]
    with _install_lock:
        existing = engine.__dict__.get(_ATTR)
        if existing is not None:
            return existing
        try:
            if runs_without_optimizer(engine):
                installation = FrozenEngineInstallation(engine, policy, max_pinned_bytes)
            else:
                installation = Installation(engine, policy, max_pinned_bytes, options["check_bucket_order"])
        except UnsupportedDeepSpeedError as exc:
            if strict:
                raise
            warnings.warn(f"{exc} Continuing without zero_lifetime.", RuntimeWarning, stacklevel=2)
            return None
        object.__setattr__(engine, _ATTR, installation)
    if isinstance(installation, FrozenEngineInstallation):  # nothing trains its params
        warn_if_params_require_grad(engine.module, installation.stage)
    else:
        warn_if_renormalizing_embeddings(engine.module, installation.stage)
    return installation


def uninstall(engine) -> bool:
    """Restore every patched method; releases anything zero_lifetime still holds."""
    with _install_lock:
        installation = engine.__dict__.pop(_ATTR, None)
        if installation is None:
            return False
        installation.restore()
        return True


def stats(engine) -> dict:
    installation = engine.__dict__.get(_ATTR)
    if installation is None:
        raise ValueError("zero_lifetime is not installed on this engine; call zero_lifetime.install(engine)")
    return installation.stats()
