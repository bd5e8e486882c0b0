"""torch's ``Module.zero_grad()`` on an installed engine's model clears what DeepSpeed holds.

Installed, two backwards sum as in torch, and that sum lives in DeepSpeed's partitions, not in
``param.grad`` (which DeepSpeed empties after every backward). Clearing ``.grad`` alone, as
``Module.zero_grad()`` does, would leave the first backward in the sum. ``engine.zero_grad()``
(the engine's own method) is patched per instance; a model's ``zero_grad`` is not: an attribute
on the model would travel with ``copy.deepcopy(model)`` and clear the original engine from the
copy. So while an engine is installed, ``torch.nn.Module.zero_grad`` itself is wrapped and asks
each installation about the params it clears; it is put back when the last installation goes.
"""

import threading
import weakref

import torch

PARTIAL_CLEAR_MESSAGE = (
    "zero_lifetime: zero_grad() on a part of the model ({cleared} of its {total} trainable params) while "
    "DeepSpeed holds their gradients from a backward since the last step(). Installed, backwards sum as in "
    "torch, and DeepSpeed keeps that sum in its partitions, where only all of it can be dropped: clear "
    "every gradient (engine.zero_grad(), the optimizer's zero_grad() or the whole model's), or step() first. "
    "Nothing was cleared.")

_lock = threading.Lock()
_installations = weakref.WeakSet()  # each asked before any Module.zero_grad() clears
_original = None  # torch.nn.Module.zero_grad while wrapped


def _zero_grad(module, *args, **kwargs):
    installations = list(_installations)
    if installations:
        param_ids = {id(p) for p in module.parameters()}
        for installation in installations:
            installation.before_module_zero_grad(param_ids)
    return _original(module, *args, **kwargs)


def register(installation) -> None:
    """``installation.before_module_zero_grad(param_ids)`` runs before every Module.zero_grad()."""
    global _original
    with _lock:
        _installations.add(installation)
        if _original is None:
            _original = torch.nn.Module.zero_grad
            torch.nn.Module.zero_grad = _zero_grad


def unregister(installation) -> None:
    global _original
    with _lock:
        _installations.discard(installation)
        # Left in place (passing through) if something wrapped it after us: theirs stays.
        if not _installations and _original is not None and torch.nn.Module.zero_grad is _zero_grad:
            torch.nn.Module.zero_grad = _original
            _original = None
