"""DeepSpeed checkpoints and install (1 rank, stages 1-3, CPU optimizer offload or not): steps
of two backwards over one forward, save_checkpoint, then either a rollback into the same
installed engine (load_checkpoint after more steps) or a resume in a fresh engine built from
other weights, installed before or after its load_checkpoint. Against plain torch restored from
its state_dict at the same points; on ZeRO-3 nothing stays gathered."""

import copy

import pytest

import zero_lifetime
from harness import assert_weights_match, make_pair, released_state, train_step

CASES = [(1, None), (2, None), (3, "regather"), (3, "pin")]
IDS = ["stage1", "stage2", "stage3-regather", "stage3-pin"]


def _pair(stage, offload, seed=0):
    zero = {"offload_optimizer": {"device": "cpu"}} if offload else {}
    return make_pair("mlp_norm", stage, seed=seed, **zero)


def _train(engine, reference, ref_opt, steps, zero_grad_at=None):
    for step in steps:
        train_step(engine, reference, ref_opt, "mlp_norm", step, 2, "engine", zero_grad=step == zero_grad_at)


def _check(engine, reference, stage):
    assert_weights_match(engine, reference)
    if stage == 3:
        assert released_state(engine) == ([], [])


@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize("stage,policy", CASES, ids=IDS)
def test_rollback_into_the_installed_engine(tmp_path, stage, policy, offload):
    engine, reference, ref_opt = _pair(stage, offload)
    zero_lifetime.install(engine, policy=policy)
    _train(engine, reference, ref_opt, range(2))
    engine.save_checkpoint(str(tmp_path), tag="mid")
    saved = copy.deepcopy(reference.state_dict())
    _train(engine, reference, ref_opt, range(2, 4))
    engine.load_checkpoint(str(tmp_path), tag="mid")
    reference.load_state_dict(saved)  # SGD keeps no state: the weights are all there is
    _train(engine, reference, ref_opt, range(4, 7), zero_grad_at=5)
    _check(engine, reference, stage)


@pytest.mark.parametrize("install_first", [True, False], ids=["install_then_load", "load_then_install"])
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize("stage,policy", CASES, ids=IDS)
def test_resume_in_a_fresh_engine(tmp_path, stage, policy, offload, install_first):
    engine, reference, ref_opt = _pair(stage, offload)
    zero_lifetime.install(engine, policy=policy)
    _train(engine, reference, ref_opt, range(2))
    engine.save_checkpoint(str(tmp_path), tag="mid")
    engine.destroy()
    resumed, _, _ = _pair(stage, offload, seed=7)  # other weights: the checkpoint must restore them
    if install_first:
        zero_lifetime.install(resumed, policy=policy)
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    if not install_first:
        zero_lifetime.install(resumed, policy=policy)
    _train(resumed, reference, ref_opt, range(2, 5), zero_grad_at=3)
    _check(resumed, reference, stage)
    resumed.destroy()
