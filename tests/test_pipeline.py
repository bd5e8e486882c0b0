"""DeepSpeed's pipeline engine (``deepspeed.pipe``) with ZeRO-1, installed, against plain torch
over 2 gloo ranks (tests/pipeline_worker.py): split over two pipeline stages, and one stage
data-parallel. DeepSpeed allows only ZeRO-1 with pipeline parallelism; its schedule runs each
backward through ``torch.autograd.backward``, not ``engine.backward``, and the gradients must
still reach the buckets. A tied layer's copies on two stages get their gradients all-reduced
between the stages by the pipeline (from ``param.grad``, where the fill must leave them), and
activation checkpointing runs each layer's forward again inside backward.

On DeepSpeed 0.19.8 stock pipeline training matches torch, and installed runs are held to
torch. The older releases' own pipeline engines do not on these CPU ranks (0.18.9: two stages
miss torch on the first stage's params; 0.17.6: two stages fail in gloo's send, one stage misses
torch): there installed runs are held to stock's, where stock runs.
"""

import pytest

import pipeline_worker as worker
from rank_spawn import assert_same_weights, spawn_ranks

ATOL = 1e-5
STOCK_MATCHES_TORCH = worker.base.deepspeed_release() not in ("0.17.6", "0.18.9")
# 0.17.6 reduces gradients only inside engine.backward: a pipeline's earlier stages backward
# outside it, so install refuses a pipeline of several stages there.
REFUSES_SEVERAL_STAGES = not worker.base._torch_style_backward()
SPAWN_DEADLINE_S = 300  # only reached when something hangs


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory):
    return spawn_ranks(worker.main, str(tmp_path_factory.mktemp("pipeline")), worker.WORLD, SPAWN_DEADLINE_S)


def test_pipeline_ranks_finished(pipeline_results):
    pipeline_results.assert_finished(sc["id"] for sc in worker.SCENARIOS)


INSTALLED = [sc for sc in worker.SCENARIOS if sc["install"]]


def _stock_twin(sc):
    return f"stock-{sc['model']}-stages{sc['stages']}"


def _misses_torch(record):
    return any(not diff <= ATOL for diff in record["abs_diff"].values())


@pytest.mark.parametrize("sc", INSTALLED, ids=[sc["id"] for sc in INSTALLED])
def test_pipeline_training_installed_matches_torch(pipeline_results, sc):
    """Installed = torch; on an older release whose stock run misses torch, installed = stock."""
    stock = pipeline_results.by_id.get(_stock_twin(sc), {})
    if sc["model"] == "tied-checkpointed" and worker.CHECKPOINTING_NEEDS_A_STREAM:
        pytest.skip("this release's activation checkpointing cannot run on the CPU accelerator, stock "
                    "included: test_checkpointing_fails_alike_on_older_releases")
    records = pipeline_results.records(sc["id"])
    if sc["stages"] > 1 and REFUSES_SEVERAL_STAGES:
        for record in records:
            assert "a pipeline of 2 stages" in (record["refused"] or ""), record
        return
    held = set()
    for rank, record in enumerate(records):
        assert record["engine"] == "PipelineEngine" and record["refused"] is None
        assert record["stats"]["filled_grads"] > 0  # the fused fill carried the gradients
        # activation checkpointing recomputed each layer in backward: two forwards per use
        assert record["forwards_per_linear_use"] == (2.0 if sc["model"] == "tied-checkpointed" else 1.0)
        held |= set(record["abs_diff"])
        if not _misses_torch(record):
            continue
        assert not STOCK_MATCHES_TORCH, f"rank {rank}: {record['abs_diff']}"
        assert stock.get(rank, {}).get("weights"), \
            f"rank {rank} misses torch, and stock did not run: {record['abs_diff']}"
        # what this release's own pipeline engine computes
        assert_same_weights(record["weights"], stock[rank]["weights"], rank, atol=ATOL, rtol=1e-4)
    assert held == set(worker.param_names(sc["model"]))  # every param, on one rank or both


@pytest.mark.skipif(not STOCK_MATCHES_TORCH, reason="this release's own pipeline engine misses torch here")
@pytest.mark.parametrize("stages", [2, 1])
@pytest.mark.parametrize("model", worker.MODELS)
def test_stock_pipeline_training_matches_torch(pipeline_results, model, stages):
    """The oracle against DeepSpeed itself."""
    for rank, record in enumerate(pipeline_results.records(f"stock-{model}-stages{stages}")):
        assert not _misses_torch(record), f"rank {rank}: {record['abs_diff']}"


@pytest.mark.skipif(not worker.CHECKPOINTING_NEEDS_A_STREAM, reason="this release's checkpointing runs on CPU")
def test_checkpointing_fails_alike_on_older_releases(pipeline_results):
    """DeepSpeed 0.17.6/0.18.9 checkpoint activations through an accelerator Stream, which the
    CPU accelerator does not have: the installed run fails where stock does, with stock's error.
    Should a release run it, this fails: hold the installed run to torch there."""
    for rank in range(worker.WORLD):
        stock_error = pipeline_results.by_id["stock-tied-checkpointed-stages1"][rank]["error"]
        installed_error = pipeline_results.by_id["installed-tied-checkpointed-stages1"][rank]["error"]
        assert stock_error and "Stream(device" in stock_error, stock_error
        assert installed_error.strip().splitlines()[-1] == stock_error.strip().splitlines()[-1], installed_error
