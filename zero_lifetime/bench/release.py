"""`release`: releasing a ZeRO-3 module's params after its backward, stock vs zero_lifetime.

Each method gets its own engine over the same :class:`ParamBlock`; before every timed call
the block's params are gathered again (untimed), and the installed engines' tracker packs
one handle per param, as a forward saving them for backward does. Timed:

* stock: the coordinator's ``release_sub_module`` (DeepSpeed's real release path), and a
  bare ``param.partition()`` loop (its per-param core);
* regather (installed, default policy): the handles die (the tracker's refcounts drop),
  then the same coordinator release: what a module's release costs with install;
* pin: the last handle of each param dies, the tracker unpins it and releases it through
  the coordinator right away (graph freed outside a backward);
* pin, deferred: the handles die inside a backward, the releases wait for its end and run
  then (``Zero3Lifetime.begin``/``end``).
"""

from __future__ import annotations

from typing import List

from .report import Progress, Result

STOCK = "stock coordinator.release_sub_module"
STOCK_PARTITION = "stock param.partition() loop"
REGATHER = "regather: handles die + release_sub_module"
PIN = "pin: last handle dies -> release"
PIN_DEFERRED = "pin deferred: handles die in backward, released at its end"

SWEEP = [(1024, 1024), (128, 65536), (8, 1 << 20)]  # per-param bookkeeping vs bytes freed
QUICK = [(32, 1024), (4, 16384)]


def _shapes(quick: bool):
    return QUICK if quick else SWEEP


def run(device: str, repeats: int, quick: bool, progress: Progress = None) -> List[Result]:
    from .engines import ParamBlock, coordinator, discard, make_engine, prepare_process, quiet_deepspeed
    prepare_process(device)
    import torch

    import zero_lifetime
    from .timing import interleave

    quiet_deepspeed()
    results = []
    for n, numel in _shapes(quick):
        torch.manual_seed(0)
        block = ParamBlock(n, numel)
        engines = {name: make_engine(block) for name in (STOCK, STOCK_PARTITION, REGATHER, PIN, PIN_DEFERRED)}
        installs = {name: zero_lifetime.install(engines[name], policy="pin" if "pin" in name else "regather")
                    for name in (REGATHER, PIN, PIN_DEFERRED)}
        params = {name: list(engine.module.parameters()) for name, engine in engines.items()}
        handles = {name: [] for name in engines}

        def gather(name):
            ps = params[name]
            ps[0].all_gather(param_list=ps)
            if name in installs:  # a forward that saves every param for backward
                handles[name] = [installs[name].tracker.pack(p) for p in ps]

        def coordinator_release(name):
            handles[name].clear()
            coordinator(engines[name]).release_sub_module(engines[name].module, forward=True)

        def partition_loop():
            for p in params[STOCK_PARTITION]:
                p.partition()

        def pin_release():
            handles[PIN].clear()  # on_unpinned releases each param through the coordinator

        def pin_deferred():
            lifetime = installs[PIN_DEFERRED].lifetime
            lifetime.begin()
            handles[PIN_DEFERRED].clear()
            lifetime.end()

        methods = {STOCK: lambda: coordinator_release(STOCK), STOCK_PARTITION: partition_loop,
                   REGATHER: lambda: coordinator_release(REGATHER), PIN: pin_release, PIN_DEFERRED: pin_deferred}
        setup = {name: (lambda name=name: gather(name)) for name in methods}
        samples = interleave(methods, device, repeats, setup=setup)
        released = {name: all(p.ds_status.name == "NOT_AVAILABLE" for p in ps) for name, ps in params.items()}
        stats = {name: zero_lifetime.stats(engines[name]) for name in installs}
        notes = [f"every method left every param released: {all(released.values())}",
                 f"pin: deferred_releases {stats[PIN]['deferred_releases']}, live handles after "
                 f"{stats[PIN]['live_handles']}"]
        results.append({"bench": "release", "case": f"release {n} params x {numel} float32", "n": n,
                        "numel": numel, "bytes": None, "samples": samples, "stock": STOCK, "ours": REGATHER,
                        "roofline": None, "per": n, "per_label": "per param", "released": released,
                        "notes": notes})
        for engine in engines.values():
            discard(engine)
        if progress:
            progress.step(results[-1]["case"])
    return results


def cases(quick: bool) -> int:
    return len(_shapes(quick))


def targets(results: List[Result], device: str):
    return []  # issue 4 sets none: the figures show what the tracker adds per param
