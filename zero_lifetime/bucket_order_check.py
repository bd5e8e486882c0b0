"""ZeRO-1/2: every rank reduces the same gradients in the same bucket layout, or the backward says so.

DeepSpeed lays an IPG bucket out in the order gradients arrive on each rank, then reduces
the buckets slot by slot across ranks. When ranks run their modules in different orders,
or give gradients to different params (tasks sampled per rank, routing), same-sized
buckets reduce different params into each other and training goes on, silently wrong;
different sizes abort the collective or hang it. ZeRO-3 compares its traces across ranks;
ZeRO-1/2 compare nothing.

Each reduction notes its buckets' layouts; after the backward's epilogue (its last
reduction) one all-reduce of a fingerprint of the backward's layouts compares them. On a
mismatch every rank drops the window's gradients, as zero_grad() would (the mixed sums
cannot be told apart from the earlier micro-steps' they were added to), and raises (none
is left waiting), naming the first params that differ. Buckets of different sizes on
different ranks usually fail inside DeepSpeed's collective before this check (gloo aborts;
NCCL may wait until its timeout); the check catches the silent case.
"""

import zlib

import torch
import torch.distributed as dist

from .backward_scope import run_after_backward

_FINGERPRINT_MASK = (1 << 62) - 1  # so that its negation fits in int64 too


class RanksDisagreeError(RuntimeError):
    """Data-parallel ranks reduced different gradients, or the same ones in a different order."""


class BucketOrderCheck:

    def __init__(self, buckets, named_params, on_mismatch):
        """``on_mismatch()`` drops the mixed sums before the error is raised."""
        self.buckets = buckets
        self._on_mismatch = on_mismatch
        self.group = buckets.data_parallel_group()
        self.world_size = buckets.data_parallel_world_size()
        self._names = buckets.param_names(named_params)
        self._layouts = []  # (dtype name, entries) per reduced bucket, this backward
        self.checks = 0

    def note_reduction(self, dtypes) -> None:
        """Before DeepSpeed reduces the buckets of ``dtypes``."""
        self._layouts.extend(self.buckets.layouts(dtypes))

    def forget(self) -> None:
        """A backward died: what it reduced is not compared."""
        self._layouts = []

    def check(self) -> None:
        """After the epilogue, on every rank: one all-reduce of 16 bytes."""
        layouts, self._layouts = self._layouts, []
        # hash() of ints and tuples of ints is the same in every process (str's is salted per process).
        fingerprint = hash(tuple((zlib.crc32(dtype.encode()), entries) for dtype, entries in layouts))
        fingerprint &= _FINGERPRINT_MASK
        extremes = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64,
                                device=self.buckets.collective_device())
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        self.checks += 1
        highest, negated_lowest = extremes.tolist()
        if highest == -negated_lowest:
            return
        # Every rank saw the same extremes, so every rank is here: gathering cannot hang.
        per_rank = [None] * self.world_size
        dist.all_gather_object(per_rank, layouts, group=self.group)
        error = RanksDisagreeError(self._message(per_rank))

        def fail():
            self._on_mismatch()
            raise error

        # Raised inside DeepSpeed's epilogue, the error would skip the rest of it (exit_backward:
        # the next plain backward would then get no epilogue at all).
        run_after_backward(fail)

    def _message(self, per_rank) -> str:
        orders = [self._order(layouts) for layouts in per_rank]
        first = orders[0]
        lines = []
        for rank, order in enumerate(orders[1:], start=1):
            if order == first:
                continue
            at = next((k for k, (a, b) in enumerate(zip(first, order)) if a != b), min(len(first), len(order)))
            lines.append(f"  rank 0 and rank {rank} differ at gradient {at} of {len(first)} and {len(order)}: "
                         f"rank 0 has {self._around(first, at)}, rank {rank} has {self._around(order, at)}")
        if not lines:  # the same gradients in the same order, split into buckets differently
            sizes = [[len(entries) for _, entries in layouts] for layouts in per_rank]
            lines.append(f"  the same gradients in the same order, in buckets of different lengths: {sizes}")
        return ("zero_lifetime: the data-parallel ranks reduced different gradients in this backward, or the "
                "same ones in a different order. DeepSpeed ZeRO-1/2 lays each gradient bucket out in the order "
                "gradients arrive and reduces the buckets slot by slot across ranks, so the reduction would "
                "have added different params' gradients together. Every gradient of this accumulation window is "
                "dropped, as by zero_grad(): a step() now applies nothing from it.\n" + "\n".join(lines) +
                "\nRun the same modules in the same order on every rank; a param that gets no gradient on some "
                "rank must get one on every rank (e.g. add 0 * its output to the loss). To turn this check "
                'off: install(engine, check_bucket_order=False) or "check_bucket_order": false.')

    def _order(self, layouts):
        return [(dtype, entry[2]) for dtype, entries in layouts for entry in entries]

    def _around(self, order, at) -> str:
        shown = [f"{self._names.get(pid, f'param id {pid}')} ({dtype})" for dtype, pid in order[at:at + 3]]
        return ", ".join(shown) + (" ..." if len(order) > at + 3 else "") if shown else "nothing more"
