"""Saved-tensor hooks in force around an installed ZeRO-3 forward stay in force for what the
lifetime tracker does not track.

Activation offloading works through saved-tensor hooks: torch's ``save_on_cpu()``, TRL's
``activation_offloading``, hooks of one's own. Torch applies only the innermost pair, and the
tracker's pair is pushed around the engine's forward. Without chaining, an outer pair saw no
tensor the model saved: activations that stock DeepSpeed offloaded to the CPU stayed in device
memory once installed, silently. Chained, the tracker keeps the params (their release and
gather are its job) and gives every other tensor to the outer pair, as stock DeepSpeed does.
"""

import torch


class _PackedByOuter:
    """What the outer pack hook made of a tensor, told apart from the tracker's own handles."""

    __slots__ = ("payload", )

    def __init__(self, payload):
        self.payload = payload


def hooks_in_force():
    """The (pack, unpack) pair that applies now, or None. (True: also while Dynamo traces,
    which defers the hooks to run time, as AOTAutograd's own lookup does.)"""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def chained_with(tracker, outer):
    """A (pack, unpack) pair: the tracker's for params, ``outer``'s for everything else."""
    tracker_pack, tracker_unpack = tracker.pack, tracker.unpack
    outer_pack, outer_unpack = outer

    def pack(tensor):
        packed = tracker_pack(tensor)
        if isinstance(packed, torch.Tensor):  # not a param: the tracker handed it back
            return _PackedByOuter(outer_pack(tensor))
        return packed

    def unpack(packed):
        if type(packed) is _PackedByOuter:
            return outer_unpack(packed.payload)
        return tracker_unpack(packed)

    return pack, unpack
