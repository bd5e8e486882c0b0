"""Buckets never stay empty (DeepSpeed #7595): DeepSpeed's torch<2.1 hook path forced on
this torch, params unfrozen after initialize, and hooks that stop firing."""

import pytest
import torch

import deepspeed.utils.torch as ds_torch_utils
import multitask as mt
import zero_lifetime
from harness import BACKWARD_PATHS, DS_VERSION, assert_weights_match, make_pair, train_step
from zero_lifetime import grad_hook_guard
from zero_lifetime.grad_hook_guard import GradientsNotReducedError

STEPS = 2


@pytest.fixture
def legacy_hook_path(monkeypatch):
    """Make DeepSpeed believe torch < 2.1, so it hooks AccumulateGrad nodes it drops."""
    real = ds_torch_utils.required_torch_version

    def required_torch_version(min_version=None, max_version=None):
        if min_version == 2.1 and max_version is None:
            return False
        return real(min_version=min_version, max_version=max_version)

    monkeypatch.setattr(ds_torch_utils, "required_torch_version", required_torch_version)


def _engine(stage, offload, mode="summed"):
    model, reference = mt.make_models()
    engine = mt.build_engine(model, stage, mode, offload, "fp32")
    return engine, reference


@pytest.mark.parametrize("stage,offload", [(1, True), (2, True), (2, False)])
def test_stock_legacy_path_leaves_buckets_empty(legacy_hook_path, stage, offload):
    """Negative control: the reported failure, reproduced on this torch. DeepSpeed 0.18.9
    does not show it: its hooks on the AccumulateGrad nodes keep firing (counted: one per
    param), so stock trains as torch does there (measured; why the nodes live is not known)."""
    engine, reference = _engine(stage, offload)
    if DS_VERSION == "0.18.9":
        mt.train_engine(engine, "summed", 1)
        mt.train_reference(reference, "summed", 1)
        assert max(mt.max_differences(engine, reference).values()) <= 1e-5
        return
    with pytest.raises(IndexError):
        mt.train_engine(engine, "summed", 1)


@pytest.mark.parametrize("node_hooks", [False, True], ids=["post_accumulate", "accumulate_grad_node"])
@pytest.mark.parametrize("stage,offload", [(1, True), (2, True), (2, False), (3, False), (3, True)])
def test_legacy_path_trains_like_torch_with_install(legacy_hook_path, monkeypatch, stage, offload, node_hooks):
    if node_hooks:
        if stage == 3:
            pytest.skip("ZeRO-3 params change shape after the node is made; torch >= 2.1 "
                        "validates that, torch < 2.1 (where this path is used) does not")
        # The branch install takes on torch < 2.1: keep DeepSpeed's AccumulateGrad nodes alive.
        monkeypatch.setattr(grad_hook_guard, "USE_POST_ACCUMULATE_HOOK", False)
    engine, reference = _engine(stage, offload, "per_task")
    installation = zero_lifetime.install(engine)
    assert installation.grad_guard.recreated_hooks
    mt.train_engine(engine, "per_task", STEPS)
    mt.train_reference(reference, "per_task", STEPS)
    diffs = mt.max_differences(engine, reference)
    assert max(diffs.values()) <= 1e-5, diffs


@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_legacy_path_leaves_stage1_without_hooks_as_it_is(legacy_hook_path, path):
    """ZeRO-1 with contiguous_gradients and overlap_comm off makes no hooks on any torch: it
    reduces .grad at the boundary. None are made for it there either."""
    engine, reference, ref_opt = make_pair("mlp_norm", 1, contiguous_gradients=False, overlap_comm=False)
    installation = zero_lifetime.install(engine)
    assert not installation.grad_guard.recreated_hooks and not engine.optimizer._grad_acc_hooks
    for step in range(STEPS):
        train_step(engine, reference, ref_opt, "mlp_norm", step, 2, path, zero_grad=False)
    assert_weights_match(engine, reference)


def test_hooks_not_recreated_on_current_path():
    engine, _ = _engine(2, False)
    assert not zero_lifetime.install(engine).grad_guard.recreated_hooks


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dead_hooks_raise_a_clear_error(stage):
    """Hooks that stop firing: the backward names the params instead of an IndexError."""
    engine, _ = _engine(stage, False)
    zero_lifetime.install(engine)
    for handle in engine.optimizer._grad_acc_hooks:
        handle.remove()
    x = mt.batches(0)[0]
    with pytest.raises(GradientsNotReducedError, match="no DeepSpeed gradient hook received") as info:
        engine.backward(mt.task_loss(engine(x, 0)))
    assert "trunk.weight" in str(info.value)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_frozen_at_initialize_is_refused_at_install(stage):
    model, _ = mt.make_models()
    model.heads[1].weight.requires_grad_(False)
    engine = mt.build_engine(model, stage, "summed", False, "fp32")
    model.heads[1].weight.requires_grad_(True)  # unfrozen after initialize
    with pytest.raises(ValueError, match=r"not managed by the ZeRO optimizer.*heads\.1\.weight"):
        zero_lifetime.install(engine)
    # Nothing was left patched by the refused install.
    assert not {"forward", "backward", "step"} & set(engine.__dict__)
    patched = {"independent_gradient_partition_epilogue", "reduce_ipg_grads", "process_gradients",
               "reduce_ready_partitions_and_remove_grads"}
    assert not patched & set(engine.optimizer.__dict__), set(engine.optimizer.__dict__) & patched


@pytest.mark.parametrize("stage", [1, 2])
def test_param_unfrozen_after_install_fails_its_backward(stage):
    model, _ = mt.make_models()
    model.heads[0].bias.requires_grad_(False)
    engine = mt.build_engine(model, stage, "summed", False, "fp32")
    zero_lifetime.install(engine)
    model.heads[0].bias.requires_grad_(True)
    x = mt.batches(0)[0]
    with pytest.raises(GradientsNotReducedError, match=r"heads\.0\.bias"):
        engine.backward(mt.task_loss(engine(x, 0)))


def test_gradient_penalty_does_not_trip_the_check():
    """torch.autograd.grad writes no .grad: nothing to reduce, no error."""
    engine, _ = _engine(2, False)
    zero_lifetime.install(engine)
    x = mt.batches(0)[0].requires_grad_(True)
    out = engine(x, 0)
    (grad_x, ) = torch.autograd.grad(out.sum(), x, create_graph=True)
    engine.backward(mt.task_loss(out) + grad_x.pow(2).mean())
    engine.step()


@pytest.mark.parametrize("stage", [2, 3])
def test_install_that_fails_midway_patches_nothing(monkeypatch, stage):
    """A component failing late in install() unwinds the ones already installed."""
    from zero_lifetime import micro_step_window

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    engine, _ = _engine(stage, False)
    optimizer_attrs, engine_attrs = set(engine.optimizer.__dict__), set(engine.__dict__)
    param_attrs = [set(p.__dict__) for p in engine.module.parameters()]
    monkeypatch.setattr(micro_step_window.MicroStepWindow, "__init__", broken)
    with pytest.raises(RuntimeError, match="boom"):
        zero_lifetime.install(engine)
    assert set(engine.optimizer.__dict__) == optimizer_attrs
    assert set(engine.__dict__) == engine_attrs
    assert [set(p.__dict__) for p in engine.module.parameters()] == param_attrs
