"""A plain ``loss.backward()`` over a forward that did not go through ``engine(...)``.

DeepSpeed (0.18.9, 0.19.8) runs its backward prologue, and divides each gradient by
gradient_accumulation_steps, from hooks that engine.forward puts on the forward's outputs.
A forward through the user's module instead (``engine.module(x)``, or a method of the model
called directly) gets neither. Stock DeepSpeed then reduces nothing and step() fails with
``KeyError: 0``. Installed:

* DeepSpeed's prologue runs at the backward's first gradient if nothing ran it, so such a
  backward is reduced like any other (with GAS 1 it trains like torch).
* With GAS > 1 nothing divided it, and a step would apply its gradients GAS times too large
  (before this check installed engines did, without a word, where the backward opened at a
  param and install ran the prologue). After such a backward, unless one of the engine's
  output hooks handled a gradient in it, the window's gradients are dropped, as by
  zero_grad(), and GradientsNotDividedError is raised.

DeepSpeed's own backwards are left alone: ``engine.backward(loss)`` divides the loss itself
(0.19.8, which also marks the graph, so another engine's backward through this one counts;
on 0.18.9 the installed engine.backward does, adapters/engine_backward_hooked.py), and a
pipeline schedule backwards its stages'
outputs as it means to. 0.17.6 refuses plain backwards at their first gradient.
"""

from .backward_scope import run_after_backward


class GradientsNotDividedError(RuntimeError):
    """A plain backward with gradient_accumulation_steps > 1 that nothing divided by it."""


def _message(gas: int) -> str:
    return (f"zero_lifetime: this loss.backward() reached no output of engine(...) (the forward ran through "
            f"engine.module(...) or a method of the model), so DeepSpeed did not divide its gradients by "
            f"gradient_accumulation_steps={gas}: it does that in the hooks engine(...) puts on its outputs, or "
            f"in engine.backward(loss). A step would have applied them {gas} times too large. Call the model "
            f"through the engine (engine(...)), or backward with engine.backward(loss). Every gradient of "
            f"this accumulation window is dropped, as by zero_grad(): a step() now applies nothing from it.")


class PlainBackwardCheck:

    def __init__(self, engine, backward, drop_window):
        """``backward``: the engine-backward adapter; ``drop_window()`` clears every gradient
        of the accumulation window (the installed engine.zero_grad())."""
        self._engine = engine
        self._backward = backward
        self._drop_window = drop_window
        self._plain = False     # the running backward is not DeepSpeed's own
        self._output_hooks_ran = False  # a DeepSpeed output hook handled a gradient in it
        self.prologue_unsure = False  # read per gradient: whether to check at the next one
        self._patch = backward.note_output_hooks_ran(self._note_output_hook)

    def begin(self, entry_hooks_missing: bool) -> None:
        """A backward that accumulates starts. ``entry_hooks_missing``: it was entered through
        the outputs of a forward that has no DeepSpeed output hooks (one that bypassed
        engine.forward), so nothing may run DeepSpeed's prologue before its first gradient."""
        self._plain = not self._backward.engine_backward_running()
        self._output_hooks_ran = False
        self.prologue_unsure = self._plain and entry_hooks_missing

    def before_first_gradient(self) -> None:
        """Before DeepSpeed's hooks see the backward's first param gradient."""
        self.prologue_unsure = False
        # A DeepSpeed forward our wrapper did not see (a subclass's super().forward) has
        # output hooks that ran the prologue by now: only where none did, run it.
        if self._backward.prologue_pending():
            self._backward.run_prologue()

    def _note_output_hook(self) -> None:
        self._output_hooks_ran = True

    def end(self) -> None:
        """The backward's own end, before DeepSpeed's epilogue (queued after ours)."""
        gas = self._engine.gradient_accumulation_steps()
        if not self._plain or self._output_hooks_ran or gas == 1:
            return

        def fail():
            self._drop_window()
            raise GradientsNotDividedError(_message(gas))

        # After DeepSpeed's epilogue, so the error leaves its state complete.
        run_after_backward(fail)

    def restore(self) -> None:
        self._patch.undo()
