"""Rank process for tests/test_zero3_fused.py: every 2-rank fused-copy scenario in one spawn.

Two ranks are where the coalesced all-gather handle runs at all (one rank gets no
gather). Each scenario trains a fresh ZeRO-3 engine with Zero3FusedCopies against
torch DDP and an all-reduce oracle (both from tests/two_rank_worker.py), counting the
fused op calls and checking every fused gather buffer: one storage exactly as large as
its params, shared by them, and gone once they are released. One JSON line per
scenario and rank goes to ``<out>/rank<r>.jsonl``.
"""


import two_rank_worker as base

WORLD = base.WORLD
STEPS = 3
BF16_ATOL = 2e-2


def _scenario(sid, dtype="fp32", overlap=True, install=False, two_losses=False, model="mlp_norm",
              uninstall_first=False):
    # kind/zero_grad/model/gas: the keys two_rank_worker's oracle steps read.
    return dict(id=sid, kind="steps", zero_grad=False, model=model, gas=1, dtype=dtype, overlap=overlap,
                install=install, two_losses=two_losses, uninstall_first=uninstall_first)


SCENARIOS = [
    _scenario("fp32-overlap"),
    _scenario("fp32-no-overlap", overlap=False),
    _scenario("bf16-overlap", dtype="bf16"),
    _scenario("fp32-tied-lm", model="tied_lm"),
    _scenario("install-two-losses", install=True, two_losses=True),
    _scenario("uninstalled-is-stock", uninstall_first=True),
]


class _OpSpy:
    """Counts the fused op calls; keeps weak references to every gather's buffers."""

    def __init__(self, ops):
        self.ops = ops
        self.originals = (ops.bucket_fill, ops.gather_copy_out)
        self.bucket_fills = 0
        self.gathers = []  # (out, gathered) StorageWeakRefs
        self.exact_size = True
        self.out_storages = set()
        ops.bucket_fill = self._bucket_fill
        ops.gather_copy_out = self._gather_copy_out

    def _bucket_fill(self, *args, **kwargs):
        self.bucket_fills += 1
        return self.originals[0](*args, **kwargs)

    def _gather_copy_out(self, gathered, out, *args, **kwargs):
        from torch.multiprocessing.reductions import StorageWeakRef
        storage = out.untyped_storage()
        self.exact_size &= storage.nbytes() == out.numel() * out.element_size()
        self.out_storages.add(storage.data_ptr())
        self.gathers.append((StorageWeakRef(storage), StorageWeakRef(gathered.untyped_storage())))
        return self.originals[1](gathered, out, *args, **kwargs)

    def live_buffers(self):
        return sum((not out.expired()) + (not gathered.expired()) for out, gathered in self.gathers)

    def remove(self):
        self.ops.bucket_fill, self.ops.gather_copy_out = self.originals


def _watch_shared_storage(engine, spy, record):
    """Forward pre-hooks (after DeepSpeed's fetch): a module's gathered params share one fused buffer."""
    record["modules_in_one_buffer"] = record["modules_split"] = 0

    def check(module, _inputs):
        params = list(module.parameters(recurse=False))
        if len(params) < 2:
            return
        storages = {p.untyped_storage().data_ptr() for p in params}
        if len(storages) == 1 and storages <= spy.out_storages:
            record["modules_in_one_buffer"] += 1
        else:
            record["modules_split"] += 1

    return [m.register_forward_pre_hook(check) for m in engine.module.modules()]


def _engine_step(engine, sc, step, rank):
    import torch
    from harness import losses
    x = base._shard(sc["model"], step, rank)
    if sc["dtype"] == "bf16" and x.is_floating_point():
        x = x.to(torch.bfloat16)
    out = engine(x)
    if sc["two_losses"]:
        l1, l2 = losses(out)
        engine.backward(l1, retain_graph=True)
        engine.backward(l2)
    else:
        engine.backward(losses(out)[0])
    engine.step()


def _engine(sc):
    import deepspeed
    import torch
    from harness import MODELS, ds_config

    torch.manual_seed(0)
    model = MODELS[sc["model"]]()
    # A bucket of 40 elements: several flushes per backward (the largest param has 128).
    cfg = ds_config(3, 0, lr=base.LR[sc["model"]], reduce_bucket_size=40, overlap_comm=sc["overlap"])
    if sc["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _stock_weights(sc, rank):
    """Stock DeepSpeed on the same data: the fused engine must match it bit for bit."""
    import zero_lifetime
    from harness import full_weights

    engine = _engine(sc)
    if sc["install"]:
        zero_lifetime.install(engine)
    for step in range(STEPS):
        _engine_step(engine, sc, step, rank)
    weights = full_weights(engine)
    if sc["install"]:
        zero_lifetime.uninstall(engine)
    return weights


def _run(sc, rank):
    import copy

    import torch
    import zero_lifetime
    from harness import MODELS, full_weights
    from zero_lifetime import ops
    from zero_lifetime.zero3_fused import Zero3FusedCopies

    stock_weights = _stock_weights(sc, rank)
    torch.manual_seed(0)
    model = MODELS[sc["model"]]()  # the oracles' initial weights: the engine's, same seed
    ddp_model, ar_model = copy.deepcopy(model), copy.deepcopy(model)
    lr = base.LR[sc["model"]]
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, device_ids=None)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    ar_opt = torch.optim.SGD(ar_model.parameters(), lr=lr)
    engine = _engine(sc)
    if sc["install"]:
        zero_lifetime.install(engine)
    fused = Zero3FusedCopies(engine)
    if sc["uninstall_first"]:
        fused.uninstall()
    spy = _OpSpy(ops)
    record = {}
    cache_before = ops.cpu_buffer_cache_info() if ops.native_available() else None
    hooks = _watch_shared_storage(engine, spy, record)
    try:
        oracle_sc = dict(sc, zero_grad=False)
        for step in range(STEPS):
            _engine_step(engine, sc, step, rank)
            base._ddp_step(ddp, ddp_opt, oracle_sc, step, 2 if sc["two_losses"] else 1, rank)
            base._allreduce_step(ar_model, ar_opt, oracle_sc, step, 2 if sc["two_losses"] else 1, rank)
    finally:
        spy.remove()
        for hook in hooks:
            hook.remove()
    # Before any garbage collection: a buffer held by a reference cycle counts as retained.
    record.update(counts=fused.counts, bucket_fill_calls=spy.bucket_fills, gather_calls=len(spy.gathers),
                  exact_size=spy.exact_size, live_buffers=spy.live_buffers(),
                  leftover_handles=len(_handles_with_our_wait(engine)))
    if cache_before is not None:  # gathers that got a released gather's memory back
        record["buffer_cache_hits"] = ops.cpu_buffer_cache_info()["hits"] - cache_before["hits"]
    record["non_empty_released"] = [n for n, p in engine.module.named_parameters() if p.data.numel() != 0]
    want = {n: p.detach() for n, p in ddp_model.named_parameters()}
    weights = full_weights(engine)
    record["differs_from_stock"] = [n for (n, _), got, stock in zip(engine.module.named_parameters(), weights,
                                                                    stock_weights) if not torch.equal(got, stock)]
    record["abs_diff"], record["tol_excess"] = base._compare([w.float() for w in weights], want)
    record["oracle_abs_diff"], record["oracle_tol_excess"] = base._compare(
        [p.detach() for p in ar_model.parameters()], want)
    fused.uninstall()
    record["restored"] = not any(name in engine.optimizer.__dict__ for name in (
        "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket",
        "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"))
    if sc["install"]:
        zero_lifetime.uninstall(engine)
    del engine, ddp
    return record


def _handles_with_our_wait(engine):
    """Coalesced handles still carrying our wait after the run (none may be left in flight)."""
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    registry = getattr(coordinator, "_PartitionedParameterCoordinator__inflight_param_registry")
    return [h for h in registry.values() if "wait" in getattr(h, "__dict__", {})]


def main(rank, out_dir, port):
    """torch.multiprocessing entry point: this rank runs every scenario."""
    base.run_rank(rank, out_dir, port, SCENARIOS, _run)
