"""Gradients always reach DeepSpeed's buckets, or the backward says why they did not.

* On DeepSpeed's torch < 2.1 hook path its hooks sit on ``AccumulateGrad`` nodes that
  nobody keeps alive, so they never fire (DeepSpeed #7595: empty IPG buckets, then an
  IndexError, or with the error guarded, training that silently does nothing). Install
  makes DeepSpeed create its hooks again through a registration that keeps them alive.
* A param that requires grad but is not in the ZeRO optimizer (frozen when
  ``deepspeed.initialize`` ran, unfrozen later) would get gradients nobody reduces or
  applies: an error at install, or at the end of the backward that produced one (for
  the params the module had at install).
* At the end of every backward: a param that got a gradient which no DeepSpeed hook
  took is an error that names it, instead of an IndexError or a step that changes
  nothing. Not where DeepSpeed made no hooks at all (ZeRO-1 without contiguous_gradients
  or overlap_comm): it reduces .grad itself at the boundary, so there is nothing to miss.
* A param frozen between the forward and a backward (``requires_grad_(False)``) gets no
  gradient in it, yet torch runs its hooks: DeepSpeed's are skipped for it.
* A param whose finished gradient reaches DeepSpeed's buckets twice in one backward is an
  error that names it. DeepSpeed reduces a param once per backward; reentrant activation
  checkpointing (``use_reentrant=True``) accumulates .grad once per segment that uses the
  param (a module applied twice, a tied weight inside and outside a segment), each time
  with its hooks. Stock then
  fails (an assertion), or on ZeRO-3, where the bucket was reduced between the two,
  keeps only the last application's share without a word. So does a ZeRO-3 leaf module
  applied more than once: its reduction hook fires once per application.
* A sparse gradient (``nn.Embedding(sparse=True)``) is an error that names the param, before
  DeepSpeed's hook fails on it.
* ZeRO-3 leaf modules: DeepSpeed's hook that reduces a leaf module's gradients also fires
  in a ``torch.autograd.grad`` through the module, and there zero-fills and reduces
  gradients no pass computed (into the bucket the next backward then finds them in twice).
  It runs only in passes that accumulate ``.grad``.
"""

import torch

from .adapters.grad_hooks import GradHooks, deepspeed_hooks_are_dead
from .adapters.grad_window import after_epilogue
from .adapters.patching import Patches
from .adapters.zero3_params import full_numel

# torch >= 2.1: a hook on the param itself, nothing to keep alive. Module level so a test
# can force the AccumulateGrad-node path that torch < 2.1 needs.
USE_POST_ACCUMULATE_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


class GradientsNotReducedError(RuntimeError):
    """A backward produced gradients that DeepSpeed's ZeRO optimizer never received."""


class GradientReducedTwiceError(RuntimeError):
    """One backward brought a param's finished gradient to DeepSpeed's buckets twice."""


class SparseGradientError(RuntimeError):
    """A backward produced a sparse gradient, which DeepSpeed's ZeRO buckets cannot hold."""


def sparse_gradient_message(name: str, layout) -> str:
    return (f"zero_lifetime: the gradient of {name} is sparse ({layout}), and DeepSpeed's ZeRO optimizers "
            f"reduce dense gradients only (stock fails on it). torch.nn.Embedding and "
            f"EmbeddingBag make sparse gradients with sparse=True: build them with sparse=False. The backward "
            f"stops here, as any backward that raises (README, \"A backward that raises\").")


def _reduced_twice_message(name: str, in_leaf_module: bool) -> str:
    head = (f"zero_lifetime: this backward brought the gradient of {name} to DeepSpeed's reduction buckets "
            f"twice, and DeepSpeed reduces a param once per backward (stock fails, or on ZeRO-3 keeps only "
            f"the last share). ")
    if in_leaf_module:
        return head + ("It belongs to a ZeRO-3 leaf module (set_z3_leaf_modules, or chosen by "
                       "stage3_module_granularity_threshold), whose params DeepSpeed reduces from a hook that "
                       "fires once per application of the module: apply such a module once per forward, or "
                       "make its submodules the leaf modules. Nothing of this backward was applied.")
    return head + ("Reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True, or "
                   "deepspeed.checkpointing.checkpoint) does this to a param used in more than one segment, or "
                   "inside one and outside it (a module applied twice, a tied embedding in a checkpointed head): "
                   "each segment accumulates .grad in a backward of its own. Use torch.utils.checkpoint with "
                   "use_reentrant=False (the Trainer's activation_checkpointing_kwargs, formerly "
                   "gradient_checkpointing_kwargs), which accumulates once. Nothing of this backward was applied.")


def _unmanaged_message(names) -> str:
    return (f"zero_lifetime: {len(names)} param(s) require grad but are not managed by the ZeRO optimizer, "
            f"so their gradients would never be reduced or applied: {', '.join(names[:8])}"
            f"{' ...' if len(names) > 8 else ''}. DeepSpeed leaves out params that are frozen "
            f"(requires_grad=False) when deepspeed.initialize runs; unfreeze them before initialize "
            f"(or keep them frozen).")


_ROOT_LEAF_MESSAGE = (
    "zero_lifetime: the model's root module is a ZeRO-3 leaf module (set_z3_leaf_modules on its class, or "
    "stage3_module_granularity_threshold at or above its granularity), so DeepSpeed gathers the whole model at "
    "once and reduces every gradient from one hook on the model's inputs. That hook gets nothing when no input "
    "needs a gradient (stock DeepSpeed then fails in the backward), and a second backward over one forward "
    "leaves its gradients unreduced. Make submodules the leaf modules (the MoE blocks), or lower "
    "stage3_module_granularity_threshold.")


class GradHookGuard:

    def __init__(self, engine, hooks: GradHooks):
        self.hooks = hooks
        self._names = {id(p): n for n, p in engine.module.named_parameters()}
        self._managed = {id(p) for p in self.hooks.managed_params()}
        # Checked after every backward for a gradient: looked up once here, since walking the
        # module tree with parameters() costs more than the rest of the check.
        # Zero-size params are left out: DeepSpeed 0.19.8 drops them from its optimizer (nothing
        # to reduce or apply), and stock trains the model (a device-marker param, an empty head).
        self._unmanaged = [p for p in engine.module.parameters()
                           if id(p) not in self._managed and full_numel(p) != 0]
        unmanaged = [self.name_of(p) for p in self._unmanaged if p.requires_grad]
        if unmanaged:
            raise ValueError(_unmanaged_message(unmanaged))
        if any(module is engine.module for module in self.hooks.leaf_modules()):
            raise ValueError(_ROOT_LEAF_MESSAGE)
        self.reduces_grads_at_boundary = self.hooks.reduces_grads_at_boundary()
        # None were made to recreate: making some would move the reduction into the backward,
        # a path DeepSpeed never takes with this config.
        self.recreated_hooks = deepspeed_hooks_are_dead() and not self.reduces_grads_at_boundary
        if self.recreated_hooks:
            self.hooks.recreate(self._register_kept_alive)
        self._taken = set()  # ids of params a DeepSpeed hook took a gradient of, this backward
        self._added = set()  # ids of params whose finished gradient DeepSpeed bucketed, this backward
        self._entry_patch = self.hooks.wrap_entry(self._on_hook)
        self._leaf_ids = {id(p) for p in self.hooks.leaf_module_params()}
        self._leaf_gate = None

    def run_leaf_hooks_only_when(self, should_run) -> None:
        """DeepSpeed's leaf-module reduction hooks run only when ``should_run()`` (True in a
        pass that accumulates .grad, False in a torch.autograd.grad)."""
        self._leaf_gate = self.hooks.gate_leaf_module_hooks(should_run)

    def _on_hook(self, param) -> bool:
        """Should DeepSpeed's hook take ``param``'s gradient? Not for a param frozen since the
        forward: torch's AccumulateGrad then adds nothing but still runs the param's hooks, and
        DeepSpeed's would reduce the .grad it emptied after the last backward (ZeRO-2 and 3
        fail on None; torch keeps the frozen param's earlier gradient for step())."""
        if not param.requires_grad:
            return False
        self._taken.add(id(param))
        return True

    def refuse_gradients_added_twice(self) -> Patches:
        """From now on, a param's finished gradient added to DeepSpeed's buckets a second time
        before DeepSpeed's epilogue ends that reduction raises (DeepSpeed's own unit: the
        epilogue marks every param unreduced again; a pipeline's reduces outside backwards).
        Returns the patches (``undo()``): made after every other layer that replaces DeepSpeed's
        bucket add, so that they see every add."""
        patches = Patches()
        patches.keep(self.hooks.wrap_bucket_add(self._on_bucket_add))
        patches.keep(after_epilogue(self.hooks.optimizer, self._added.clear))
        return patches

    def _on_bucket_add(self, param) -> None:
        if id(param) in self._added:
            raise GradientReducedTwiceError(_reduced_twice_message(self.name_of(param), id(param) in self._leaf_ids))
        self._added.add(id(param))

    def _register_kept_alive(self, param, hook):
        if USE_POST_ACCUMULATE_HOOK:
            return param.register_post_accumulate_grad_hook(hook)
        # DeepSpeed's own torch < 2.1 branch, plus the reference it dropped. Kept on the
        # optimizer, so the hooks outlive uninstall() like the fix does.
        node = param.expand_as(param).grad_fn.next_functions[0][0]
        handle = node.register_hook(hook)
        self.hooks.keep_alive(node)
        return handle

    def name_of(self, param) -> str:
        """``param``'s name in the engine's module, for messages ("?" if it has none)."""
        return self._names.get(id(param), "?")

    def begin_backward(self, taken_earlier=()) -> None:
        """``taken_earlier``: ids of params whose gradient came before this backward (in the
        engine's forward) and is reduced in it; what DeepSpeed's hooks took of those stays."""
        self._taken = {key for key in self._taken if key in taken_earlier}
        self._added.clear()

    def check_backward(self, got_gradient) -> None:
        """``got_gradient``: the params whose .grad this backward accumulated into."""
        unmanaged = [self.name_of(p) for p in self._unmanaged if p.grad is not None]
        if unmanaged:
            raise GradientsNotReducedError(_unmanaged_message(unmanaged))
        if self.reduces_grads_at_boundary:
            return  # no hook to miss: DeepSpeed reads every managed param's .grad at the boundary
        missed_params = [p for p in got_gradient if id(p) not in self._taken]
        missed = [self.name_of(p) for p in missed_params]
        if missed and self.hooks.leaf_reduction_is_per_forward() and all(id(p) in self._leaf_ids
                                                                          for p in missed_params):
            raise GradientsNotReducedError(
                f"zero_lifetime: this backward produced gradients for {len(missed)} param(s) of ZeRO-3 "
                f"leaf modules (set_z3_leaf_modules) that DeepSpeed did not reduce: {', '.join(missed[:8])}"
                f"{' ...' if len(missed) > 8 else ''}. This DeepSpeed release reduces a leaf module's "
                f"gradients once per forward, so a second pass through one forward (a retained "
                f"backward, or a backward after torch.autograd.grad) is not supported with leaf modules; "
                f"DeepSpeed 0.18.9 and later reduce them in every backward.")
        if missed:
            raise GradientsNotReducedError(
                f"zero_lifetime: this backward produced gradients for {len(missed)} param(s) that no "
                f"DeepSpeed gradient hook received, so no reduction bucket holds them and the step "
                f"would not apply them: {', '.join(missed[:8])}{' ...' if len(missed) > 8 else ''}. "
                f"DeepSpeed's gradient hooks are not firing (were they removed, or registered on "
                f"AccumulateGrad nodes that died, DeepSpeed #7595?).")

    def restore(self) -> None:
        if self._leaf_gate is not None:
            self._leaf_gate.undo()
        self._entry_patch.undo()
