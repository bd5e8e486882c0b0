"""ZeRO-3 parameter lifetime tied to the autograd graphs that still need the params.

Forward runs under saved-tensor hooks: every saved param (or view of one) becomes a
tracker handle that counts as a live reference. ``unpack`` returns gathered data,
gathering first when DeepSpeed already released the param (policy "regather").
Under policy "pin" a referenced param is not released at all until its last
handle dies. A pre-AccumulateGrad hook gathers a param before its gradient lands,
so a second backward never accumulates into an empty (numel 0) param.

A forward that bypasses the engine (``engine.module(x)``, a method of the model) runs under
the same hooks (``zero3_bypassing_forward``). DeepSpeed's per-module backward counters, which a
second backward needs back to fetch module by module again, are recorded as the root's forward
returns and set back as a second backward opens at the hook on the root's outputs. A forward of
modules without the root has no hook that opens its backwards before DeepSpeed's module hooks
run: its counters are recorded as each outermost module returns and set back as each backward
over it ends.

A handle dies on whichever thread drops a graph's last reference: on 2 ranks that can be
gloo's worker thread, freeing a finished all-gather's tensor. DeepSpeed's param state is not
thread-safe, so the release of a pin is only ever done on the training thread: one that dies
elsewhere waits for that thread's next call (forward, backward, step, ``stats``).
"""

import collections
import threading

import torch

from .adapters.zero3_params import PinnedParamsStayGathered, Zero3Params
from .never_traced import never_traced
from .outer_saved_tensor_hooks import chained_with, hooks_in_force
from .zero3_bypassing_forward import BypassingForwards


_PIN_WITH_FAST_SHARDING = (
    "zero_lifetime: policy \"pin\" cannot keep the params of leaf modules that stage3_module_granularity_threshold "
    "chose: DeepSpeed's fast sharding of those modules overwrites a released param's data even while a graph "
    "still uses it (pinned). Use policy \"regather\" (the default), or mark the leaf modules with "
    "deepspeed.utils.set_z3_leaf_modules instead of the threshold.")


class Zero3Lifetime:

    def __init__(self, engine, tracker, module_hooks):
        self.engine = engine
        self.tracker = tracker
        self.zparams = Zero3Params(engine)
        if tracker.policy == "pin" and self.zparams.keeps_released_leaf_data():
            raise ValueError(_PIN_WITH_FAST_SHARDING)
        self.params = {p.ds_id: p for p in engine.module.parameters()}
        self._regathered = set()  # ds_ids we gathered on demand; we own their release
        # Unpinned params whose release waits for a safe point. A deque: other threads append
        # while the training thread drains (popleft and append are atomic, a list swap is not).
        self._deferred = collections.deque()
        self._training_thread = threading.get_ident()  # of the latest forward (at first: install)
        # One entry per running forward or backward, its thread (a backward's is an autograd
        # thread on CUDA): releases are deferred while any runs.
        self._threads_in_calls = []
        self.accumulate_regathers = 0
        self.inference_placeholders_replaced = 0
        self._hook_handles = []
        self._modules = list(engine.module.modules())
        self._counters_after_forward = {}  # module -> DeepSpeed's counters: one entry each, latest wins
        self._counters_consumed = False  # a backward over the latest forward has run
        # The latest forward ran modules without the root: its counters are set back as each
        # backward over it ends.
        self._restore_counters_at_backward_end = False
        self._root = engine.module
        self.bypassing = BypassingForwards(self.saved_tensors_hooks, lambda: bool(self._threads_in_calls),
                                           self._bypassing_forward_started, self._bypassing_module_returned)

        self._pinned_stay = None
        tracker.set_available_status(Zero3Params.AVAILABLE)
        tracker.set_callbacks(self._gather_for_unpack, Zero3Params.pin, self._on_unpinned)
        for param in self.params.values():
            tracker.register_param(param)
            if param.requires_grad:
                self._hook_handles.append(param.register_post_accumulate_grad_hook(self._after_accumulate))
        # Each module's params looked up once: module.parameters(recurse=False) costs ~3 us a
        # call, every forward of every module. After DeepSpeed's pre-forward hook of the
        # module, which gathers its params.
        before_forward = never_traced(self._before_module_forward)
        for module in self._modules:
            own = tuple(module.parameters(recurse=False))
            module_hooks.forward_pre_hook(module, self._note_gathered_hook(own) if own else before_forward)
        # Last, so nothing after it can fail with the params' partition() replaced: a
        # GatheredParameters context (logging, an EMA copy) must not free what a graph pinned.
        if tracker.policy == "pin":
            names = {id(p): n for n, p in engine.module.named_parameters()}
            self._pinned_stay = PinnedParamsStayGathered(self.params.values(), names)

    # ---- forward ----------------------------------------------------------------

    def saved_tensors_hooks(self):
        outer = hooks_in_force()  # activation offloading around the forward, say
        if outer is None:
            return torch.autograd.graph.saved_tensors_hooks(self.tracker.pack, self.tracker.unpack)
        return torch.autograd.graph.saved_tensors_hooks(*chained_with(self.tracker, outer))

    def run_forward(self, forward, *args, **kwargs):
        """``forward(*args, **kwargs)``, the engine's, under the tracker's saved-tensor hooks."""
        self.begin(forward=True)
        try:
            with self.saved_tensors_hooks():
                return forward(*args, **kwargs)
        finally:
            self.end()

    def _note_gathered_hook(self, params):
        note_gathered_all = self.tracker.note_gathered_all
        grad_enabled = torch.is_grad_enabled

        def note_gathered_before_forward(module, _inputs):
            # Record where each gathered param lives, so a saved tensor that shares its
            # storage without being an autograd view of it is still recognised. Not under
            # no_grad (generation, evaluation, a frozen model's scoring), where it was most of
            # these hooks' cost: what a module's forward saves then is used before it returns
            # (DeepSpeed's hooks detach the tensors it returns), while its params are gathered.
            if grad_enabled():
                note_gathered_all(params)
            self.bypassing.before_module_forward(module)

        # Under engine.compile() module hooks run inside the compiled call: run this one as
        # written, never traced (Dynamo would guard on the params' state and recompile).
        return never_traced(note_gathered_before_forward)

    def _before_module_forward(self, module, _inputs) -> None:
        self.bypassing.before_module_forward(module)

    def _bypassing_forward_started(self) -> None:
        if self._counters_consumed:  # a new forward: what was recorded belongs to the one before
            self._counters_after_forward = {}
            self._counters_consumed = False
        # A root forward that encloses this one (engine.module(x)) records all as it returns.
        self._restore_counters_at_backward_end = True

    def _bypassing_module_returned(self, module) -> None:
        if module is not self._root:  # the root's forward hook records every module
            # Updated, not appended: forwards with no backward between them (an evaluation loop
            # through a method) would grow it without end.
            self._counters_after_forward.update(self.zparams.module_counters(list(module.modules())))

    def weights_changed(self, step_note: str = "") -> None:
        """An optimizer step updated the weights: params saved before it refuse to unpack,
        saying ``step_note`` too (who took the step, where the user did not)."""
        self.tracker.advance_weights_epoch(step_note)

    def after_forward(self) -> None:
        self._counters_after_forward = dict(self.zparams.module_counters(self._modules))
        self._counters_consumed = False
        self._restore_counters_at_backward_end = False

    def replace_inference_placeholders(self) -> None:
        """Before anything in a backward looks at the params (DeepSpeed's hooks look at all of
        them): a release under torch.inference_mode (a forward, a GatheredParameters context)
        left inference tensors in them, which autograd cannot see. About 0.15 us a param."""
        self.inference_placeholders_replaced += self.zparams.replace_inference_placeholders(self.params.values())

    def rearm_if_another_backward(self) -> None:
        """Another backward over the same forward (after a backward or a
        torch.autograd.grad, which consume them alike): DeepSpeed's per-module counters are
        set back to what the forward left, so it fetches and releases module by module as in
        the first. Without it a module whose post-backward hook the first pass never reached
        (its input was not asked for) releases in the second with no fetch on record."""
        if self._counters_consumed and not self._restore_counters_at_backward_end:
            self.zparams.restore_module_counters(self._counters_after_forward.items())

    def begin(self, forward: bool = False) -> None:
        if not self._threads_in_calls:
            self.drain_deferred()  # pins that died on another thread since the last call
        if forward:
            self._training_thread = threading.get_ident()
        self._threads_in_calls.append(threading.get_ident())

    def end(self) -> None:
        if self._threads_in_calls:  # emptied already when a failed backward was cleaned up
            self._threads_in_calls.pop()
        if not self._threads_in_calls:
            self.drain_deferred()

    # ---- backward ----------------------------------------------------------------

    def _gather_for_unpack(self, param) -> None:
        self.zparams.gather(param)
        if not self.tracker.is_pinned(param):
            self._regathered.add(param.ds_id)

    def before_accumulate(self, param) -> None:
        """AccumulateGrad must never add a real gradient to a released (numel 0) param."""
        if param.ds_status != Zero3Params.AVAILABLE:
            self.zparams.gather(param)
            self._regathered.add(param.ds_id)
            self.accumulate_regathers += 1

    def _after_accumulate(self, param) -> None:
        # DeepSpeed's own post-accumulate hook (registered first) has reduced the grad.
        if param.ds_id in self._regathered and not self.tracker.is_pinned(param):
            self._regathered.discard(param.ds_id)
            self.zparams.release_regathered(param)

    def end_of_backward(self) -> None:
        """Release what this backward gathered on demand; run releases that waited."""
        self._counters_consumed = True
        if self._restore_counters_at_backward_end:
            self.zparams.restore_module_counters(self._counters_after_forward.items())
        for ds_id in sorted(self._regathered):
            param = self.params[ds_id]
            if not self.tracker.is_pinned(param):
                self.zparams.release_regathered(param)
        self._regathered.clear()

    def release_modules_left_in_backward(self) -> None:
        """What modules whose post-backward hook never ran still hold, released at the end of
        a backward that no forward encloses (a forward's own modules hold their params)."""
        if len(self._threads_in_calls) == 1:
            self.zparams.release_modules_left_in_backward(self.params.values())

    def backward_started(self) -> None:
        """A backward through the engine opens (after ``replace_inference_placeholders``)."""
        self.rearm_if_another_backward()
        self.begin()

    def backward_ended(self) -> None:
        """A backward through the engine closes: what it gathered again is released, and what
        modules left gathered in it (DeepSpeed 0.19.8's epilogue does this too, but it is
        suppressed for torch.autograd.grad, and older releases do not)."""
        self.end_of_backward()
        self.release_modules_left_in_backward()
        self.end()

    def backward_died(self) -> None:
        """A backward through the engine raised: nothing it gathered or pinned stays."""
        self.release_everything_held()
        self.release_backward_leftovers()

    # ---- release of pins -------------------------------------------------------------

    def _on_unpinned(self, param) -> None:
        me = threading.get_ident()
        if me != self._training_thread and me not in self._threads_in_calls:
            # Not even the pin mark is touched here: DeepSpeed reads it between any two
            # bytecodes of the training thread (a GatheredParameters context's exit, say).
            self._deferred.append(param)
            return
        if self._threads_in_calls:
            Zero3Params.unpin(param)
            self._deferred.append(param)
        else:
            self._release_unpinned(param)

    def _release_unpinned(self, param) -> None:
        Zero3Params.unpin(param)
        # A user's GatheredParameters context reads it (it found the param gathered, so it did
        # not gather it): the context's exit partitions it, now that no pin keeps it.
        if not self.zparams.in_user_context(param):
            self.zparams.release(param)

    def drain_deferred_if_idle(self) -> None:
        """From the library's calls outside forward and backward (step, ``stats``): on the
        training thread only (``stats`` from a monitoring thread leaves them)."""
        if not self._threads_in_calls and threading.get_ident() == self._training_thread:
            self.drain_deferred()

    def drain_deferred(self) -> None:
        deferred = self._deferred
        while deferred:
            param = deferred.popleft()
            if not self.tracker.is_pinned(param):  # pinned again since: that pin keeps it
                self._release_unpinned(param)

    # ---- recovery and teardown -------------------------------------------------------

    def release_everything_held(self) -> None:
        """After a failed backward or at uninstall: no pin, no on-demand gather survives."""
        for param in self.tracker.force_unpin_all():
            Zero3Params.unpin(param)
            self._deferred.append(param)
        self._threads_in_calls.clear()
        self.end_of_backward()
        self.drain_deferred()

    def release_backward_leftovers(self) -> None:
        """Release params that modules of an interrupted backward still hold."""
        self.zparams.release_backward_leftovers(self.params.values())

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        if self._pinned_stay is not None:
            self._pinned_stay.undo()
        for param in self.params.values():
            Zero3Params.unpin(param)

    def stats(self) -> dict:
        """The tracker's stats and ours, after the releases that waited (``stats()``)."""
        self.drain_deferred_if_idle()
        result = dict(self.tracker.stats())
        result["regathers"] += self.accumulate_regathers
        result.update(self.counts())
        return result

    def counts(self) -> dict:
        gathered = [p for p in self.params.values() if p.ds_status == Zero3Params.AVAILABLE and not p.ds_persist]
        return {
            "gathered_params": len(gathered),
            "gathered_bytes": sum(p.ds_numel * p.element_size() for p in gathered),
            "inference_placeholders_replaced": self.inference_placeholders_replaced,
        }
