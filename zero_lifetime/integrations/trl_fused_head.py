"""TRL's fused LM head on an installed ZeRO-3 engine (TRL 1.16's GRPO trainer scores every
completion with it, ``add_fused_lm_head``).

TRL's chunked log-prob autograd Function saves the LM head's weight and, in its backward, asks
``trl.trainer.utils.maybe_gather_lm_head_ctx(weight, bias)`` to gather whatever ZeRO-3
released, reading ``ds_status`` off the tensors it saved. zero_lifetime tracks saved params
with saved-tensor hooks, and under any such hooks torch hands a backward a new tensor object,
never the saved Parameter: it has no ``ds_status``, and the backward failed with
``AttributeError``. That tensor is also gathered already: the tracker gathers a released param
when its saved tensor is unpacked. So while an installed ZeRO-3 engine exists, TRL's function
passes over tensors that are not ZeRO-3 params and gathers the rest as before; the last such
engine to go puts TRL's function back. TRL is patched only once it is imported (by a TRL
trainer, before its train() builds the engine): zero_lifetime never imports it.
"""

import inspect
import sys
import threading
import warnings
import weakref

_MODULE = "trl.trainer.utils"
_NAME = "maybe_gather_lm_head_ctx"

_lock = threading.RLock()  # a collection inside a locked block may run _let_go in this thread
_holds = set()  # one token per hold not let go yet
_original = None
_patched = None
# A settle running in this thread: a finalizer that a collection runs inside it only drops its
# token, and leaves the function alone (the settle ends holding it, so nothing is to be put
# back). Per thread: another thread's finalizer waits for the lock and then sees the holds.
_settling = threading.local()


def _gathers_zero3_params_only(original):

    def maybe_gather_lm_head_ctx(*params):
        # Without ds_status a tensor is no ZeRO-3 param: a saved one, unpacked already gathered.
        return original(*(p for p in params if p is None or hasattr(p, "ds_status")))

    maybe_gather_lm_head_ctx.__wrapped__ = original
    maybe_gather_lm_head_ctx.__doc__ = original.__doc__
    return maybe_gather_lm_head_ctx


def _takes_params_only(function) -> bool:
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind is inspect.Parameter.VAR_POSITIONAL


def _let_go(token) -> None:
    """A hold ends; with none left, TRL's function is put back, unless it was replaced since."""
    global _original, _patched
    _holds.discard(token)
    if getattr(_settling, "active", False):
        return
    with _lock:
        if _holds:
            return
        module = sys.modules.get(_MODULE)
        if module is not None and _patched is not None and getattr(module, _NAME, None) is _patched:
            setattr(module, _NAME, _original)
        _original = _patched = None


class TrlFusedHead:
    """One installed ZeRO-3 engine's hold on the patch, let go at ``release()`` or when the
    installation is garbage (an engine dropped without destroy()). ``settled``: TRL was found
    imported (patched, or it has no fused head); until then ``settle_if_trl_imported`` looks
    again."""

    def __init__(self):
        self.settled = False
        self._hold = None  # a finalizer that lets go once

    def settle_if_trl_imported(self) -> None:
        global _original, _patched
        module = sys.modules.get(_MODULE)
        if module is None or self._hold is not None:
            return
        self.settled = True
        with _lock:
            _settling.active = True
            try:
                current = getattr(module, _NAME, None)
                if current is None:
                    return  # a TRL without the fused LM head
                if current is not _patched:  # not patched yet, or replaced since (a reload, a stand-in)
                    if not _takes_params_only(current):
                        warnings.warn(f"zero_lifetime: {_MODULE}.{_NAME} is not the function of TRL 1.16 "
                                      "(params only); left as it is. TRL's fused LM head may then fail in its "
                                      "backward with AttributeError: 'Tensor' object has no attribute 'ds_status'.",
                                      RuntimeWarning, stacklevel=2)
                        return
                    _original, _patched = current, _gathers_zero3_params_only(current)
                    setattr(module, _NAME, _patched)
                token = object()
                _holds.add(token)
                self._hold = weakref.finalize(self, _let_go, token)
                self._hold.atexit = False  # nothing to put back for a process that ends
            finally:
                _settling.active = False

    def release(self) -> None:
        if self._hold is not None:
            self._hold()  # runs _let_go at most once, here or at garbage collection
