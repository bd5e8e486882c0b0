"""ZeRO-1/2 without offload: summing several backwards before one step().

The boundary epilogue rebuilds the reduced partitions (``averaged_gradients``) from the
running backward alone. ``take`` keeps copies of them before another backward and
``add_back`` adds those copies after its epilogue: the reduction is linear, so the sum
of reduced partitions is the reduced sum.
"""

from .errors import require


def carry_for(optimizer):
    """Where the earlier backwards' sum lives: the fp32 gradients with CPU offload, else the
    reduced partitions."""
    if require(optimizer, "cpu_offload", "the ZeRO-1/2 CPU offload flag"):
        from .zero12_offload_carry import Zero12OffloadCarry
        return Zero12OffloadCarry(optimizer)
    return Zero12PartitionCarry(optimizer)


class Zero12PartitionCarry:

    def __init__(self, optimizer):
        self.optimizer = optimizer
        require(optimizer, "averaged_gradients", "the ZeRO-1/2 reduced gradient partitions")

    def take(self, reached):
        """Before another backward of the same step: copies of the reduced partitions (the
        boundary epilogue rebuilt them, with zeros for a param not ``reached``)."""
        return {
            group: [t.detach().clone() for t in tensors]
            for group, tensors in self.optimizer.averaged_gradients.items() if tensors is not None
        }

    def add_back(self, kept) -> None:
        """After that backward's epilogue."""
        averaged = self.optimizer.averaged_gradients
        for group, earlier in kept.items():
            current = averaged.get(group)
            if current is None:
                continue
            for now, before in zip(current, earlier):
                now.add_(before)

    def put_back(self, kept) -> None:
        """That backward died before its epilogue: the partitions still hold the earlier sum."""
