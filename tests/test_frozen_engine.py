"""install() on an engine built without an optimizer, ZeRO-3 or stage 0: a frozen reward (or
reference, teacher, discriminator) model in an engine of its own, through which the trained
engine's gradients flow, two backwards over one forward. Against plain torch (one process; the
2-rank runs against the same oracle in tests/frozen_engine_worker.py).

Stock, the second backward fails: DeepSpeed released the params the reward's LayerNorm saved
(``engine.module(x)``, and ``engine(x)`` on 0.17.6), or, on 0.18.9 and 0.19.8, the first
backward through ``engine(x)`` raises already ("Direct calls to tensor.backward() are not
supported": the hooks DeepSpeed puts on the outputs of an engine without a ZeRO optimizer).
On stage 0 those hooks raise in fp32 and, in bf16, divide the gradient by the engine's GAS.
"""

import copy
import gc

import pytest
import torch

import zero_lifetime
from frozen_reward import (FEATURES, HIDDEN, batch, engine_without_optimizer, gathered_weights, losses,
                           policy_and_reward, reward_steps)
from harness import (BACKWARD_PATHS, DS_VERSION, TORCH_STYLE_BACKWARD, assert_moved, assert_weights_match, backward_by,
                     ds_config, released_state)
from rank_spawn import spawn_ranks

import frozen_engine_worker as worker

LR, WINDOWS = 0.1, 3
SPAWN_DEADLINE_S = 300  # only reached when something hangs


def _torch_step_per_window(params, gas=1):
    """The torch side's ``optimizer_step()``, called once per micro step: SGD once every
    ``gas`` calls."""
    optimizer = torch.optim.SGD(params, lr=LR)
    micro_steps = [0]

    def step():
        micro_steps[0] += 1
        if micro_steps[0] % gas == 0:
            optimizer.step()
            optimizer.zero_grad()

    return step


def _torch_reference(policy, reward, gas, forwards=1):
    """Plain torch: ``(loss / gas).backward()`` per micro step, one SGD step per window."""
    reward_steps(policy, reward, lambda loss, retain_graph=False: (loss / gas).backward(retain_graph=retain_graph),
                 _torch_step_per_window(policy.parameters(), gas), steps=WINDOWS * gas, forwards=forwards)


def _engines(stage, policy="regather", gas=1, install_reward=True, reward_stage=3, dtype=torch.float32):
    """(the trained policy's engine, installed; the reward's engine without optimizer, on ZeRO-3
    or stage 0, its model in ``dtype``), and plain-torch copies of both (made before DeepSpeed
    partitions the models)."""
    import deepspeed
    policy_model, reward_model = policy_and_reward()
    reward_model.to(dtype)
    copies = copy.deepcopy(policy_model), copy.deepcopy(reward_model)
    policy_engine, *_ = deepspeed.initialize(model=policy_model, config=ds_config(stage, lr=LR, gas=gas),
                                             model_parameters=policy_model.parameters())
    zero_lifetime.install(policy_engine, policy=policy)
    reward_engine = engine_without_optimizer(reward_model, gas=gas, stage=reward_stage, bf16=dtype == torch.bfloat16)
    if install_reward:
        assert zero_lifetime.install(reward_engine, policy=policy).stage == reward_stage
    return policy_engine, reward_engine, copies


def _forward_of(reward_engine, forward):
    return reward_engine if forward == "engine" else reward_engine.module


def _train_through_frozen_engine(stage, policy="regather", forward="engine", path="engine", gas=1, forwards=1):
    policy_engine, reward_engine, (policy_copy, reward_copy) = _engines(stage, policy, gas)
    reward_steps(policy_engine, _forward_of(reward_engine, forward),
                 lambda loss, retain_graph=False: backward_by(policy_engine, loss, path, retain_graph),
                 policy_engine.step, steps=WINDOWS * gas, forwards=forwards)
    _torch_reference(policy_copy, reward_copy, gas, forwards)
    assert_weights_match(policy_engine, policy_copy)
    assert_moved(policy_engine, policy_and_reward()[0])
    for got, want in zip(gathered_weights(reward_engine), reward_copy.parameters()):
        assert torch.equal(got, want)  # frozen: untouched
    gc.collect()
    assert released_state(reward_engine) == ([], [])  # nothing left gathered once the graphs are gone
    if stage == 3:
        assert released_state(policy_engine) == ([], [])
    stats = zero_lifetime.stats(reward_engine)
    assert stats["without_optimizer"] and stats["live_handles"] == 0 and stats["pinned_bytes"] == 0
    return stats


@pytest.mark.parametrize("forward", ["engine", "module"])
@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trained_through_a_frozen_engine_matches_torch(stage, policy, forward):
    stats = _train_through_frozen_engine(stage, policy, forward)
    if policy == "pin":
        assert stats["peak_pinned_bytes"] > 0  # the saved params stayed gathered between the backwards


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_gradient_accumulation_divides_once(path, gas):
    """The reward engine has the policy's gradient_accumulation_steps too (TRL builds it from the
    same config): its outputs must not divide what the policy's backward divided already."""
    _train_through_frozen_engine(3, path=path, gas=gas)


@pytest.mark.parametrize("policy", ["regather", "pin"])
def test_several_forwards_of_the_frozen_engine_in_one_step(policy):
    """The rewards of two batches, each its own forward of the reward engine, in one loss."""
    _train_through_frozen_engine(3, policy, forwards=2)


@pytest.mark.skipif(DS_VERSION != "0.17.6", reason="0.18.9 and 0.19.8 raise at the first backward")
def test_stock_0_17_6_several_forwards_leave_the_reward_gathered():
    """Negative control for the test above: stock 0.17.6 runs it, and keeps every reward param
    gathered after it (installed: none)."""
    policy_engine, reward_engine, _ = _engines(3, install_reward=False)
    reward_steps(policy_engine, reward_engine, policy_engine.backward, policy_engine.step, forwards=2)
    gc.collect()
    gathered, _ = released_state(reward_engine)
    assert len(gathered) == len(list(reward_engine.module.parameters()))


@pytest.mark.parametrize("forward", ["engine", "module"])
def test_stock_fails_where_installed_trains(forward):
    """Negative control: the same run with the reward engine not installed."""
    policy_engine, reward_engine, _ = _engines(3, install_reward=False)
    raises_at_once = forward == "engine" and TORCH_STYLE_BACKWARD
    message = "Direct calls to tensor.backward" if raises_at_once else "normalized_shape"
    with pytest.raises(RuntimeError, match=message):
        reward_steps(policy_engine, _forward_of(reward_engine, forward), policy_engine.backward, policy_engine.step)


@pytest.mark.parametrize("policy", ["regather", "pin"])
@pytest.mark.parametrize("forward", ["engine", "module"])
def test_input_gradients_twice_through_a_frozen_engine(forward, policy):
    """No trained engine at all: two torch.autograd.grad of the frozen model's output for its
    input over one forward (a critic's gradient penalty, a saliency map)."""
    _, reward_model = policy_and_reward()
    reward_copy = copy.deepcopy(reward_model)
    engine = engine_without_optimizer(reward_model)
    zero_lifetime.install(engine, policy=policy)
    for step in range(2):
        x = batch(step, rank=0).repeat(1, 2).requires_grad_()
        out, want_out = _forward_of(engine, forward)(x), reward_copy(x)
        got = [torch.autograd.grad(loss, x, retain_graph=True)[0] for loss in losses(out)]
        want = [torch.autograd.grad(loss, x, retain_graph=True)[0] for loss in losses(want_out)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        del out
        gc.collect()
        assert released_state(engine) == ([], [])


def _penalty_steps(policy, reward, backward, optimizer_step, steps=3):
    """One backward per step of the reward plus a penalty on its gradient for the policy's
    output (create_graph: the backward runs through the reward's backward too)."""
    for step in range(steps):
        features = policy(batch(step))
        out = reward(features)
        (grad,) = torch.autograd.grad(out.sum(), features, create_graph=True)
        backward(-out.mean() + 0.5 * grad.pow(2).sum(dim=1).mean())
        optimizer_step()


@pytest.mark.parametrize("policy", ["regather", "pin", "stock"])
@pytest.mark.parametrize("forward", ["engine", "module"])
def test_gradient_penalty_through_a_frozen_engine(forward, policy):
    """A gradient penalty through the frozen model, against torch. Stock (the reward engine not
    installed) fails even this one backward: the penalty's double backward meets the params
    DeepSpeed released after the inner gradient."""
    install = policy != "stock"
    policy_engine, reward_engine, (policy_copy, reward_copy) = _engines(
        3, "regather" if policy == "stock" else policy, install_reward=install)

    def train():
        _penalty_steps(policy_engine, _forward_of(reward_engine, forward), policy_engine.backward, policy_engine.step)

    if not install:
        with pytest.raises(RuntimeError, match="Direct calls|invalid for input of size 0|must be a matrix"):
            train()
        return
    train()
    _penalty_steps(policy_copy, reward_copy, torch.Tensor.backward, _torch_step_per_window(policy_copy.parameters()))
    assert_weights_match(policy_engine, policy_copy)
    gc.collect()
    assert released_state(reward_engine) == ([], [])


def _train_through_stage0_engine(stage, dtype, gas, path="engine", install=True):
    """The reward in a stage-0 engine without optimizer (bf16: DeepSpeed's bf16 mode, the reward
    fed the policy's output in bf16), the policy on ZeRO ``stage``: (policy engine, torch copy)."""
    policy_engine, reward_engine, (policy_copy, reward_copy) = _engines(
        stage, gas=gas, install_reward=install, reward_stage=0, dtype=dtype)
    reward_steps(policy_engine, lambda features: reward_engine(features.to(dtype)).float(),
                 lambda loss, retain_graph=False: backward_by(policy_engine, loss, path, retain_graph),
                 policy_engine.step, steps=WINDOWS * gas)
    _torch_reference(policy_copy, lambda features: reward_copy(features.to(dtype)).float(), gas)
    for got, want in zip(reward_engine.module.parameters(), reward_copy.parameters()):
        assert torch.equal(got, want)
    return policy_engine, policy_copy


STAGE0_CASES = [(stage, dtype, gas, "engine") for stage in (1, 2) for dtype in ("fp32", "bf16") for gas in (1, 2)]
if "manual" in BACKWARD_PATHS:
    STAGE0_CASES += [(2, dtype, 2, "manual") for dtype in ("fp32", "bf16")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("stage, dtype, gas, path", STAGE0_CASES)
def test_stage0_frozen_engine_matches_torch(stage, dtype, gas, path):
    """A stage-0 engine without optimizer (TRL's reward and reference models beside a ZeRO-1/2
    model): through ``engine(x)``, torch's weights."""
    policy_engine, policy_copy = _train_through_stage0_engine(stage, DTYPES[dtype], gas, path)
    assert_weights_match(policy_engine, policy_copy)
    assert zero_lifetime.stats(policy_engine)  # the trained engine's own installation ran


@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="0.17.6 puts no hooks on the outputs: stock is right there")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_stock_stage0_frozen_engine_raises_or_divides(dtype):
    """Negative control: stock 0.18.9 and 0.19.8 raise at the first backward through ``engine(x)``
    in fp32, and in bf16 divide the gradient through it by its gradient_accumulation_steps (in a
    plain loss.backward(); 0.19.8's engine.backward marks its graph, which every engine's output
    hooks then leave undivided)."""
    if dtype == "fp32":
        with pytest.raises(RuntimeError, match="Direct calls to tensor.backward"):
            _train_through_stage0_engine(2, torch.float32, 2, path="manual", install=False)
        return
    policy_engine, policy_copy = _train_through_stage0_engine(2, torch.bfloat16, 2, path="manual", install=False)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_weights_match(policy_engine, policy_copy)


# 0.17.6 reduces only inside an engine's own backward: A's gradients from B's backward are refused.
@pytest.mark.skipif(not TORCH_STYLE_BACKWARD, reason="loss.backward() reduces nothing on this DeepSpeed")
@pytest.mark.parametrize("frozen_stage", [3, 0])
@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_frozen_engine_between_two_trained_engines(path, frozen_stage):
    """Trained engine A, then the frozen engine, then trained engine B (a frozen feature
    extractor between an adapter and a head), GAS 2, two backwards: B sees its input come from
    A's output through the frozen ops, and must undo its output division on it once, as for A
    fed straight into B (README, engines fed engines); the frozen engine divides nothing."""
    import deepspeed
    gas = 2
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 8),
              torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).requires_grad_(False),
              torch.nn.Linear(8, 1)]
    adapter_copy, frozen_copy, head_copy = (copy.deepcopy(m) for m in models)
    adapter, head = (deepspeed.initialize(model=m, config=ds_config(3, lr=LR, gas=gas), model_parameters=m.parameters())[0]
                     for m in (models[0], models[2]))
    frozen = engine_without_optimizer(models[1], gas=gas, stage=frozen_stage)
    for engine in (adapter, head, frozen):
        zero_lifetime.install(engine)
    torch_step = _torch_step_per_window([*adapter_copy.parameters(), *head_copy.parameters()], gas)
    for micro_step in range(WINDOWS * gas):
        first, second = losses(head(frozen(adapter(batch(micro_step)))))
        backward_by(head, first, path, retain_graph=True)
        backward_by(head, second, path)
        adapter.step()
        head.step()
        (sum(losses(head_copy(frozen_copy(adapter_copy(batch(micro_step)))))) / gas).backward()
        torch_step()
    assert_weights_match(adapter, adapter_copy)
    assert_weights_match(head, head_copy)


class Boom(Exception):
    pass


def test_a_backward_that_raises_releases_what_it_held():
    policy_engine, reward_engine, _ = _engines(3, policy="pin")
    armed = [False]

    def explode(grad):
        if armed[0]:
            raise Boom()
        return grad

    def hook_the_output(module, inputs, output):
        output.register_hook(explode)

    handle = reward_engine.module[1].register_forward_hook(hook_the_output)  # the LayerNorm
    reward = reward_engine(policy_engine(batch(0)))
    first, second = losses(reward)
    policy_engine.backward(first, retain_graph=True)
    armed[0] = True
    with pytest.raises(Boom):
        policy_engine.backward(second)
    armed[0] = False
    handle.remove()
    del reward, first, second
    gc.collect()
    assert zero_lifetime.stats(reward_engine)["failed_backwards"] == 1
    assert released_state(reward_engine) == ([], [])
    assert zero_lifetime.stats(reward_engine)["pinned_bytes"] == 0
    policy_engine.zero_grad()
    # And it trains on: the next steps' two backwards run.
    reward_steps(policy_engine, reward_engine, policy_engine.backward, policy_engine.step, steps=2)
    gc.collect()
    assert released_state(reward_engine) == ([], [])


def test_uninstall_gives_stock_back_and_destroy_ends_it():
    policy_engine, reward_engine, _ = _engines(3)
    assert zero_lifetime.install(reward_engine) is zero_lifetime.install(reward_engine)
    assert zero_lifetime.uninstall(reward_engine)
    with pytest.raises(ValueError, match="not installed"):
        zero_lifetime.stats(reward_engine)
    with pytest.raises(RuntimeError, match="normalized_shape"):  # stock again
        reward_steps(policy_engine, reward_engine.module, policy_engine.backward, policy_engine.step, steps=1)
    policy_engine.zero_grad()
    zero_lifetime.install(reward_engine)
    reward_engine.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        zero_lifetime.install(reward_engine)


def test_reward_params_that_require_grad_get_torch_gradients():
    """An engine without optimizer whose params still require grad (a reference model loaded
    as is): its params' .grad holds the full gradient, as stock after one backward, and after two
    the sum of both, as torch."""
    policy_engine, reward_engine, (policy_copy, reward_copy) = _engines(3)
    reward_engine.module.requires_grad_(True)
    reward_copy.requires_grad_(True)
    first, second = losses(reward_engine(policy_engine(batch(0))))
    policy_engine.backward(first, retain_graph=True)
    policy_engine.backward(second)
    sum(losses(reward_copy(policy_copy(batch(0))))).backward()
    for name, param in reward_engine.module.named_parameters():
        want = dict(reward_copy.named_parameters())[name].grad
        torch.testing.assert_close(param.grad, want, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("reward_stage", [3, 0])
def test_params_that_require_grad_are_warned_about_at_install(reward_stage):
    """Nothing reduces, applies or frees such an engine's gradients: install says how many
    params would get one and its full size, and says nothing for a frozen model."""
    _, frozen = policy_and_reward()
    frozen_engine = engine_without_optimizer(frozen, stage=reward_stage)
    _, loaded_as_is = policy_and_reward()
    loaded_as_is[0].requires_grad_(True)  # one Linear of FEATURES x HIDDEN, and its bias
    loaded_engine = engine_without_optimizer(loaded_as_is, stage=reward_stage)
    full_bytes = (FEATURES * HIDDEN + HIDDEN) * 4
    with pytest.warns(RuntimeWarning, match="require grad") as record:
        zero_lifetime.install(loaded_engine)
        zero_lifetime.install(frozen_engine)
    ours = [warning for warning in record if "zero_lifetime" in str(warning.message)]
    assert len(ours) == 1, [str(warning.message) for warning in ours]
    said = str(ours[0].message)
    assert "2 params of this engine" in said and f"({full_bytes} bytes" in said
    assert ("unpartitioned under ZeRO-3" in said) == (reward_stage == 3)
    assert ours[0].filename == __file__  # points at the install() call


# ---- 2 gloo ranks: the reward partitioned over both ----------------------------------------

@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    return spawn_ranks(worker.main, str(tmp_path_factory.mktemp("frozen_engine")), worker.WORLD, SPAWN_DEADLINE_S)


def test_two_rank_runs_finished(two_rank_results):
    two_rank_results.assert_finished(sc["id"] for sc in worker.SCENARIOS)


INSTALLED = [sc for sc in worker.SCENARIOS if sc["install"]]


@pytest.mark.parametrize("sc", INSTALLED, ids=[sc["id"] for sc in INSTALLED])
def test_two_ranks_trained_through_a_frozen_engine_match_torch(two_rank_results, sc):
    for rank, record in enumerate(two_rank_results.records(sc["id"])):
        assert max(record["abs_diff"].values()) <= worker.ATOL, f"rank {rank}: {record['abs_diff']}"
        assert record["moved"] > 1e-3, record["moved"]
        assert record["reward_unchanged"] and record["reward_released"], record
        assert record["reward_partitioned"], "each rank holds only part of the reward: nothing was gathered"
        stats = record["reward_stats"]  # its all-gathers copied out by the fused op
        assert stats["fused_gathers"] > 0 and stats["stock_gathers"] == 0, stats


def test_two_ranks_stock_fails_the_second_backward(two_rank_results):
    for rank, record in enumerate(two_rank_results.records("stock-module")):
        assert record["failed_with"] is not None and "normalized_shape" in record["failed_with"], record
