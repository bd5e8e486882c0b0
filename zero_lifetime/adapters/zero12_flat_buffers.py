"""ZeRO-1/2's flat 16-bit param buffers (stage_1_and_2.py).

DeepSpeed 0.18.9 builds each group's flat buffer (``bit16_groups_flat``) by concatenating
the params in grad mode, so the buffer and its per-rank partitions
(``parallel_partitioned_bit16_groups``) are autograd outputs (CatBackward, views of it).
``step()`` then all-gathers the updated partitions into that buffer, and with gloo (torch
2.13) the write is refused: "Output 0 of Split is a view and is being modified inplace".
Stock 0.18.9 ZeRO-1/2 therefore fails at the first ``step()`` on 2 or more CPU ranks
(measured); 0.19.8 builds the buffer outside autograd.

``detach_flat_buffers`` swaps in detached aliases: the same storage (the params' data stay
views of it), no autograd history. Kept after ``restore()``: the history is never wanted.
"""

from .errors import require


def detach_flat_buffers(optimizer) -> int:
    """Detach every flat buffer that carries autograd history; returns how many did."""
    flats = require(optimizer, "bit16_groups_flat", "the ZeRO-1/2 flat 16-bit param buffers")
    partitions = require(optimizer, "parallel_partitioned_bit16_groups", "the ZeRO-1/2 per-rank param partitions")
    detached = 0
    for group, flat in enumerate(flats):
        if not flat.requires_grad:
            continue
        flats[group] = flat.detach()
        partitions[group] = [partition.detach() for partition in partitions[group]]
        detached += 1
    return detached
