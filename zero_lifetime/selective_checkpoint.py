"""ZeRO-3's gathers and releases run outside torch's selective activation checkpointing.

torch's selective checkpoint (``torch.utils.checkpoint`` with a ``context_fn`` made by
``create_selective_checkpoint_contexts``) records every op its region runs in the forward, by
op and count, and its recompute in the backward must meet the same ops again. DeepSpeed's
ZeRO-3 module hooks run inside the region. The gathers and releases they make depend on
DeepSpeed's recorded trace, so the recompute's differ from the forward's once one forward went
without its backward (a skipped batch, a graph dropped after a retained backward): that
backward and every later one fail ("aten.empty.memory_format encountered during backward but
not found in storage"), stock. Run outside the checkpoint's dispatch modes, the hooks' ops are
not the region's: it records and recomputes the model's own ops only.
"""

import warnings

import torch
import torch.utils.checkpoint

from .never_traced import never_traced

try:  # torch's private names for it, only here (torch >= 2.4 has selective checkpointing)
    from torch._C import _len_torch_dispatch_stack
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    _CHECKPOINT_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
except ImportError:
    _CHECKPOINT_MODES = ()

_NAMES_MOVED = (
    "zero_lifetime: this torch has selective activation checkpointing, but not the private names "
    "zero_lifetime keeps ZeRO-3's gathers out of its regions with (zero_lifetime/selective_checkpoint.py): "
    "under selective checkpointing, a forward without its backward breaks every later backward, as stock. "
    "Full activation checkpointing is unaffected.")


def _inside_selective_checkpoint() -> bool:
    # Runs twice per module per forward: an empty mode stack (nearly always) is told by one
    # C call, without building the list of modes.
    return _len_torch_dispatch_stack() != 0 and any(
        isinstance(mode, _CHECKPOINT_MODES) for mode in _get_current_dispatch_mode_stack())


def _outside_selective_checkpoint(original, module):
    if _inside_selective_checkpoint():
        # Every mode is off, the checkpoint's and any other (a FLOP counter): the hooks'
        # gathers and releases are no op of the model's.
        with _disable_current_modes():
            return original(module)
    return original(module)


def keep_module_hooks_outside(deepspeed_module_hooks):
    """Wrap DeepSpeed's per-module gather and release (``adapters.zero3_module_hooks``).
    Returns the patches, or None where torch has no selective checkpointing (or, with a
    warning, where its private names moved)."""
    if not _CHECKPOINT_MODES:
        if hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
            warnings.warn(_NAMES_MOVED, RuntimeWarning, stacklevel=3)
        return None
    return deepspeed_module_hooks.wrap_forward_functions(never_traced(_outside_selective_checkpoint))
