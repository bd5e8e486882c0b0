"""A long run on an installed engine keeps nothing per step: after a few warm-up steps the
number of objects the garbage collector tracks (containers: tensors, autograd's Python
objects, hooks, every list, dict and set of the installation and of the pure-Python tracker;
not strings or numbers) stays where it was, over steps that mix a single backward, two
backwards over a retained graph, a retained graph dropped without its second backward, and a
backward by ``loss.backward()`` (0.18.9 on), with GAS 2. tests/test_soak.py bounds the
resident memory of a long 2-rank run; a leak of a small object each step stays far below
that bound and would only show after days of training.

The weights are checked against plain torch on the same schedule, so the run measured is a
run that trains correctly.
"""

import gc

import pytest

import zero_lifetime
from harness import TORCH_STYLE_BACKWARD, assert_weights_match, engine_micro_batch, losses, make_input, make_pair

GAS = 2
WARMUP_ROUNDS, ROUNDS = 3, 10
# One round: each kind once (two optimizer steps at GAS 2 with four kinds). 0.17.6 has no torch-style
# backward (it refuses loss.backward(): README, Supported versions).
KINDS = ("single", "two", "dropped") + (("manual", ) if TORCH_STYLE_BACKWARD else ())


def _objects_alive() -> int:
    gc.collect()
    return len(gc.get_objects())


def _reference_micro(reference, kind, x):
    """torch semantics of the same micro-batch: two backwards without zero_grad add up."""
    l1, l2 = losses(reference(x))
    ((l1 + l2) if kind == "two" else l1).div(GAS).backward()


@pytest.mark.parametrize("model_name,stage,policy", [
    ("mlp_norm", 1, None),
    ("mlp_norm", 2, None),
    ("mlp_norm", 3, "regather"),
    ("mlp_norm", 3, "pin"),
    ("ckpt_nonreentrant", 3, "regather"),
])
def test_no_objects_kept_per_step(model_name, stage, policy):
    engine, reference, ref_opt = make_pair(model_name, stage, gas=GAS)
    zero_lifetime.install(engine, **({"policy": policy} if policy else {}))
    micro_batches = 0

    def run_rounds(rounds):
        nonlocal micro_batches
        for _ in range(rounds):
            for kind in KINDS:
                x = make_input(model_name, seed=micro_batches)
                engine_micro_batch(engine, kind, x)
                _reference_micro(reference, kind, x)
                micro_batches += 1
                if micro_batches % GAS == 0:
                    ref_opt.step()
                    ref_opt.zero_grad()

    run_rounds(WARMUP_ROUNDS)
    before = _objects_alive()
    run_rounds(ROUNDS)
    after = _objects_alive()
    # A leak of one object a round would add ROUNDS; what else moves (a cache entry made or
    # dropped once) is a few objects either way.
    assert after - before < ROUNDS, (f"{after - before} more objects alive after {ROUNDS} rounds "
                                     f"({ROUNDS * len(KINDS)} micro-batches)")
    stats = zero_lifetime.stats(engine)
    assert stats["live_handles"] == 0 and stats["pinned_params"] == 0, stats
    assert_weights_match(engine, reference)
