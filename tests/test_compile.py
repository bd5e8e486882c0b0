"""engine.compile() (torch.compile of the engine's module) with zero_lifetime installed, 1 rank,
against plain torch; DeepCompile is refused. tests/test_two_ranks.py has the 2-rank cases."""

import inspect
import types

import deepspeed
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from packaging.version import Version
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

import zero_lifetime
from harness import (BACKWARD_PATHS, DS_VERSION, CountingBackend, assert_install_refused, assert_weights_match, graph_has_compiled_code, losses,
                     make_input, make_pair, reference_two_backwards, two_backwards)
from zero_lifetime.install import Installation
from zero_lifetime.zero3_lifetime import Zero3Lifetime

# Released after each module (no reuse, no prefetch), so a retained graph outlives the gathers.
EAGER_RELEASE = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled code is cached per code object: every test compiles anew, and leaves nothing."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_pair(model_name, stage, order, backend, policy="regather", compile_kwargs=None):
    engine, reference, ref_opt = make_pair(model_name, stage, **(EAGER_RELEASE if stage == 3 else {}))
    counting = CountingBackend(backend)
    if order == "install_then_compile":
        zero_lifetime.install(engine, policy=policy)
        engine.compile(backend=counting, **(compile_kwargs or {}))
    else:  # the order of accelerate / the HF Trainer: compiled at prepare, installed after
        engine.compile(backend=counting, **(compile_kwargs or {}))
        zero_lifetime.install(engine, policy=policy)
    return engine, reference, ref_opt, counting


def _train(engine, reference, ref_opt, model_name, schedule, path="engine", zero_grad=False):
    """schedule: per step, 1 (one backward) or 2 (two losses, the first graph retained)."""
    compiled_graphs = 0
    for step, backwards in enumerate(schedule):
        x = make_input(model_name, seed=step)
        out = engine(x)
        compiled_graphs += graph_has_compiled_code(out)
        if backwards == 1:
            engine.backward(losses(out)[0])
            losses(reference(x))[0].backward()
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            two_backwards(engine, out, path, zero_grad)
            reference_two_backwards(reference, ref_opt, x, zero_grad)
        engine.step()
    return compiled_graphs


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("order", ["compile_then_install", "install_then_compile"])
def test_compiled_engine_retained_backwards_match_torch(stage, order):
    engine, reference, ref_opt, backend = _compiled_pair("mlp_norm", stage, order, "aot_eager")
    compiled_steps = _train(engine, reference, ref_opt, "mlp_norm", [2, 1, 2])
    assert backend.graphs > 0 and compiled_steps == 3, (backend.graphs, compiled_steps)
    assert_weights_match(engine, reference)


@pytest.mark.parametrize("model_name, policy, path, zero_grad", [
    ("mlp_norm", "pin", BACKWARD_PATHS[-1], True),
    ("ckpt_nonreentrant", "regather", "engine", False),
    ("ckpt_reentrant", "pin", BACKWARD_PATHS[-1], False),
])
def test_compiled_zero3_models_and_policies_match_torch(model_name, policy, path, zero_grad):
    engine, reference, ref_opt, backend = _compiled_pair(model_name, 3, "compile_then_install", "aot_eager",
                                                         policy)
    compiled_steps = _train(engine, reference, ref_opt, model_name, [2, 2], path, zero_grad)
    assert backend.graphs > 0 and compiled_steps == 2, (backend.graphs, compiled_steps)
    assert_weights_match(engine, reference)
    assert zero_lifetime.stats(engine)["live_handles"] == 0


def _inner_code(function, name):
    return next(c for c in function.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


def test_bookkeeping_hooks_run_untraced():
    """zero_lifetime's module hooks run inside the compiled call: Dynamo must not trace them
    (it would guard on the params' state, recompile, and replay their side effects)."""
    engine, reference, ref_opt, backend = _compiled_pair("mlp_norm", 3, "compile_then_install", "aot_eager")
    _train(engine, reference, ref_opt, "mlp_norm", [2, 2])
    assert backend.graphs > 0
    hooks = [Installation._on_root_forward.__code__,
             _inner_code(Zero3Lifetime._note_gathered_hook, "note_gathered_before_forward")]
    for code in hooks:
        assert _debug_get_cache_entry_list(code) == [], f"Dynamo compiled {code.co_name}"
    assert_weights_match(engine, reference)


def test_inductor_compiled_zero3_matches_torch():
    """torch.compile's default backend (generated C++ kernels on the CPU)."""
    engine, reference, ref_opt, backend = _compiled_pair("mlp_norm", 3, "compile_then_install", "inductor")
    compiled_steps = _train(engine, reference, ref_opt, "mlp_norm", [2, 2])
    assert backend.graphs > 0 and compiled_steps == 2, (backend.graphs, compiled_steps)
    assert_weights_match(engine, reference)


# 0.17 has no compiled_autograd_enabled; on 0.18 DeepSpeed's own post-backward callback
# (queue_callback in a hook) fails under compiled autograd, stock and installed alike
# (tests/probe_compile_limits.py).
COMPILED_AUTOGRAD_WORKS = ("compiled_autograd_enabled" in inspect.signature(deepspeed.DeepSpeedEngine.compile).parameters
                           and Version(DS_VERSION) >= Version("0.19"))


@pytest.fixture
def aot_eager_backward_compiler():
    """DeepSpeed compiles the backward with its accelerator's backend (inductor on the CPU,
    a C++ build per graph): aot_eager here, DeepSpeed's own setting restored after."""
    accelerator = get_accelerator()
    before = accelerator.get_compile_backend()
    accelerator.set_compile_backend("aot_eager")
    yield
    accelerator.set_compile_backend(before)


@pytest.mark.skipif(not COMPILED_AUTOGRAD_WORKS, reason="DeepSpeed before 0.19 fails compiled autograd itself")
@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_autograd_zero12_retained_backwards_match_torch(stage, aot_eager_backward_compiler):
    """engine.compile(compiled_autograd_enabled=True): DeepSpeed runs engine.backward under
    compiled autograd, which captures the backward graph with the gradient hooks in it.
    (Stock ZeRO-2 fails here inside Dynamo, `tests/probe_compile_limits.py`; ZeRO-3 fails
    stock and installed alike.)"""
    counters.clear()
    engine, reference, ref_opt, backend = _compiled_pair("mlp_norm", stage, "compile_then_install", "aot_eager",
                                                         compile_kwargs={"compiled_autograd_enabled": True})
    compiled_steps = _train(engine, reference, ref_opt, "mlp_norm", [2, 1, 2])
    assert backend.graphs > 0 and compiled_steps == 3, (backend.graphs, compiled_steps)
    assert counters["compiled_autograd"]["captures"] > 0, dict(counters["compiled_autograd"])
    assert_weights_match(engine, reference)


def test_stock_compiled_zero3_still_fails_the_second_backward():
    """Negative control: compiling does not fix stock ZeRO-3's retained-graph crash."""
    engine, *_ = make_pair("mlp_norm", 3, **EAGER_RELEASE)
    engine.compile(backend=CountingBackend("aot_eager"))
    l1, l2 = losses(engine(make_input("mlp_norm", 0)))
    engine.backward(l1, retain_graph=True)
    with pytest.raises(RuntimeError, match="must be a matrix|size of tensor a \\(0\\)|vec \\(0\\)"):
        engine.backward(l2)


def test_deepcompile_is_refused_with_the_reason():
    """DeepCompile moves ZeRO's hooks into compiled passes: refused at install, before any
    patch, whether or not engine.compile() ran (its native op needs a GPU: not here)."""
    engine, *_ = make_pair("mlp_norm", 3, config={"compile": {"deepcompile": True}})
    assert engine.is_deepcompile_enabled()
    assert_install_refused(engine, 'DeepCompile.*drop "deepcompile"', "DeepCompile.*Continuing without zero_lifetime")
