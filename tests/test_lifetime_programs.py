"""Random programs of forwards, backwards, torch.autograd.grad, dropped graphs, zero_grad()
and step() on installed engines (1 rank), each operation checked against plain torch.

See lifetime_programs.py for what a program does and what is asserted after each operation.
ZL_LIFETIME_PROGRAMS sets the number of seeds per case (CI: 10; release testing: 100 or more);
ZL_LIFETIME_FIRST_SEED where they start (default 0), to run programs no earlier run has tried.
"""

import pytest

from harness import DS_VERSION, MODELS
from lifetime_programs import run_program
from program_cases import STAGE_AND_POLICY_IDS, STAGES_AND_POLICIES, seeds

SEEDS = seeds("ZL_LIFETIME_PROGRAMS", 10)
LENGTH = 40  # operations per program
EVERY_STAGE_AND_POLICY = pytest.mark.parametrize("stage, policy", STAGES_AND_POLICIES, ids=STAGE_AND_POLICY_IDS)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model_name", sorted(MODELS))
@EVERY_STAGE_AND_POLICY
def test_random_program_matches_torch(stage, policy, model_name, seed):
    runner = run_program(model_name, stage, policy, seed, LENGTH)
    assert runner.forwards > 0 and runner.operations == LENGTH


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("policy", ["regather", "pin"])
def test_random_program_with_deepspeeds_default_windows(policy, model_name, seed):
    """ZeRO-3 with DeepSpeed's default reuse distance and prefetch: its recorded trace decides
    what stays gathered, and the programs' mix of one and two passes per forward makes it
    re-record the trace (1-6 times a program), each time with fresh release decisions
    (adapters/zero3_trace.py). Everything still matches torch; what stays gathered is not
    checked (DeepSpeed keeps what its trace expects to reuse)."""
    runner = run_program(model_name, 3, policy, seed, LENGTH, windows="default")
    assert runner.forwards > 0 and runner.operations == LENGTH


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model_name", sorted(MODELS))
@EVERY_STAGE_AND_POLICY
def test_random_program_with_cpu_optimizer_offload(stage, policy, model_name, seed):
    """The same programs with CPU optimizer offload: the gradients step() reads live in the fp32
    partitions on the CPU, which DeepSpeed fills its own way (copy or accumulate by micro step)."""
    runner = run_program(model_name, stage, policy, seed, LENGTH, offload=True)
    assert runner.forwards > 0 and runner.operations == LENGTH


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@EVERY_STAGE_AND_POLICY
def test_random_program_with_gradient_accumulation(stage, policy, offload, model_name, seed):
    """gradient_accumulation_steps 2: every second step() closes the window, the others only
    count a micro-step; torch's reference backwards each loss divided by 2 and steps when the
    engine's window closes, whatever the backwards, zero_grad()s and autograd.grad between.
    With CPU optimizer offload too (it found ZeRO-1's window record reset by a zero_grad()
    inside the window)."""
    if offload and stage == 2 and DS_VERSION != "0.19.8":
        pytest.skip("a second backward in a micro-step is refused there (NotImplementedError, documented)")
    runner = run_program(model_name, stage, policy, seed, LENGTH, offload=offload, gas=2)
    assert runner.forwards > 0 and runner.operations == LENGTH


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_random_program_on_stage1_without_gradient_hooks(model_name, seed):
    """ZeRO-1 with contiguous_gradients and overlap_comm off: no DeepSpeed hook takes any
    gradient, .grad accumulates until a boundary backward's epilogue reduces it."""
    runner = run_program(model_name, 1, None, seed, LENGTH, gradient_hooks=False)
    assert runner.forwards > 0 and runner.operations == LENGTH
    assert runner.engine.optimizer._grad_acc_hooks == []


# Programs that found bugs, kept whatever ZL_LIFETIME_PROGRAMS is: stage 3, seed 23 lost a
# completed backward's gradients when the cleanup after a dead torch.autograd.grad (a graph
# saved before a step()) dropped them as for a dead training backward.
@pytest.mark.parametrize("model_name, stage, policy, seed", [("mlp_norm", 3, "regather", 23),
                                                             ("mlp_norm", 3, "pin", 23)])
def test_programs_that_found_bugs(model_name, stage, policy, seed):
    run_program(model_name, stage, policy, seed, LENGTH)


# Programs whose torch training runs away (found in 6000 more programs per release), kept
# whatever ZL_LIFETIME_PROGRAMS is: on 0.17.6 seed 1262 and on 0.18.9 seeds 2096 and 2238 reach
# NaN weights or outputs (the engine must be NaN where torch is); on 0.19.8 seeds 2096 (huge
# gradients) and 3001 (NaN gradients) make DeepSpeed skip a step whose gradient norm is not
# finite in float32, which torch applies (the reference skips it too, and only then).
@pytest.mark.parametrize("seed", [1262, 2096, 2238, 3001])
@EVERY_STAGE_AND_POLICY
def test_programs_whose_training_runs_away(stage, policy, seed):
    runner = run_program("tied_lm", stage, policy, seed, LENGTH)
    assert runner.operations == LENGTH
