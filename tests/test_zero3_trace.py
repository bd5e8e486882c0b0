"""DeepSpeed's ZeRO-3 trace re-recorded when the number of backwards per forward changes
(a first step with one backward, then two backwards every step): its cached release
decisions must follow the new trace (``adapters/zero3_trace.py``). Otherwise the second
backward of every later step fetches again what the first one released. 1 rank, against
plain torch."""

import pytest

import zero_lifetime
from harness import assert_weights_match, make_pair, released_state, train_step
from zero_lifetime.bench.step import count_param_fetches

# tied_lm's second loss is unbounded: at the harness's lr 0.1 its weights run away within 6 steps.
SMALL_STEPS = {"optimizer": {"type": "SGD", "params": {"lr": 0.01}}}


def _fetches_per_step(model_name, schedule, policy):
    """Per step of ``schedule`` (1 or 2 backwards over one forward): params fetched; the
    weights match torch's after every step."""
    engine, reference, ref_opt = make_pair(model_name, 3, config=SMALL_STEPS)
    zero_lifetime.install(engine, policy=policy)
    fetched = count_param_fetches(engine)
    per_step = []
    for step, passes in enumerate(schedule):
        before = fetched[0]
        train_step(engine, reference, ref_opt, model_name, step, passes, "engine", zero_grad=False)
        per_step.append(fetched[0] - before)
        assert_weights_match(engine, reference)
    assert released_state(engine) == ([], [])
    return per_step, zero_lifetime.stats(engine)


@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("model_name", ["mlp_norm", "tied_lm", "ckpt_nonreentrant"])
def test_two_backwards_after_a_single_first_step_fetch_as_when_always_two(model_name, policy):
    always_two, _ = _fetches_per_step(model_name, [2] * 6, policy)
    single_first, stats = _fetches_per_step(model_name, [1] + [2] * 5, policy)
    # Step 1 runs against the first step's trace and invalidates it, step 2 records a new one;
    # from step 3 on both engines run a complete trace of two backwards.
    assert single_first[3:] == always_two[3:], (single_first, always_two)
    assert stats["traces_recorded"] == 2  # the first step's trace, then the two-backward one
