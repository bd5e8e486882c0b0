"""A pinned param's release runs on the thread that trains, never on the thread that happened
to drop the graph's last reference.

On 2 ranks gloo's worker thread can hold that last reference: destroying a finished
all-gather's work, it frees a Python tensor that kept a dropped graph alive, and the graph's
saved-param handles die there (docs/reliability.md, "Random programs on 2 ranks"). DeepSpeed's
param state is not thread-safe: a release there would change a param between any two bytecodes
of the training thread (inside a ``GatheredParameters`` context, say). Here a Python thread
drops the graph, deterministically, on real ZeRO-3 engines (1 rank, policy "pin").
"""

import threading

import deepspeed
import pytest

import zero_lifetime
from harness import assert_weights_match, losses, make_input, make_pair, released_state
from zero_lifetime.adapters.zero3_params import PIN_MARK, Zero3Params


def _drop_on_another_thread(box: list) -> None:
    """Drop the only reference to what ``box`` holds on a new thread, and wait for it."""
    dropper = threading.Thread(target=box.clear)
    dropper.start()
    dropper.join()


def _pinned_forward(engine, seed=0):
    out = engine(make_input("mlp_norm", seed))
    gathered, _ = released_state(engine)
    assert gathered, "the forward pinned nothing: the test would prove nothing"
    return out, gathered


def _installed_with_a_pinning_graph():
    """(engine, box holding the only reference to a graph that pins params, pinned names, params)."""
    engine, _, _ = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy="pin")
    out, pinned = _pinned_forward(engine)
    return engine, [out], pinned, dict(engine.module.named_parameters())


def _spy_releases(installation, monkeypatch) -> list:
    """(thread, param) of every release the lifetime asks of DeepSpeed."""
    zparams = installation.lifetime.zparams
    releases = []
    original = zparams.release

    def release(param):
        releases.append((threading.get_ident(), param))
        return original(param)

    monkeypatch.setattr(zparams, "release", release)
    return releases


@pytest.mark.parametrize("drained_by", ["stats", "forward", "step"])
def test_a_graph_dropped_on_another_thread_is_released_on_the_training_thread(drained_by, monkeypatch):
    engine, _, _ = make_pair("mlp_norm", 3)
    releases = _spy_releases(zero_lifetime.install(engine, policy="pin"), monkeypatch)
    out, pinned = _pinned_forward(engine)
    first, second = losses(out)
    engine.backward(first, retain_graph=True)  # step() needs a backward; the graph stays alive
    box = [out, first, second]
    del out, first, second
    _drop_on_another_thread(box)
    params = dict(engine.module.named_parameters())
    # Untouched until this thread's next call into the library: still gathered, still marked.
    assert released_state(engine)[0] == pinned
    assert all(PIN_MARK in params[name].ds_active_sub_modules for name in pinned)
    if drained_by == "stats":
        stats = zero_lifetime.stats(engine)
        assert stats["live_handles"] == 0 and stats["pinned_bytes"] == 0, stats
    elif drained_by == "forward":
        engine(make_input("mlp_norm", 1))  # its own graph is dropped at once
    else:
        engine.step()
    names = {id(p): name for name, p in params.items()}
    assert {threading.get_ident()} == {thread for thread, _ in releases}
    assert set(pinned) <= {names[id(param)] for _, param in releases}
    assert not any(PIN_MARK in p.ds_active_sub_modules for p in params.values())
    if drained_by != "forward":  # 0.18.9 and 0.17.6 keep a forward's params after it, stock too
        assert released_state(engine) == ([], [])


def test_a_gathered_parameters_context_keeps_what_it_saw_while_another_thread_drops_the_graph():
    """The context found the pinned params gathered, so it did not gather them; a release from
    the dropping thread would have emptied them under the reader. Still marked pinned at its exit,
    they stay gathered there and go at this thread's next call into the library."""
    engine, box, pinned, params = _installed_with_a_pinning_graph()
    with deepspeed.zero.GatheredParameters(list(params.values())):
        _drop_on_another_thread(box)
        assert all(params[name].numel() > 0 for name in pinned)
    assert released_state(engine)[0] == pinned
    stats = zero_lifetime.stats(engine)
    assert released_state(engine) == ([], [])
    assert stats["live_handles"] == 0 and stats["pinned_bytes"] == 0, stats


def _drop_on_this_thread(box: list) -> None:
    box.clear()


@pytest.mark.skipif(not Zero3Params.sees_user_contexts(),
                    reason="this DeepSpeed records no GatheredParameters context on its params (0.18.9, 0.17.6)")
@pytest.mark.parametrize("drop", [_drop_on_another_thread, _drop_on_this_thread], ids=["other_thread", "this_thread"])
def test_a_release_due_inside_a_gathered_parameters_context_is_left_to_its_exit(drop):
    """The graph dies inside the context, and the training thread calls into the library there
    (``stats`` for logging): the params the context reads keep their values until its exit, which
    partitions them, as it does every param it holds."""
    engine, box, _, params = _installed_with_a_pinning_graph()
    with deepspeed.zero.GatheredParameters(list(params.values())):
        seen = {name: p.detach().clone() for name, p in params.items()}
        drop(box)
        stats = zero_lifetime.stats(engine)
        assert stats["live_handles"] == 0 and stats["pinned_bytes"] == 0, stats
        for name, param in params.items():
            assert param.shape == seen[name].shape and param.equal(seen[name]), name
    assert released_state(engine) == ([], [])
    assert not any(PIN_MARK in p.ds_active_sub_modules for p in params.values())
    assert zero_lifetime.stats(engine)["gathered_params"] == 0


def test_training_goes_on_like_torch_when_each_graph_is_dropped_on_another_thread():
    """Two-loss steps whose retained graph is dropped on a thread after both backwards: the
    weights follow torch's and nothing stays gathered."""
    engine, reference, ref_opt = make_pair("mlp_norm", 3)
    zero_lifetime.install(engine, policy="pin")
    for step in range(3):
        x = make_input("mlp_norm", step)
        out = engine(x)
        first, second = losses(out)
        engine.backward(first, retain_graph=True)
        engine.backward(second, retain_graph=True)
        box = [out, first, second]
        del out, first, second
        _drop_on_another_thread(box)
        engine.step()
        ref_first, ref_second = losses(reference(x))
        ref_first.backward(retain_graph=True)
        ref_second.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert released_state(engine) == ([], [])
    assert_weights_match(engine, reference)
    assert zero_lifetime.stats(engine)["pinned_params"] == 0
