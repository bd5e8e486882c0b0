"""Rank process of tests/test_soak.py: a long 2-rank ZeRO run against torch DDP.

The schedule mixes, per micro-batch: one backward; two backwards over a retained graph;
a retained graph dropped without its second backward. GAS = 2, so every optimizer step
accumulates two micro-batches. Half-way the engine saves a checkpoint, is destroyed, and a
fresh engine (installed again) loads it and goes on. After every step: nothing pinned, and
on ZeRO-3 every non-persistent param released; RSS and the number of objects gc tracks are
sampled. The DDP oracle runs the losses torch semantics imply (l1 + l2 for two backwards
without zero_grad), scaled by 1/GAS as DeepSpeed scales them, accumulating under no_sync.
"""

import datetime
import gc
import json
import os
import traceback

WORLD, GAS = 2, 2
KINDS = ("single", "two", "dropped")
OBJECTS_WARMUP_STEPS = 3


def schedule(steps):
    """Deterministic, the same on every rank: micro-batch kinds for each step."""
    import random
    rng = random.Random(1234)
    return [[rng.choice(KINDS) for _ in range(GAS)] for _ in range(steps)]


def rss_bytes():  # also read by benchmarks/experiments/rss_over_steps.py
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _batch(step, micro, rank):
    from harness import make_input
    return make_input("mlp_norm", seed=100_000 + 100 * step + 10 * micro + rank)


def _engine(model, stage, checkpoint_dir=None):
    import deepspeed
    import zero_lifetime
    from harness import ds_config
    cfg = ds_config(stage, persistence=0, lr=0.01, gas=GAS)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    zero_lifetime.install(engine, **({"policy": "pin"} if stage == 3 else {}))
    if checkpoint_dir is not None:
        engine.load_checkpoint(checkpoint_dir, tag="mid")
    return engine


def _ddp_micro(ddp, kind, x, last):
    import contextlib
    from harness import losses
    l1, l2 = losses(ddp(x))
    loss = l1 + l2 if kind == "two" else l1
    with contextlib.nullcontext() if last else ddp.no_sync():
        (loss / GAS).backward()


def main(rank, out_dir, port, steps, stage=3):
    from two_rank_worker import _quiet, _set_env
    _set_env(rank, port)
    _quiet(os.path.join(out_dir, f"soak{rank}.log"))
    record = {"rank": rank, "error": None}
    try:
        import copy
        import logging

        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        import deepspeed
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False, timeout=datetime.timedelta(seconds=60))
        import zero_lifetime
        from harness import MODELS, engine_micro_batch, full_weights, released_state

        torch.manual_seed(0)
        model = MODELS["mlp_norm"]()
        reference = copy.deepcopy(model)
        engine = _engine(model, stage)
        ddp = torch.nn.parallel.DistributedDataParallel(reference)
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        plan = schedule(steps)
        rss, objects, violations, counts = [], [], [], {k: 0 for k in KINDS}
        checkpoint_dir = os.path.join(out_dir, "checkpoint")
        for step, kinds in enumerate(plan):
            if step == steps // 2:
                engine.save_checkpoint(checkpoint_dir, tag="mid")
                engine.destroy()
                del engine
                gc.collect()
                torch.manual_seed(99)  # different initial weights: the checkpoint must restore them
                engine = _engine(MODELS["mlp_norm"](), stage, checkpoint_dir)
            for micro, kind in enumerate(kinds):
                x = _batch(step, micro, rank)
                engine_micro_batch(engine, kind, x)
                _ddp_micro(ddp, kind, x, last=micro == GAS - 1)
                counts[kind] += 1
            ddp_opt.step()
            ddp_opt.zero_grad()
            gc.collect()
            stats = zero_lifetime.stats(engine)
            gathered, inconsistent = released_state(engine) if stage == 3 else ([], [])
            if stats["pinned_params"] or stats["live_handles"] or gathered or inconsistent:
                violations.append({"step": step, "stats": stats, "gathered": gathered,
                                   "inconsistent": inconsistent})
            rss.append(rss_bytes())
            objects.append(len(gc.get_objects()))  # gc.collect() ran above
        got = full_weights(engine)
        want = [p.detach() for p in reference.parameters()]
        first_counted = min(len(objects) - 1, steps // 2 + OBJECTS_WARMUP_STEPS)  # the reloaded engine warmed up
        record.update(
            steps=steps, micro_batches=counts, violations=violations[:5], n_violations=len(violations),
            max_abs_diff=max((g - w).abs().max().item() for g, w in zip(got, want)),
            moved=max((w - p0).abs().max().item() for w, p0 in zip(want, _initial_weights(seed=0))),
            rss_first=rss[min(len(rss) - 1, 5)], rss_last=rss[-1], rss_max=max(rss),
            objects_from=objects[first_counted], objects_last=objects[-1], objects_steps=len(objects) - 1 - first_counted,
            stats=zero_lifetime.stats(engine))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        record["error"] = traceback.format_exc(limit=-8)
    with open(os.path.join(out_dir, f"soak{rank}.json"), "w") as f:
        json.dump(record, f)


def _initial_weights(seed):
    import torch
    from harness import MODELS
    torch.manual_seed(seed)
    return [p.detach() for p in MODELS["mlp_norm"]().parameters()]
