"""`step`: a training step of a small transformer, stock vs ``zero_lifetime.install``.

* ZeRO-3 and ZeRO-2, single backward: the same weights in a stock and an installed
  engine, steps interleaved; the ratio is install's overhead.
* ZeRO-3, retained two-backward step (``backward(retain_graph=True)`` then ``backward``)
  under ``regather`` and ``pin``, next to a stock single-backward step (stock cannot run
  the retained one): time, and peak gathered bytes (non-persistent params AVAILABLE,
  sampled at every module forward and every gradient accumulation) with eager release
  (``stage3_max_reuse_distance=0``, no prefetch) so that stock frees module by module.

With ``--ranks 2`` the same steps also run on 2 processes (see ``step_dist``), where ZeRO-3
all-gathers and ZeRO-1/2 check the ranks' bucket layouts.

(``benchmarks/bench_step_overhead.py`` is the earlier stand-alone version of this.)
"""

from __future__ import annotations

import contextlib
import statistics
from typing import List

from .report import Progress, Result

STOCK, INSTALLED = "stock", "installed"
STOCK_SINGLE = "stock, single backward"
EAGER = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
FULL_MODEL = {"layers": 4, "width": 256, "seq": 64}
QUICK_MODEL = {"layers": 1, "width": 32, "seq": 8}
WARMUP_STEPS = 3  # trace recording and the first gathers


def gathered_bytes(engine) -> int:
    """Bytes of the engine's non-persistent params that are gathered right now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return sum(p.ds_numel * p.element_size() for p in engine.module.parameters()
               if p.ds_status == ZeroParamStatus.AVAILABLE and not getattr(p, "ds_persist", False))


def count_param_fetches(engine) -> list:
    """A one-element list counting the params DeepSpeed all-gathers from now on (each param
    of each ``all_gather_coalesced``), by wrapping every param's own method."""
    fetched = [0]
    for param in engine.module.parameters():
        def counted(params, *args, _gather=param.all_gather_coalesced, **kwargs):
            fetched[0] += len(params)
            return _gather(params, *args, **kwargs)
        param.all_gather_coalesced = counted
    return fetched


class PeakGathered:
    """Peak of :func:`gathered_bytes`, sampled at every module forward and grad accumulation.

    A context manager: leaving it removes the hooks (see :meth:`remove`)."""

    def __init__(self, engine):
        self.engine, self.peak, self.handles = engine, 0, []
        for module in engine.module.modules():
            self.handles.append(module.register_forward_hook(lambda *a: self.sample()))
        for param in engine.module.parameters():
            self.handles.append(param.register_post_accumulate_grad_hook(lambda p: self.sample()))

    def sample(self):
        self.peak = max(self.peak, gathered_bytes(self.engine))

    def reset(self):
        self.peak = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self):
        # A param's grad hook that reaches its own engine is a cycle through torch's C++ side,
        # which the garbage collector cannot break: without this, the engine outlives discard().
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def peak_device_bytes(step) -> int:
    """Peak CUDA memory allocated during ``step`` above what was allocated before it."""
    import torch
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def single_backward_step(engine, tokens):
    logits = engine(tokens)
    engine.backward(logits.float().pow(2).mean())
    engine.step()


def retained_step(engine, tokens):
    logits = engine(tokens)
    engine.backward(logits.pow(2).mean(), retain_graph=True)
    engine.backward(logits.mean())
    engine.step()


def run(device: str, repeats: int, quick: bool, ranks: int = 1, progress: Progress = None) -> List[Result]:
    from .engines import prepare_process, quiet_deepspeed
    prepare_process(device)
    import torch

    quiet_deepspeed()
    shape = QUICK_MODEL if quick else FULL_MODEL
    threads = torch.get_num_threads()
    if quick:  # tiny matmuls: a second thread only adds OpenMP barrier waits on busy shared cores
        torch.set_num_threads(1)
    try:
        results = _run(device, repeats, shape, progress)
    finally:
        torch.set_num_threads(threads)
    if ranks > 1:
        from . import step_dist
        results += step_dist.run(device, repeats, quick, ranks, progress)
    return results


def _run(device: str, repeats: int, shape, progress: Progress = None) -> List[Result]:
    import torch

    import zero_lifetime
    from .engines import TinyTransformer, discard, make_engine
    from .timing import interleave

    torch.manual_seed(0)
    model = TinyTransformer(shape["layers"], shape["width"])
    n_params = sum(p.numel() for p in model.parameters())
    model_name = f"{shape['layers']}-layer transformer, width {shape['width']}, {n_params / 1e6:.2f}M params"
    results = []

    def tokens_for(engine):
        return torch.randint(0, 512, (8, shape["seq"]), device=engine.device)

    for stage in (3, 2):
        stock, installed = make_engine(model, stage), make_engine(model, stage)
        notes = _let_stock_step(stock) if stage != 3 else []
        zero_lifetime.install(installed)
        tokens = tokens_for(stock)
        methods = {STOCK: lambda: single_backward_step(stock, tokens),
                   INSTALLED: lambda: single_backward_step(installed, tokens)}
        samples = interleave(methods, device, repeats, warmup=WARMUP_STEPS)
        work = _fused_work(zero_lifetime.stats(installed))
        results.append({"bench": "step", "case": f"ZeRO-{stage} single-backward step, {model_name}",
                        "stage": stage, "bytes": None, "samples": samples, "stock": STOCK, "ours": INSTALLED,
                        "roofline": None, "per": None, "per_label": "per item", "fused_work": work,
                        "notes": notes + ["installed engine, all steps: " +
                                          ", ".join(f"{k} {v}" for k, v in work.items())]})
        for engine in (stock, installed):
            discard(engine)
        if progress:
            progress.step(f"step ZeRO-{stage}")

    engines = {STOCK_SINGLE: make_engine(model, 3, **EAGER)}
    for policy in ("regather", "pin"):
        engines[f"{policy}, retained two backwards"] = engine = make_engine(model, 3, **EAGER)
        zero_lifetime.install(engine, policy=policy)
    tokens = tokens_for(engines[STOCK_SINGLE])
    for engine in engines.values():  # same warm-up for all: a recorded trace before the probes
        for _ in range(WARMUP_STEPS):
            single_backward_step(engine, tokens)
    methods = {name: (lambda e=engine, f=single_backward_step if name == STOCK_SINGLE else retained_step:
                      f(e, tokens)) for name, engine in engines.items()}
    with contextlib.ExitStack() as probing:
        probes = {name: probing.enter_context(PeakGathered(engine)) for name, engine in engines.items()}
        samples = interleave(methods, device, repeats, warmup=0)
        peaks = {name: probe.peak for name, probe in probes.items()}
    base = peaks[STOCK_SINGLE] or 1
    notes = [f"peak gathered {name}: {peak / 2**20:.2f} MiB ({100 * (peak / base - 1):+.1f}% vs stock single)"
             for name, peak in peaks.items()]
    device_peaks = None
    if device == "cuda":  # one more step each, alone, so the allocator's peak is that step's
        device_peaks = {name: peak_device_bytes(methods[name]) for name in engines}
        base = device_peaks[STOCK_SINGLE] or 1
        notes += [f"peak device memory {name}: {peak / 2**20:.2f} MiB ({100 * (peak / base - 1):+.1f}% vs stock "
                  f"single)" for name, peak in device_peaks.items()]
    results.append({"bench": "step", "case": f"ZeRO-3 retained two-backward step (eager release), {model_name}",
                    "stage": 3, "bytes": None, "samples": samples, "stock": STOCK_SINGLE, "ours": None,
                    "roofline": None, "per": None, "per_label": "per item", "peak_gathered_bytes": peaks,
                    "peak_device_bytes": device_peaks, "notes": notes})
    for engine in engines.values():
        discard(engine)
    if progress:
        progress.step("step retained")
    return results


def _let_stock_step(engine) -> List[str]:
    """DeepSpeed 0.18.9's stock ZeRO-1/2 ``step()`` fails on 2 or more gloo ranks (its flat param
    buffers carry autograd history). ``install`` detaches them; the stock engine gets the same
    detach, so that it runs and the two differ only by the rest of ``install``. Notes saying so."""
    from ..adapters.zero12_flat_buffers import detach_flat_buffers
    detached = detach_flat_buffers(engine.optimizer)
    if not detached:
        return []
    return [f"stock engine: {detached} flat param buffer(s) detached from autograd, as install does "
            "(DeepSpeed 0.18.9's step() fails on >= 2 gloo ranks without it)"]


def _fused_work(stats) -> dict:
    """What the installed engine's fused paths did over all its steps (warm-up included)."""
    counted = ("bucket_fills", "filled_grads", "fused_gathers", "stock_gathers", "bucket_order_checks")
    return {key: stats[key] for key in counted if key in stats}


def cases(quick: bool, ranks: int = 1) -> int:
    return 3 * (2 if ranks > 1 else 1)


def targets(results: List[Result], device: str):
    from .targets import RETAINED_PEAK_OVER_STOCK, STEP_OVERHEAD
    from .timing import paired_ratios
    limit = STEP_OVERHEAD["cuda" if device == "cuda" else "cpu"]
    out = []
    for r in results:
        ranks = f", {r['ranks']} ranks" if r.get("ranks", 1) > 1 else ""
        if "single-backward" in r["case"]:
            # Per round, not the ratio of the medians: a step is long enough for the machine's
            # load to move between rounds, and the two engines of a round share it.
            ratios = paired_ratios(r["samples"], INSTALLED, STOCK)
            overhead = statistics.median(ratios) - 1
            out.append((f"install overhead on a ZeRO-{r['stage']} step under {limit:.0%} ({device}{ranks})",
                        f"{overhead:+.2%} (median of the rounds' installed / stock; "
                        f"{_noise_of(ratios, limit)})", overhead < limit))
        peaks = r.get("peak_gathered_bytes")
        if peaks:
            regather = peaks["regather, retained two backwards"] / max(peaks[STOCK_SINGLE], 1) - 1
            out.append((f"regather peak gathered bytes (retained two backwards{ranks}) <= "
                        f"{RETAINED_PEAK_OVER_STOCK:.0%} above a stock single backward",
                        f"{regather:+.1%}", regather <= RETAINED_PEAK_OVER_STOCK))
    return out


def _noise_of(ratios: List[float], limit: float) -> str:
    """How far the rounds' scatter leaves the median from the limit: a verdict on a median
    whose 95% interval spans the limit is the machine's noise, not the code's (CPUs shared
    with other jobs move single rounds by 10-30%)."""
    from .timing import median_interval
    interval = median_interval(ratios)
    if interval is None:
        return f"{len(ratios)} rounds: too few for a 95% interval, so the verdict is noise"
    low, high = (bound - 1 for bound in interval)
    text = f"95% interval {low:+.2%} to {high:+.2%}"
    if low < limit <= high:
        text += f", which spans {limit:.0%}: within noise, rerun with more --repeats"
    return text
