"""Zero3FusedCopies: ZeRO-3 bucket fill and gather copy-out as one fused op each, on real engines.

One rank (plain torch as the oracle) exercises the bucket fill; the coalesced gather
handle only runs with more than one rank, so it is checked in one 2-rank spawn
(tests/zero3_fused_worker.py, torch DDP as the oracle) and, on one rank, by waiting a
hand-built DeepSpeed handle both ways (uneven shards, secondary tensors, a dtype cast).
"""

import copy
import gc

import deepspeed
import pytest
import torch
from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle, ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from torch.multiprocessing.reductions import StorageWeakRef

import zero_lifetime
from harness import MODELS, assert_weights_match, ds_config, full_weights, losses, make_input, reference_two_backwards
from zero_lifetime import ops
from zero_lifetime.adapters.errors import UnsupportedDeepSpeedError
from zero_lifetime.adapters.zero3_buckets import ADD_GRAD, REDUCE_BUCKET
from zero_lifetime.zero3_fused import Zero3FusedCopies

import zero3_fused_worker as worker
from compiled import compiled_ops_or_skip
from rank_spawn import spawn_ranks

STEPS = 3
SMALL_BUCKET = 40  # elements: mlp_norm's params (128, 16, 16, 16, 64, 4) need several flushes per backward
BF16_ATOL = worker.BF16_ATOL


@pytest.fixture
def op_calls(monkeypatch):
    calls = {"bucket_fill": 0, "gather_copy_out": 0}
    for name in calls:
        original = getattr(ops, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(ops, name, counting)
    return calls


def _pair(dtype="fp32", lr=0.1, **zero):
    """harness.make_pair's engine and oracle, with a small bucket, maybe bf16, and ``zero`` options."""
    torch.manual_seed(0)
    model = MODELS["mlp_norm"]()
    reference = copy.deepcopy(model)
    cfg = ds_config(3, lr=lr, reduce_bucket_size=SMALL_BUCKET, **zero)
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine, reference, torch.optim.SGD(reference.parameters(), lr=cfg["optimizer"]["params"]["lr"])


def _train(engine, reference=None, ref_opt=None, dtype="fp32", two_losses=False, zero_grad=False):
    for step in range(STEPS):
        x = make_input("mlp_norm", seed=step)
        out = engine(x.to(torch.bfloat16) if dtype == "bf16" else x)
        if two_losses:
            l1, l2 = losses(out)
            engine.backward(l1, retain_graph=True)
            if zero_grad:
                engine.zero_grad()
            engine.backward(l2)
            if reference is not None:
                reference_two_backwards(reference, ref_opt, x, zero_grad)
        else:
            engine.backward(losses(out)[0])
            if reference is not None:
                losses(reference(x))[0].backward()
                ref_opt.step()
                ref_opt.zero_grad()
        engine.step()


def _assert_matches(engine, reference, dtype, stock=None):
    """Against plain torch (bf16: to bf16 precision), and bit for bit against a stock engine."""
    if dtype == "bf16":
        assert_weights_match(engine, reference, atol=BF16_ATOL, rtol=BF16_ATOL)
    else:
        assert_weights_match(engine, reference)
    if stock is not None:
        for (name, _), got, want in zip(engine.module.named_parameters(), full_weights(engine), full_weights(stock)):
            assert torch.equal(got, want), f"{name}: fused and stock DeepSpeed differ"


# ---- one rank: the bucket fill ------------------------------------------------------------


# reduce_scatter off: the flush all-reduces the bucket buffer itself instead of the grads viewing it.
ZERO_OPTIONS = {"overlap": {"overlap_comm": True}, "no_overlap": {"overlap_comm": False},
                "buffer_all_reduce": {"overlap_comm": True, "reduce_scatter": False}}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("options", list(ZERO_OPTIONS))
def test_single_rank_matches_torch(dtype, options, op_calls):
    stock, *_ = _pair(dtype, **ZERO_OPTIONS[options])
    _train(stock, dtype=dtype)
    engine, reference, ref_opt = _pair(dtype, **ZERO_OPTIONS[options])
    fused = Zero3FusedCopies(engine)
    _train(engine, reference, ref_opt, dtype)
    _assert_matches(engine, reference, dtype, stock)
    # Several flushes per backward, each one fused fill of every gradient that the stock
    # rule puts into the buffer (a gradient larger than the bucket stays where it is).
    fitting = sum(p.ds_numel <= SMALL_BUCKET for p in engine.module.parameters())
    assert 0 < fitting < len(list(engine.module.parameters()))
    assert fused.counts["bucket_fills"] >= 2 * STEPS, fused.counts
    assert op_calls["bucket_fill"] == fused.counts["bucket_fills"]
    assert fused.counts["filled_grads"] == fitting * STEPS, fused.counts
    # One rank gathers nothing: DeepSpeed hands out NoGatherCoalescedHandle.
    assert op_calls["gather_copy_out"] == 0 and fused.counts["stock_gathers"] == 0
    fused.uninstall()


@pytest.mark.parametrize("zero_grad", [True, False], ids=["zero_grad", "no_zero_grad"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_with_install_two_losses_match_torch(dtype, zero_grad, op_calls):
    # lr 0.01: the second loss is linear and unbounded; a larger step leaves bf16 rounding amplified.
    stock, *_ = _pair(dtype, lr=0.01)
    zero_lifetime.install(stock)
    _train(stock, dtype=dtype, two_losses=True, zero_grad=zero_grad)
    engine, reference, ref_opt = _pair(dtype, lr=0.01)
    zero_lifetime.install(engine)
    fused = Zero3FusedCopies(engine)
    _train(engine, reference, ref_opt, dtype, two_losses=True, zero_grad=zero_grad)
    _assert_matches(engine, reference, dtype, stock)
    assert op_calls["bucket_fill"] >= 2 * 2 * STEPS  # two backwards a step, several flushes each
    fused.uninstall()
    zero_lifetime.uninstall(engine)


def test_grads_alias_their_bucket_slices_when_reduced():
    """What the stock copy leaves for the reduction: the bucket's grads tile its buffer, in views."""
    engine, *_ = _pair()
    fused = Zero3FusedCopies(engine)
    optimizer = engine.optimizer
    bucket = next(iter(optimizer.ipg_buckets.values()))
    flushes = []
    stock_partition = optimizer.partition_grads

    def partition_grads(params, partitions):
        buffer = bucket.buffer
        slices = []
        for param in params:
            grad = param.grad
            if grad.numel() > SMALL_BUCKET:  # the stock rule leaves it outside the buffer
                continue
            assert grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert grad.shape == param.ds_shape and grad.is_contiguous()
            slices.append(((grad.data_ptr() - buffer.data_ptr()) // buffer.element_size(), grad.numel()))
        if slices:
            flushes.append(sorted(slices))
        return stock_partition(params, partitions)

    optimizer.partition_grads = partition_grads
    engine.backward(losses(engine(make_input("mlp_norm", 0)))[0])
    assert len(flushes) == fused.counts["bucket_fills"] >= 2
    for slices in flushes:  # back to back from the buffer's start, as the stock copy places them
        ends = [0] + [offset + numel for offset, numel in slices]
        assert [offset for offset, _ in slices] == ends[:-1], slices
    assert sum(len(slices) for slices in flushes) == sum(p.ds_numel <= SMALL_BUCKET for p in engine.module.parameters())


def test_uninstall_restores_stock(op_calls):
    engine, reference, ref_opt = _pair()
    originals = {id(p): p.__dict__["all_gather_coalesced"] for p in engine.module.parameters()}
    fused = Zero3FusedCopies(engine)
    assert ADD_GRAD in engine.optimizer.__dict__ and REDUCE_BUCKET in engine.optimizer.__dict__
    fused.uninstall()
    assert ADD_GRAD not in engine.optimizer.__dict__ and REDUCE_BUCKET not in engine.optimizer.__dict__
    assert all(p.__dict__["all_gather_coalesced"] is originals[id(p)] for p in engine.module.parameters())
    _train(engine, reference, ref_opt)
    _assert_matches(engine, reference, "fp32")
    assert op_calls == {"bucket_fill": 0, "gather_copy_out": 0}


def test_unknown_deepspeed_raises_and_patches_nothing(monkeypatch):
    engine, *_ = _pair()
    monkeypatch.delattr(DeepSpeedZeroOptimizer_Stage3, REDUCE_BUCKET)
    with pytest.raises(UnsupportedDeepSpeedError, match="IPG bucket method"):
        Zero3FusedCopies(engine)
    assert ADD_GRAD not in engine.optimizer.__dict__


def test_a_refused_gather_probe_leaves_the_buckets_stock(monkeypatch):
    """The gather half is probed after the bucket methods are overridden: its refusal takes
    them back."""
    engine, *_ = _pair()
    param = next(engine.module.parameters())
    monkeypatch.delitem(param.__dict__, "all_gather_coalesced")
    with pytest.raises(UnsupportedDeepSpeedError, match="all_gather_coalesced"):
        Zero3FusedCopies(engine)
    assert ADD_GRAD not in engine.optimizer.__dict__ and REDUCE_BUCKET not in engine.optimizer.__dict__


# ---- one rank: the gather copy-out against the stock wait on hand-built handles ----------


class _Done:

    def wait(self):
        pass


def _sharded_params(numels, world, dtype, groups):
    """ZeRO-3-like params (INFLIGHT) and the rank-major gathered buffer holding them."""
    params, shards = [], []
    g = torch.Generator().manual_seed(0)
    for numel in numels:
        shard = -(-numel // (world * groups)) * groups  # per-rank shard, padded like DeepSpeed
        full = torch.zeros(shard * world)
        full[:numel] = torch.randn(numel, generator=g)
        param = torch.nn.Parameter(torch.empty(0, dtype=dtype))
        param.ds_tensor = torch.empty(shard // groups, dtype=dtype)
        param.ds_tensor.ds_numel = shard // groups
        param.ds_secondary_tensor_num_of_groups = groups
        param.ds_numel, param.ds_shape, param.ds_persist = numel, torch.Size([numel]), False
        param.ds_status = ZeroParamStatus.INFLIGHT
        param.ds_summary = lambda: "test param"
        params.append((param, full))
        shards.append(shard)
    segments = [torch.cat([full[r * s:(r + 1) * s] for (_, full), s in zip(params, shards)]) for r in range(world)]
    return [p for p, _ in params], [full[:n] for (_, full), n in zip(params, numels)], torch.cat(segments)


@pytest.mark.parametrize("groups", [1, 2], ids=["primary", "secondary"])
@pytest.mark.parametrize("gather_dtype", [torch.float32, torch.bfloat16])
def test_fused_wait_matches_stock_wait(groups, gather_dtype, op_calls):
    engine, *_ = _pair()
    fused = Zero3FusedCopies(engine)
    world, numels = 3, [7, 12, 1, 30]
    results = {}
    for how in ("stock", "fused"):
        params, wants, flat = _sharded_params(numels, world, torch.float32, groups)
        flat = flat.to(gather_dtype)
        segment = flat.numel() // world
        partitions = [flat.narrow(0, r * segment, segment) for r in range(world)]
        handle = AllGatherCoalescedHandle(_Done(), params, partitions, world, use_secondary_tensor=groups > 1)
        del flat, partitions
        if how == "stock":
            handle.wait()
        else:
            fused.wait(handle)
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params) and handle.complete
        results[how] = (params, wants, handle)
    (stock, wants, _), (got, _, handle) = results["stock"], results["fused"]
    for s, f, want in zip(stock, got, wants):
        assert f.dtype == torch.float32 and f.shape == s.shape
        torch.testing.assert_close(f.data, s.data, atol=0, rtol=0)
        torch.testing.assert_close(f.data, want.to(gather_dtype).float(), atol=0, rtol=0)
    assert op_calls["gather_copy_out"] == 1 and fused.counts["fused_gathers"] == 1
    # One buffer for the whole gather, exactly the params' size, shared by all of them.
    storage = got[0].untyped_storage()
    assert {p.untyped_storage().data_ptr() for p in got} == {storage.data_ptr()}
    assert storage.nbytes() == sum(numels) * 4
    # Released like DeepSpeed's free_param: the buffer (and the gathered input) go with the last param.
    gathered_ref = StorageWeakRef(handle.partitions[0].untyped_storage())
    buffer_ref = StorageWeakRef(storage)
    del storage, handle, results
    gc.collect()
    assert gathered_ref.expired()
    for i, param in enumerate(got):
        assert not buffer_ref.expired(), f"buffer freed while param {i} still uses it"
        param.data = torch.empty(0, dtype=param.dtype)
    assert buffer_ref.expired()
    fused.uninstall()


def test_fused_wait_reuses_a_released_buffer_and_overwrites_it(op_calls):
    # On the CPU the second gather gets the first one's memory back (ops.gather_buffer's
    # cache); every element must be rewritten: compared with the stock wait of new values.
    compiled_ops_or_skip()
    engine, *_ = _pair()
    fused = Zero3FusedCopies(engine)
    world, numels = 2, [70000, 120001, 3]
    addresses, hits_before = [], ops.cpu_buffer_cache_info()["hits"]
    for seed in (1, 2):
        torch.manual_seed(seed)
        stock_params, wants, flat = _sharded_params(numels, world, torch.float32, 1)
        params, _, _ = _sharded_params(numels, world, torch.float32, 1)
        flat = flat * seed  # the second gather holds other values than the first
        segment = flat.numel() // world
        partitions = [flat.narrow(0, r * segment, segment) for r in range(world)]
        stock = AllGatherCoalescedHandle(_Done(), stock_params, partitions, world)
        stock.wait()
        fused.wait(AllGatherCoalescedHandle(_Done(), params, partitions, world))
        addresses.append(params[0].untyped_storage().data_ptr())
        for got, want in zip(params, stock_params):
            torch.testing.assert_close(got.data, want.data, atol=0, rtol=0)
        for param in params:  # DeepSpeed's free_param
            param.data = torch.empty(0)
    assert ops.cpu_buffer_cache_info()["hits"] == hits_before + 1
    assert addresses[0] == addresses[1], "the second gather did not reuse the released buffer"
    assert op_calls["gather_copy_out"] == 2
    fused.uninstall()


# ---- two ranks: the real coalesced gathers ------------------------------------------------

SPAWN_DEADLINE_S = 400  # only reached when something hangs; busy shared cores slow a passing run a lot


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    return spawn_ranks(worker.main, str(tmp_path_factory.mktemp("zero3_fused")), worker.WORLD, SPAWN_DEADLINE_S)


def test_two_ranks_finished(two_rank_results):
    two_rank_results.assert_finished(sc["id"] for sc in worker.SCENARIOS)


FUSED_SCENARIOS = [sc for sc in worker.SCENARIOS if not sc["uninstall_first"]]


@pytest.mark.parametrize("sc", FUSED_SCENARIOS, ids=[sc["id"] for sc in FUSED_SCENARIOS])
def test_two_ranks_fused_matches_ddp(two_rank_results, sc):
    for rank, record in enumerate(two_rank_results.records(sc["id"])):
        assert all(e <= worker.base.ATOL for e in record["oracle_tol_excess"].values()), record["oracle_abs_diff"]
        if sc["dtype"] == "bf16":
            bad = {n: d for n, d in record["abs_diff"].items() if not d <= BF16_ATOL}
        else:
            bad = {n: record["abs_diff"][n] for n, e in record["tol_excess"].items() if not e <= worker.base.ATOL}
        assert not bad, f"rank {rank}: engine weights differ from DDP: {bad}"
        assert record["differs_from_stock"] == [], f"rank {rank}: not bit-identical to stock DeepSpeed"
        counts = record["counts"]
        # The fused paths ran: every coalesced gather and several bucket flushes per step.
        assert record["gather_calls"] > 0 and counts["stock_gathers"] == 0, counts
        assert record["gather_calls"] == counts["fused_gathers"], (record["gather_calls"], counts)
        assert record["bucket_fill_calls"] == counts["bucket_fills"] >= 2 * worker.STEPS, counts
        assert record["modules_in_one_buffer"] > 0 and record["modules_split"] == 0, record
        # No extra memory: each buffer exactly its params' size, and gone once they are released.
        assert record["exact_size"], record
        assert record["live_buffers"] == 0, f"rank {rank}: {record['live_buffers']} gather buffers outlive their params"
        if "buffer_cache_hits" in record:  # compiled ops: later gathers reuse released buffers' memory
            assert record["buffer_cache_hits"] > 0, record
        assert record["non_empty_released"] == [] and record["leftover_handles"] == 0, record
        assert record["restored"]


def test_two_ranks_uninstalled_is_stock(two_rank_results):
    for rank, record in enumerate(two_rank_results.records("uninstalled-is-stock")):
        bad = {n: record["abs_diff"][n] for n, e in record["tol_excess"].items() if not e <= worker.base.ATOL}
        assert not bad, f"rank {rank}: {bad}"
        assert record["differs_from_stock"] == []
        assert record["gather_calls"] == 0 and record["bucket_fill_calls"] == 0, record
        assert record["modules_in_one_buffer"] == 0, record
