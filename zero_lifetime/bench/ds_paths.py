"""The DeepSpeed code paths behind `bucket` and `gather`, stock vs installed, on one rank.

The kernel-level rows of those benchmarks time copy patterns on bare tensors. The cases
here call DeepSpeed's own methods instead:

* bucket: ``reduce_independent_p_g_buckets_and_remove_grads`` (the per-param bucket
  fill) on a real ZeRO-2 engine's optimizer, stock vs an identical engine with
  ``zero_lifetime.install`` (its reserving hook, then the fused fill that runs before
  the bucket is reduced: ``Zero12BucketFill.flush_pending``).
* gather: ``AllGatherCoalescedHandle.wait`` on hand-built handles over a rank-major
  gathered buffer (one rank has nothing to all-gather), vs ``Zero3FusedCopies.wait``.

Everything a call consumes (bucket state, gradients, param status, the handle) is put
back untimed before each call; both ways are checked once to produce the same values.
The caller runs :func:`engines.prepare_process` first.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from .timing import interleave

BUCKET_STOCK = "DeepSpeed reduce_independent_p_g_buckets_and_remove_grads (stock)"
BUCKET_OURS = "zero_lifetime hooks + fused fill"
GATHER_STOCK = "DeepSpeed AllGatherCoalescedHandle.wait (stock)"
GATHER_OURS = "zero_lifetime Zero3FusedCopies.wait (fused)"
ROOFLINE = "roofline dst.copy_(src)"


def _values(numel: int, seed: int, device) -> torch.Tensor:
    """The same values on every device (drawn on the CPU, then moved)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(device)


def _roofline(numel: int, device) -> Callable[[], object]:
    src, dst = _values(numel, 1, device), torch.empty(numel, device=device)
    return lambda: dst.copy_(src)


def _result(case: str, numel: int, samples: Dict[str, List[float]], stock: str, ours: str) -> dict:
    return {"case": case, "bytes": 2 * numel * 4, "samples": samples, "path": "deepspeed",
            "stock": stock, "ours": ours, "roofline": ROOFLINE}


# ---- bucket: ZeRO-2 engines -------------------------------------------------------------


class _Zero2Bucket:
    """One ZeRO-2 engine over ``ParamBlock(n, numel)`` whose params hold preset fp32 gradients."""

    def __init__(self, n: int, numel: int, install: bool):
        import zero_lifetime
        from ..adapters.errors import require
        from ..adapters.grad_window import bucket_setup_method
        from .engines import ParamBlock, make_engine

        torch.manual_seed(0)
        # Nothing reduces mid-loop: the whole block fits one bucket, no overlap.
        self.engine = make_engine(ParamBlock(n, numel), 2, reduce_bucket_size=n * numel, overlap_comm=False,
                                  contiguous_gradients=True)
        self.installation = zero_lifetime.install(self.engine) if install else None
        opt = self.optimizer = self.engine.optimizer
        assert not opt.use_grad_accum_attribute, "expected gradients in param.grad (fp32 ZeRO-2)"
        self.group_params = [(i, p) for i, group in enumerate(opt.bit16_groups) for p in group]
        # The bucket buffers DeepSpeed allocates at the start of a backward.
        require(opt, bucket_setup_method(opt), "the ZeRO-1/2 bucket setup")()
        self.grads, self.originals = [], []
        for k, (_, p) in enumerate(self.group_params):
            original = _values(p.numel(), 1000 + k, p.device).view_as(p)
            self.originals.append(original)
            self.grads.append(original.detach().clone())  # the tensor objects DeepSpeed re-points

    def reset(self) -> None:
        """Empty buckets, nothing reduced, every param back on its own gradient storage."""
        opt = self.optimizer
        for bucket in opt.ipg_buckets.values():
            bucket.clear()
            bucket.index = 0
        opt.params_already_reduced[:] = [False] * len(opt.params_already_reduced)
        if self.installation is not None:
            # As at a backward's start: every param may enter a bucket once more (install
            # refuses a param bucketed twice in one backward).
            self.installation.grad_guard.begin_backward()
        for (_, p), grad, original in zip(self.group_params, self.grads, self.originals):
            grad.data = original
            p.grad = grad

    def fill(self) -> None:
        """DeepSpeed's per-param bucket fill (zero_lifetime's reserving hook when installed)."""
        add = self.optimizer.reduce_independent_p_g_buckets_and_remove_grads
        for i, p in self.group_params:
            add(p, i)
        if self.installation is not None:
            self.installation.bucket_fill.flush_pending()  # the fill that runs before the reduction

    def buffer(self) -> torch.Tensor:
        (bucket,) = self.optimizer.ipg_buckets.values()
        return bucket.buffer[bucket.index].narrow(0, 0, bucket.elements)

    def close(self) -> None:
        from .engines import discard
        discard(self.engine)


def bucket_fill(n: int, numel: int, device: str, repeats: int) -> dict:
    """One ZeRO-2 bucket filled from ``n`` fp32 gradients of ``numel``: stock engine vs installed one."""
    stock, ours = _Zero2Bucket(n, numel, install=False), _Zero2Bucket(n, numel, install=True)
    try:
        for side in (stock, ours):  # untimed: both ways leave the same bucket
            side.reset()
            side.fill()
        assert stock.buffer().numel() == ours.buffer().numel() == n * numel
        want = torch.cat([g.reshape(-1) for g in stock.originals])
        assert torch.equal(stock.buffer(), want) and torch.equal(ours.buffer(), want), \
            "stock and installed buckets differ: the bench is wrong"
        assert ours.installation.bucket_fill.fused_grads == n, "the installed engine did not take the fused fill"
        methods = {BUCKET_STOCK: stock.fill, BUCKET_OURS: ours.fill, ROOFLINE: _roofline(n * numel, device)}
        samples = interleave(methods, device, repeats, setup={BUCKET_STOCK: stock.reset, BUCKET_OURS: ours.reset})
    finally:
        stock.close()
        ours.close()
    return _result(f"DeepSpeed path: ZeRO-2 bucket fill {n} x {numel} float32", n * numel, samples,
                   BUCKET_STOCK, BUCKET_OURS)


# ---- gather: coalesced all-gather handles ---------------------------------------------------


class _Done:
    """The all-gather work of a handle whose buffer is already gathered."""

    def wait(self):
        return None


class _GatheredParams:
    """``n`` ZeRO-3 params of ``numel`` elements INFLIGHT over one rank-major gathered fp32 buffer."""

    def __init__(self, n: int, numel: int, world: int, device):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.world, self.status, self.device = world, ZeroParamStatus, device
        shard = -(-numel // world)
        self.segment = shard * n
        self.params = []
        for _ in range(n):
            param = torch.nn.Parameter(torch.empty(0, device=device), requires_grad=False)
            param.ds_tensor = torch.empty(shard, device=device)
            param.ds_tensor.ds_numel = shard
            param.ds_numel, param.ds_shape, param.ds_persist = numel, torch.Size([numel]), False
            param.ds_summary = lambda: "bench param"
            self.params.append(param)
        self.gathered = _values(world * self.segment, 2, device)
        self.handle = None

    def reset(self) -> None:
        """Params INFLIGHT with no data, and a fresh handle over the gathered buffer."""
        from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle
        for param in self.params:
            param.data = torch.empty(0, device=self.device)
            param.ds_status = self.status.INFLIGHT
        partitions = [self.gathered.narrow(0, r * self.segment, self.segment) for r in range(self.world)]
        self.handle = AllGatherCoalescedHandle(_Done(), self.params, partitions, self.world)


def _zero3_fused():
    """A tiny installed ZeRO-3 engine: what ``Zero3FusedCopies`` is built on. (engine, its fused copies)."""
    import zero_lifetime
    from .engines import make_engine
    engine = make_engine(torch.nn.Linear(4, 4), 3)
    return engine, zero_lifetime.install(engine).fused


def gather_wait(n: int, numel: int, world: int, device: str, repeats: int) -> dict:
    """One coalesced handle of ``n`` fp32 params of ``numel`` waited: DeepSpeed's wait vs the fused one."""
    from deepspeed.accelerator import get_accelerator

    from .engines import discard
    target = torch.device(get_accelerator().current_device_name())
    engine, fused = _zero3_fused()
    stock, ours = _GatheredParams(n, numel, world, target), _GatheredParams(n, numel, world, target)
    try:
        stock.reset()
        stock.handle.wait()
        before = fused.counts["fused_gathers"]
        ours.reset()
        fused.wait(ours.handle)
        assert fused.counts["fused_gathers"] == before + 1, "the fused wait fell back to the stock one"
        for s, o in zip(stock.params, ours.params):
            assert s.shape == o.shape == (numel,) and torch.equal(s.data, o.data), \
                "stock and fused waits differ: the bench is wrong"
        methods = {GATHER_STOCK: lambda: stock.handle.wait(), GATHER_OURS: lambda: fused.wait(ours.handle),
                   ROOFLINE: _roofline(n * numel, target)}
        samples = interleave(methods, device, repeats, setup={GATHER_STOCK: stock.reset, GATHER_OURS: ours.reset})
    finally:
        discard(engine)
    return _result(f"DeepSpeed path: coalesced handle wait {n} x {numel} world {world} float32", n * numel,
                   samples, GATHER_STOCK, GATHER_OURS)


def speedup_note(result: dict) -> str:
    """The DeepSpeed-path speedup line of a case's notes (stock median / ours median)."""
    import statistics
    stock, ours = (statistics.median(result["samples"][m]) for m in (result["stock"], result["ours"]))
    return f"DeepSpeed-path speedup (stock / ours): {stock / ours:.2f}x"


def split(results: List[dict]) -> Tuple[List[dict], List[dict]]:
    """(kernel-level results, DeepSpeed-path results)."""
    return ([r for r in results if r.get("path") != "deepspeed"],
            [r for r in results if r.get("path") == "deepspeed"])
