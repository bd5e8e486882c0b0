"""ZeRO-1/2 without offload: summing several backwards before one step().

The boundary epilogue rebuilds the reduced partitions (``averaged_gradients``) from the
running backward alone. ``take`` keeps copies of them before another backward and
``add_back`` adds those copies after its epilogue: the reduction is linear, so the sum
of reduced partitions is the reduced sum.

Muon param groups are the exception: their partitions hold Muon's update, which is not
linear in the gradient; ``Zero12MuonCarry`` has the epilogue run Muon on the raw sum instead.
"""

from .errors import require
from .zero12_muon_carry import Zero12MuonCarry, muon_rewritten_groups


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
        muon_groups = muon_rewritten_groups(optimizer)
        self._muon = Zero12MuonCarry(optimizer, muon_groups) if muon_groups else None

    def holds_reduced_gradients(self) -> bool:
        """A boundary epilogue built partitions that no step() or zero_grad() has taken since."""
        return any(tensors is not None for tensors in self.optimizer.averaged_gradients.values())

    def take(self, reached):
        """Before another backward of the same step: copies of the reduced partitions (the
        boundary epilogue rebuilt them, with zeros for a param not ``reached``)."""
        built = {group: tensors for group, tensors in self.optimizer.averaged_gradients.items() if tensors is not None}
        if self._muon is not None:
            self._muon.take(self._muon.groups & built.keys())
            built = {group: tensors for group, tensors in built.items() if group not in self._muon.groups}
        return {group: [t.detach().clone() for t in tensors] for group, tensors in built.items()}

    def add_back(self, kept) -> None:
        """After that backward's epilogue."""
        if self._muon is not None:
            self._muon.backward_ended()
        averaged = self.optimizer.averaged_gradients
        for group, earlier in kept.items():
            current = averaged.get(group)
            if current is None:
                continue
            for now, before in zip(current, earlier):
                now.add_(before)

    def put_back(self, kept) -> None:
        """That backward died before its epilogue: the partitions still hold the earlier sum."""
        if self._muon is not None:
            self._muon.backward_ended()

    def step_done(self, skipped: bool = False) -> None:
        """``skipped``: step() ran at the boundary and skipped the update (an fp16 overflow)."""
        if self._muon is not None:
            self._muon.step_done(skipped)

    def discard(self) -> None:
        """zero_grad() before step()."""
        if self._muon is not None:
            self._muon.discard()

    def restore(self) -> None:
        if self._muon is not None:
            self._muon.restore()
