"""ZeRO-1/2 without offload: summing several backwards before one step().

The boundary epilogue rebuilds the reduced partitions (``averaged_gradients``) from the
running backward alone. ``take`` keeps copies of them before another backward and
``add_back`` adds those copies after its epilogue: the reduction is linear, so the sum
of reduced partitions is the reduced sum.

Muon param groups are the exception: their partitions hold Muon's update, which is not
linear in the gradient; ``Zero12MuonCarry`` has the epilogue run Muon on the raw sum instead.

Groups DeepSpeed 0.19.8 accumulates in fp32 while their params are in another dtype (bf16 or
fp16 with ``data_types.grad_accum_dtype: "fp32"``, or an fp64 model, whose accumulation dtype
is the fp32 default) need nothing kept: every reduction adds into one flat fp32 partition
("compact grad partition buffer") that lives until step(), so it sums further backwards itself.
"""

from .errors import require
from .zero12_muon_carry import Zero12MuonCarry, muon_rewritten_groups


# 0.19.8; 0.17.6 and 0.18.9 rebuild every group's partitions from the running backward.
_SUMS_IN_FP32_PARTITION = "_use_compact_grad_partition_buffer"


def groups_summing_backwards(optimizer) -> frozenset:
    """The param groups whose reduced gradients DeepSpeed itself sums over the backwards
    before step() (fixed at init: it depends on the dtypes and on Muon only)."""
    sums_in_fp32_partition = getattr(optimizer, _SUMS_IN_FP32_PARTITION, None)
    if sums_in_fp32_partition is None:
        return frozenset()
    groups = require(optimizer, "bit16_groups", "the ZeRO-1/2 param groups")
    return frozenset(group for group in range(len(groups)) if sums_in_fp32_partition(group))


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
        self._summed_by_deepspeed = groups_summing_backwards(optimizer)

    def holds_reduced_gradients(self) -> bool:
        """A boundary epilogue built partitions that no step() or zero_grad() has taken since."""
        return any(tensors is not None for tensors in self.optimizer.averaged_gradients.values())

    def take(self, reached):
        """Before another backward of the same step: copies of the reduced partitions (the
        boundary epilogue rebuilt them, with zeros for a param not ``reached``)."""
        built = {group: tensors for group, tensors in self.optimizer.averaged_gradients.items()
                 if tensors is not None and group not in self._summed_by_deepspeed}
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
