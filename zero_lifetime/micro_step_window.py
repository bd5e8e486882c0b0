"""No gradient lost across the micro-steps of one gradient-accumulation window.

Multi-task training (one backward per task, each task with its own head, GAS = the
number of tasks) is where DeepSpeed (0.19.8 and 0.17.6) goes wrong: a head that gets a
gradient only in its own micro-step either adds to the previous window's stale gradient
(ZeRO-3, and ZeRO-1/2 with CPU offload) or, with CPU offload, never reaches the optimizer. This
tracks which params got a gradient in the window and in the running backward, clears
stale accumulators on a param's first gradient of the window, and at the boundary runs
DeepSpeed's own offload copy for the params the boundary backward did not touch.

A param with no gradient in a window must not move (torch leaves its .grad None), but
DeepSpeed keeps what its stores held from an earlier window and step() applies it again:
ZeRO-3, and ZeRO-1/2 with offload, on 0.19.8 and 0.17.6 alike. Before each step the
stores of such params are zeroed. zero_grad() ends the window, as torch's does.
"""

from .adapters.grad_window import GradWindowAdapter

BACKWARD_AFTER_INSTALL_MID_STEP = (
    "zero_lifetime: install() came between a backward and its step() (to DeepSpeed, a torch.autograd.grad through "
    "the engine is one too), and DeepSpeed now holds gradients that are either that backward's or stale ones a "
    "stock engine.zero_grad() left (it clears only param.grad): the two cannot be told apart, so this backward "
    "could not be added to them right. Before this backward, call engine.step() to apply them (at the "
    "accumulation boundary) or engine.zero_grad() to drop them; or install before the first backward.")


class MicroStepWindow:

    def __init__(self, optimizer, stage: int, params, begun_before_install: bool = False):
        """``begun_before_install``: DeepSpeed holds gradients a backward before install left for
        step() (or stale ones a stock zero_grad() left), which no step() has taken yet."""
        self.adapter = GradWindowAdapter(optimizer, stage)
        self._params = list(params)
        # Params whose stores may hold a gradient: all of them until the first step
        # (install may come after steps), then those that got one since the last.
        self._maybe_holding = {id(p) for p in self._params}
        # Params with a gradient since the window began (by id). Which ones a backward before
        # install reached is recorded nowhere: step() keeps every param's stores then.
        self._in_window = set(self._maybe_holding) if begun_before_install else set()
        self._begun_before_install = begun_before_install
        self._this_backward = {}       # id -> param, for the running backward
        self._reached_window_sums = False  # the running backward reached a param the window had reached
        self._first_backward = True
        # On top of Zero12Accumulation's wrapper where there is one; undone in reverse.
        self._epilogue_patch = self.adapter.wrap_epilogue(self._epilogue)
        self._undo_stage1_patch = self.adapter.patch_stage1_boundary(lambda p: id(p) in self._this_backward)

    def refuse_backward_if_begun_before_install(self) -> None:
        """Called as a backward that accumulates starts, before anything changes."""
        if self._begun_before_install:
            raise RuntimeError(BACKWARD_AFTER_INSTALL_MID_STEP)

    def begin_backward(self) -> None:
        self._first_backward = self.adapter.first_backward_of_window()
        if self._first_backward:
            self._in_window.clear()
        self._this_backward = {}
        self._reached_window_sums = False

    def note_gradient(self, param) -> None:
        """A gradient for ``param`` is about to be accumulated (before DeepSpeed's hook)."""
        if self.adapter.gradient_held_back(param):
            # Reduced whole by a later backward (DeepSpeed's tiled compute): noted there, where
            # the micro step, and so whether its accumulator is overwritten, is that backward's.
            return
        key = id(param)
        if key in self._this_backward:
            return
        self._this_backward[key] = param
        if key in self._in_window:
            self._reached_window_sums = True
        else:
            self._in_window.add(key)
            self._maybe_holding.add(key)
            if not self._first_backward:
                self.adapter.clear_stale_accumulator(param)

    def reached_in_window(self, param) -> bool:
        """Did ``param`` get a gradient since the window began?"""
        return id(param) in self._in_window

    def params_this_backward(self):
        return list(self._this_backward.values())

    def reached_window_sums(self) -> bool:
        """Did the running backward reach a param that an earlier backward of the window had?"""
        return self._reached_window_sums

    def grads_cleared(self) -> None:
        """zero_grad(): what the window gathered so far is gone."""
        self.adapter.forget_window()
        self._in_window.clear()
        self._begun_before_install = False

    def before_step(self) -> None:
        """At a boundary step: zero the stale stores of params with no gradient in the window."""
        self._begun_before_install = False
        if not self.adapter.keeps_gradients_across_windows:
            return
        stale = self._maybe_holding - self._in_window  # set arithmetic: this runs every step
        if stale:
            self.adapter.discard_gradients([p for p in self._params if id(p) in stale])
        self._maybe_holding = set(self._in_window)

    def _epilogue(self, original, *args, **kwargs):
        result = original(*args, **kwargs)
        if self.adapter.epilogue_drops_frozen_gradients:
            # A param frozen between two backwards keeps the earlier ones' gradient, as in torch.
            frozen = [p for p in self._params if not p.requires_grad and id(p) in self._in_window]
            if frozen:
                self.adapter.keep_gradients_of_frozen(frozen)
        if self.adapter.offload and self.adapter.at_boundary():
            missed = [p for p in self._params if id(p) in self._in_window and id(p) not in self._this_backward]
            self.adapter.finalize_offloaded(missed)
        return result

    def restore(self) -> None:
        if self._undo_stage1_patch is not None:
            self._undo_stage1_patch()
        self.adapter.restore()
        self._epilogue_patch.undo()
