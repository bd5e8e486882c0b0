"""`gather --ranks N`: DeepSpeed's real coalesced all-gather of a ZeRO-3 module, N processes.

The launcher spawns N copies of this module (``--worker``), one rank each (gloo on the
CPU, NCCL on GPUs). Each rank builds a stock and an installed ZeRO-3 engine over the same
:class:`ParamBlock` and times, interleaved: the stock ``all_gather_coalesced(...).wait()``
(one ``torch.cat`` per param), the installed one (one ``gather_copy_out`` into one
buffer), and the roofline (one ``all_gather_into_tensor`` of the same bytes plus one
contiguous copy). Rank 0 writes the samples.
"""

from __future__ import annotations

from typing import List

from . import sizes
from .rank_launch import run_worker, worker_main
from .report import Progress, Result

STOCK = "stock all_gather_coalesced + per-param cat"
FUSED = "installed: fused copy-out wait"
ROOFLINE = "roofline all_gather_into_tensor + one copy"
WORKER_TIMEOUT_S = 300


def run(device: str, repeats: int, quick: bool, ranks: int, progress: Progress = None) -> List[Result]:
    spec = {"device": device, "repeats": repeats, "shapes": sizes.shapes(quick)}
    return run_worker("zero_lifetime.bench.gather_dist", spec, ranks, device, WORKER_TIMEOUT_S, "gather", progress)


def _work(spec: dict) -> List[Result]:
    from .engines import ParamBlock, discard, make_engine, prepare_process, quiet_deepspeed
    device = spec["device"]
    prepare_process(device)
    import torch
    import torch.distributed as dist

    import zero_lifetime
    from .timing import interleave

    quiet_deepspeed()
    results = []
    for n, numel in spec["shapes"]:
        torch.manual_seed(0)
        block = ParamBlock(n, numel)
        stock = make_engine(block)
        installed = make_engine(block)
        zero_lifetime.install(installed)
        stock_params, our_params = list(stock.module.parameters()), list(installed.module.parameters())
        world = dist.get_world_size()
        shard = stock_params[0].ds_tensor.numel()
        dev = stock_params[0].ds_tensor.device
        flat_shard = torch.randn(n * shard, device=dev)
        gathered = torch.empty(world * n * shard, device=dev)
        whole = torch.empty(n * numel, device=dev)

        def release(params):
            for p in params:
                if p.ds_status.name == "AVAILABLE":
                    p.partition()

        def roofline():
            dist.all_gather_into_tensor(gathered, flat_shard)
            whole.copy_(gathered.narrow(0, 0, whole.numel()))

        methods = {
            STOCK: lambda: stock_params[0].all_gather_coalesced(stock_params).wait(),
            FUSED: lambda: our_params[0].all_gather_coalesced(our_params).wait(),
            ROOFLINE: roofline,
        }
        setup = {STOCK: lambda: release(stock_params), FUSED: lambda: release(our_params)}
        samples = interleave(methods, device, spec["repeats"], setup=setup)
        release(stock_params)
        release(our_params)
        fused = zero_lifetime.stats(installed)["fused_gathers"]
        results.append({
            "bench": "gather", "case": f"all-gather + copy-out {n} x {numel} float32, {world} ranks",
            "series": f"all-gather + copy-out, {world} ranks", "x": numel * 4, "n": n, "numel": numel,
            "ranks": world, "bytes": 2 * n * numel * 4, "samples": samples, "stock": STOCK, "ours": FUSED,
            "roofline": ROOFLINE, "per": n, "per_label": "per tensor",
            "notes": [f"installed engine ran {fused} fused gathers"]})
        for engine in (stock, installed):
            discard(engine)
    return results


if __name__ == "__main__":
    worker_main(_work)
