"""The reservation half of the fused bucket fill, shared by ZeRO-1/2 and ZeRO-3.

A gradient hook only reserves the gradient's slice of the bucket buffer; one fused
``ops.bucket_fill`` copies every reserved gradient when the bucket is flushed, and each
gradient is then re-pointed at its slice, which is where DeepSpeed's per-param copy
leaves it. What differs per stage (streams, when to flush) stays with the callers.
"""

from . import ops


class Reservations:
    """Gradients (or, for ZeRO-3, params whose .grad is read at the flush) reserved in one bucket."""

    __slots__ = ("items", "offsets", "numel")

    def __init__(self):
        self.items, self.offsets = [], []
        self.numel = 0

    def reserve(self, item, offset: int, numel: int) -> None:
        self.items.append(item)
        self.offsets.append(offset)
        self.numel += numel


def fill_and_repoint(buffer, grads, offsets, scale: float = 1.0, before_repoint=None) -> None:
    """One fused fill of ``grads`` into ``buffer`` at ``offsets``, then each gradient's
    data becomes its slice. ``before_repoint(grad)`` runs while the old storage is still held."""
    ops.bucket_fill(buffer, grads, offsets, scale)
    if before_repoint is not None:
        for grad in grads:
            before_repoint(grad)
    ops.repoint_to_slices(buffer, grads, offsets)
