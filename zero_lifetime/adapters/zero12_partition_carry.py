"""ZeRO-1/2 without offload: summing several backwards before one step().

The boundary epilogue rebuilds the reduced partitions (``averaged_gradients``) from the
running backward alone. ``take`` keeps copies of them before another backward and
``add_back`` adds those copies after its epilogue: the reduction is linear, so the sum
of reduced partitions is the reduced sum.

Not with DeepSpeed's Muon optimizer: ``get_flat_partition`` writes Muon's update (the
momentum, orthogonalised by Newton-Schulz) into the partitions of params tagged
``use_muon``, and that is not linear in the gradient. Summing two backwards' updates
trains off torch (measured: 0.017 after 3 steps, 1 rank), so ``take`` refuses them.
"""

from .errors import require

MUON_SECOND_BACKWARD_MESSAGE = (
    "zero_lifetime: a second backward before step() is not supported with DeepSpeed's Muon optimizer on ZeRO-1/2 "
    "without CPU optimizer offload: at the accumulation boundary DeepSpeed turns each backward's reduced gradients "
    "into Muon's update (Newton-Schulz on the momentum), and the updates of two backwards are not the update of "
    "their summed gradients. Sum the losses into one backward, call engine.zero_grad() between the backwards, or "
    "use CPU optimizer offload (where Muon runs in step(), on the summed gradients).")


def muon_rewritten_groups(optimizer) -> set:
    """Param groups whose boundary partitions DeepSpeed fills with Muon's update: ones with
    params tagged ``use_muon``, under an optimizer whose class name says Muon (its own test in
    ``get_flat_partition``, 0.17.6 to 0.19.8)."""
    inner = getattr(optimizer, "optimizer", None)
    if "muon" not in type(inner).__name__.lower():
        return set()
    groups = require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups")
    return {i for i, group in enumerate(groups) if any(getattr(p, "use_muon", False) for p in group)}


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
        self._muon_groups = muon_rewritten_groups(optimizer)

    def take(self, reached):
        """Before another backward of the same step: copies of the reduced partitions (the
        boundary epilogue rebuilt them, with zeros for a param not ``reached``)."""
        built = {group: tensors for group, tensors in self.optimizer.averaged_gradients.items() if tensors is not None}
        if self._muon_groups & built.keys():
            raise NotImplementedError(MUON_SECOND_BACKWARD_MESSAGE)
        return {group: [t.detach().clone() for t in tensors] for group, tensors in built.items()}

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
