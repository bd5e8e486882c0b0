"""DeepSpeed's AutoEP (automatic expert parallelism, DeepSpeed 0.19+) on ZeRO-3 and ZeRO-2 over
2 gloo ranks, installed, with two backwards over one forward: against the original model in
plain torch (tests/autoep_worker.py).

AutoEP puts each expert param in its own partition group (``ds_process_group``): on ZeRO-3
the expert params are gathered, reduced and partitioned over the expert-data-parallel group, so
a bucket never mixes them with the dense params, and the lifetime tracker re-gathers them
through DeepSpeed's own gather like any other param.
"""

import pytest

import autoep_worker as worker
from rank_spawn import spawn_ranks

ATOL = 1e-5
SPAWN_DEADLINE_S = 300  # only reached when something hangs


@pytest.fixture(scope="module")
def autoep_results(tmp_path_factory):
    pytest.importorskip("deepspeed.module_inject.auto_ep", reason="AutoEP is DeepSpeed 0.19+")
    return spawn_ranks(worker.main, str(tmp_path_factory.mktemp("autoep")), worker.WORLD, SPAWN_DEADLINE_S)


def test_autoep_ranks_finished(autoep_results):
    autoep_results.assert_finished(sc["id"] for sc in worker.SCENARIOS)


def _assert_matches_torch(records, ep):
    for rank, record in enumerate(records):
        bad = {name: diff for name, diff in record["abs_diff"].items() if not diff <= ATOL}
        assert not bad, f"rank {rank}: differs from torch: {bad}"
        assert len(record["expert_params"]) == 6, "AutoEP replaced no expert: the test checks nothing of it"
        want_experts = [2 * rank, 2 * rank + 1] if ep == 2 else [0, 1, 2, 3]
        assert all(experts == want_experts for experts in record["local_experts"].values()), record["local_experts"]


INSTALLED = [sc for sc in worker.SCENARIOS if sc["install"]]


@pytest.mark.parametrize("sc", INSTALLED, ids=[sc["id"] for sc in INSTALLED])
def test_autoep_two_backwards_installed_match_torch(autoep_results, sc):
    records = autoep_results.records(sc["id"])
    _assert_matches_torch(records, sc["ep"])
    for record in records:
        stats = record["stats"]
        assert stats["filled_grads"] > 0  # the fused bucket fill carried the gradients
        if sc["stage"] == 3 and sc["policy"] == "pin":  # params the retained graph held stayed gathered
            assert stats["deferred_releases"] > 0 and stats["peak_pinned_bytes"] > 0, stats
        elif sc["stage"] == 3:  # regather: gathered again for the second backward, nothing held
            assert stats["peak_pinned_bytes"] == 0, stats


SUMMED = [sc for sc in worker.SCENARIOS if sc["backwards"] == "summed"]


@pytest.mark.parametrize("sc", SUMMED, ids=[sc["id"] for sc in SUMMED])
def test_stock_autoep_summed_loss_matches_the_oracle(autoep_results, sc):
    """The oracle and its mapping of AutoEP's layout against DeepSpeed itself."""
    _assert_matches_torch(autoep_results.records(sc["id"]), sc["ep"])


def test_stock_autoep_zero3_two_backwards_fail(autoep_results):
    """What install fixes, with AutoEP too: stock ZeRO-3 released the params the second
    backward needs."""
    for rank in range(worker.WORLD):
        error = autoep_results.by_id["stock-autoep-stage3-ep2-two"][rank]["error"]
        assert error and "must match the size of tensor" in error, error
