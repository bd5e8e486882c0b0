"""install / uninstall / stats contract, bad input, and recovery from a failed backward."""

import gc
import logging

import pytest
import torch

import zero_lifetime
from harness import (BACKWARD_PATHS, DS_VERSION, TORCH_STYLE_BACKWARD, assert_install_refused, assert_weights_match,
                     losses, make_input, make_pair, reference_two_backwards, released_state, two_backwards)

STATS_KEYS = {"pinned_params", "pinned_bytes", "peak_pinned_bytes", "deferred_releases", "regathers"}


def test_install_rejects_non_engine():
    with pytest.raises(TypeError, match="DeepSpeedEngine"):
        zero_lifetime.install(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("kwargs, match", [({"policy": "keep"}, "policy"), ({"max_pinned_bytes": -5}, "max_pinned"),
                                           ({"max_pinned_bytes": 1.5}, "max_pinned")])
def test_install_rejects_bad_arguments(kwargs, match):
    engine, *_ = make_pair("mlp_norm", 3)
    with pytest.raises(ValueError, match=match):
        zero_lifetime.install(engine, **kwargs)


def test_install_twice_returns_same_handle_and_uninstall_restores():
    engine, *_ = make_pair("mlp_norm", 3)
    patched = ("forward", "backward", "zero_grad", "step") + (("scale", ) if TORCH_STYLE_BACKWARD else ())
    before = {name: getattr(engine, name).__func__ for name in patched}
    handle = zero_lifetime.install(engine)
    assert zero_lifetime.install(engine, policy="pin") is handle
    assert all(name in engine.__dict__ for name in patched)
    assert STATS_KEYS <= set(zero_lifetime.stats(engine))
    assert zero_lifetime.uninstall(engine) is True
    assert {name: getattr(engine, name).__func__ for name in patched} == before
    assert zero_lifetime.uninstall(engine) is False
    with pytest.raises(ValueError, match="not installed"):
        zero_lifetime.stats(engine)
    # Stock behaviour is back: the upstream failure returns.
    with pytest.raises(RuntimeError, match="size of tensor a \\(0\\)"):
        two_backwards(engine, engine(make_input("mlp_norm", 0)), "engine", zero_grad=True)


@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_install_leaves_stage3_machinery_alone(stage):
    engine, *_ = make_pair("mlp_norm", stage)
    handle = zero_lifetime.install(engine)
    assert handle.lifetime is None and handle.tracker is None
    stats = zero_lifetime.stats(engine)
    assert stats["stage"] == stage and stats["pinned_params"] == 0


def _patched_methods(obj):
    """The callables an instance holds in its own __dict__ (where per-instance patches live)."""
    return {name: value for name, value in vars(obj).items() if callable(value)}


@pytest.mark.parametrize("stage,offload", [(1, False), (1, True), (2, False), (2, True), (3, False)])
def test_uninstall_leaves_optimizer_and_params_as_found(stage, offload):
    """Several layers wrap the same DeepSpeed methods; uninstall must unwind all of them."""
    engine, *_ = make_pair("mlp_norm", stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {}))
    optimizer, params = engine.optimizer, list(engine.module.parameters())
    before = _patched_methods(optimizer), [_patched_methods(p) for p in params]
    zero_lifetime.install(engine)
    assert _patched_methods(optimizer) != before[0]  # install did patch this optimizer
    two_backwards(engine, engine(make_input("mlp_norm", 0)), "engine", zero_grad=False)
    engine.step()
    assert zero_lifetime.uninstall(engine) is True
    assert _patched_methods(optimizer) == before[0]
    assert [_patched_methods(p) for p in params] == before[1]


def test_unknown_deepspeed_internals_fail_clearly(monkeypatch):
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    monkeypatch.delattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__release_param")
    engine, *_ = make_pair("mlp_norm", 3)
    assert_install_refused(engine, "Supported DeepSpeed versions: 0.17.6, 0.18.9, 0.19.8")


def test_release_decisions_no_longer_cached_fail_clearly(monkeypatch):
    """adapters/zero3_trace clears DeepSpeed's lru_cache of release decisions: a DeepSpeed
    whose decisions are no longer cached that way is refused, leaving no hook behind."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    monkeypatch.setattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release",
                        lambda self, submodule, step_id: set())
    engine, *_ = make_pair("mlp_norm", 3)
    _assert_refused_leaving_no_hook(engine, "no longer an lru_cache")


def test_module_stack_no_longer_a_list_fails_clearly(monkeypatch):
    """adapters/zero3_teardown drops a destroyed engine from DeepSpeed's FWD_MODULE_STACK: a
    DeepSpeed without that list is refused at install, leaving no hook behind."""
    from deepspeed.runtime.zero import parameter_offload
    engine, *_ = make_pair("mlp_norm", 3)
    monkeypatch.delattr(parameter_offload, "FWD_MODULE_STACK")
    _assert_refused_leaving_no_hook(engine, "forward module stack")


def _assert_refused_leaving_no_hook(engine, error_match: str):
    """A version error naming what is missing, and the root module's pre-forward hooks as
    they were (the trace adapter registers one before the teardown adapter probes)."""
    pre_hooks = dict(engine.module._forward_pre_hooks)
    message = assert_install_refused(engine, error_match)
    assert "Supported DeepSpeed versions" in message
    assert dict(engine.module._forward_pre_hooks) == pre_hooks


def test_unknown_deepspeed_version_fails_clearly(monkeypatch):
    import deepspeed
    engine, *_ = make_pair("mlp_norm", 2)
    monkeypatch.setattr(deepspeed, "__version__", "0.18.0")
    assert_install_refused(engine, "does not support DeepSpeed 0.18.0. Supported DeepSpeed versions: 0.17.6, "
                           "0.18.9, 0.19.8")


def _engine_with(stage: int, **config):
    """A DeepSpeed engine over the harness model, with top-level config keys replaced (None: removed)."""
    import deepspeed
    from harness import MODELS, ds_config
    cfg = {**ds_config(stage), **config}
    model = MODELS["mlp_norm"]()
    engine, *_ = deepspeed.initialize(model=model, config={k: v for k, v in cfg.items() if v is not None},
                                      model_parameters=model.parameters())
    return engine


@pytest.mark.parametrize("stage, config, runs, advice", [
    # 0.17.6 spells DDP_BFLOAT16 like BFLOAT16, so its fp16 wrapper takes this case first.
    (1, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
     "FP16_UnfusedOptimizer" if DS_VERSION == "0.17.6" else "BF16_Optimizer", "or use ZeRO stage 2"),
])
def test_engine_without_a_zero_optimizer_is_refused_with_the_reason(stage, config, runs, advice):
    """For these configurations DeepSpeed runs another optimizer under the same ZeRO stage:
    the refusal says so and what to change, instead of blaming the DeepSpeed version."""
    engine = _engine_with(stage, **config)
    assert type(engine.optimizer).__name__ == runs  # what DeepSpeed chose, not our doing
    before = _patched_methods(engine.optimizer)
    message = assert_install_refused(engine, warning_match=f"optimizer is {runs}.*Continuing without zero_lifetime")
    assert f"this engine's optimizer is {runs}" in message and advice in message, message
    assert "does not recognise DeepSpeed" not in message
    assert _patched_methods(engine.optimizer) == before  # neither call patched the optimizer


def test_stage0_engine_with_an_optimizer_is_refused_without_one_installed():
    """Stage 0 trains through no ZeRO optimizer: refused. Built without an optimizer it is a
    frozen model (tests/test_frozen_engine.py): installed."""
    trained = _engine_with(0)
    with pytest.raises(ValueError, match="supports ZeRO stages 1, 2 and 3; this engine runs stage 0 with an optimizer"):
        zero_lifetime.install(trained)
    assert "forward" not in trained.__dict__  # nothing patched
    frozen = _engine_with(0, optimizer=None)
    assert zero_lifetime.install(frozen).stats()["without_optimizer"]
    assert "forward" in frozen.__dict__  # its forward removes DeepSpeed's output hooks


def test_semantics_logged_once_at_install(caplog):
    engine, *_ = make_pair("mlp_norm", 2)
    # A child of DeepSpeed's logger, which does not propagate to the root: listen on it.
    logger = logging.getLogger("DeepSpeed.zero_lifetime")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed.zero_lifetime"):
            zero_lifetime.install(engine)
            zero_lifetime.install(engine)
    finally:
        logger.removeHandler(caplog.handler)
    # One record; the handler may see it twice when another library made DeepSpeed's
    # logger propagate to the root logger (where caplog listens too).
    assert len({id(r) for r in caplog.records if "torch semantics" in r.message}) == 1


class Boom(Exception):
    pass


@pytest.mark.parametrize("policy", ["regather", "pin"])
# loss.backward() alone is refused on DeepSpeed 0.17.6 (see test_retain_graph).
@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_exception_mid_backward_leaves_nothing_held(policy, path):
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy=policy)

    def explode(grad):
        raise Boom()

    def failing_backward():
        # In a function, so no traceback frame keeps the graph alive afterwards.
        l1, _ = losses(engine(make_input("mlp_norm", 99)))
        try:
            engine.backward(l1, retain_graph=True) if path == "engine" else l1.backward(retain_graph=True)
        except Boom:
            return True
        return False

    handle = engine.module.l1.weight.register_hook(explode)
    assert failing_backward()
    handle.remove()
    gc.collect()
    engine.zero_grad()  # the next call notices the dead backward and cleans up
    stats = zero_lifetime.stats(engine)
    assert stats["failed_backwards"] == 1
    assert stats["pinned_params"] == 0 and stats["live_handles"] == 0, stats
    assert released_state(engine) == ([], [])

    # The next step runs and is correct (the failed step contributed nothing).
    x = make_input("mlp_norm", 0)
    two_backwards(engine, engine(x), path, zero_grad=False)
    engine.step()
    reference_two_backwards(reference, ref_opt, x, zero_grad=False)
    assert_weights_match(engine, reference)
