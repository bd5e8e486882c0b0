"""Why a backward found its graph stale, when accelerate's backward() took the step.

accelerate's DeepSpeed wrapper (``accelerator.backward``) runs ``engine.backward(loss)`` and then
``engine.step()`` whenever gradients sync: every backward at ``gradient_accumulation_steps`` 1.
So a training step written for plain torch, ``accelerator.backward(first, retain_graph=True)``
then ``accelerator.backward(second)``, steps between its two backwards, and the second runs
through a graph saved before the weights changed. Installed engines refuse that as torch
refuses a param modified in place; the error alone does not say that the step() was
accelerate's, which the note added here does. On ZeRO-3 the tracker's refusal carries it in
its message, so a second backward through ``loss.backward()`` gets it too; on ZeRO-1/2 that
refusal is torch's own, and only ``engine.backward`` adds the note.
"""

import sys

_WRAPPER_MODULE = "accelerate.utils.deepspeed"
_FRAMES_UP = 6  # accelerate's backward -> engine.step (patched) -> ... : a few frames at most

HINT = ("accelerate's backward() also calls engine.step() whenever gradients sync (every backward at "
        "gradient_accumulation_steps 1), so an earlier accelerator.backward(..., retain_graph=True) over this "
        "forward already stepped. Backward the earlier losses with engine.backward(loss, retain_graph=True) or "
        "loss.backward(retain_graph=True) and only the last one through accelerator.backward(), or backward "
        "their sum once.")

# What the refusal says: the tracker's (ZeRO-3) and torch's own (ZeRO-1/2, versions bumped at step()).
_STALE_GRAPH_MESSAGES = ("by an optimizer step() after the forward", "modified by an inplace operation")


def step_called_by_accelerate_backward() -> bool:
    """Whether accelerate's DeepSpeed backward() is among the callers of the running step()."""
    if _WRAPPER_MODULE not in sys.modules:
        return False
    frame = sys._getframe(1)
    for _ in range(_FRAMES_UP):
        if frame is None:
            return False
        if frame.f_code.co_name == "backward" and frame.f_globals.get("__name__") == _WRAPPER_MODULE:
            return True
        frame = frame.f_back
    return False


def add_hint_if_stale_graph(error: BaseException) -> None:
    if not isinstance(error, RuntimeError):
        return
    message = str(error)
    # ZeRO-3's tracker says it in its refusal already (raised inside autograd, where it is the
    # only way to reach a loss.backward() caller).
    if HINT not in message and any(stale in message for stale in _STALE_GRAPH_MESSAGES):
        error.add_note(HINT)
