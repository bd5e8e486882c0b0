"""Random lifetime programs on 2 ranks over gloo, each operation checked against plain torch.

The programs of test_lifetime_programs.py (forwards, backwards retained or not, autograd.grad,
dropped graphs, zero_grad(), step()), run by both ranks in step on different inputs, with
torch's reference averaging its gradients over the ranks before each step. What 1 rank cannot
reach: ZeRO-3 params really partitioned (gathers are all-gathers, released params hold half
the weights), gradients reduce-scattered or averaged over the ranks, dead backwards on both.
ZL_TWO_RANK_PROGRAMS sets the seeds per case (CI: 2); ZL_LIFETIME_FIRST_SEED where they start.
"""

import pytest

import two_rank_programs_worker as worker
from harness import DS_VERSION, MODELS
from program_cases import seeds
from rank_spawn import spawn_ranks

SEEDS = seeds("ZL_TWO_RANK_PROGRAMS", 2)
LENGTH = 40  # operations per program, as on 1 rank
CASES = worker.cases(sorted(MODELS), SEEDS, LENGTH, DS_VERSION)
SPAWN_DEADLINE_S = 1800  # only reached when something hangs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(worker.main, str(tmp_path_factory.mktemp("two_rank_programs")), 2, SPAWN_DEADLINE_S, CASES)


def test_ranks_finished(results):
    results.assert_finished([case["id"] for case in CASES])


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_random_program_on_two_ranks_matches_torch(results, case):
    for rank, record in enumerate(results.records(case["id"])):
        assert record["world"] == 2 and record["operations"] == LENGTH and record["forwards"] > 0, (rank, record)
