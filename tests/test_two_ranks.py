"""Two ranks on the CPU over gloo: real DeepSpeed engines against torch DDP.

One spawn of 2 rank processes runs every scenario in two_rank_worker.SCENARIOS
(DeepSpeed's import is paid once per rank). Each scenario trains a fresh engine and
fresh DDP and all-reduce oracles from one seed, on a different data shard per rank,
for 3 optimizer steps (fp32, SGD, no gradient clipping); each rank writes what it
measured and the tests below assert on it, one named test per scenario.
"""

import pytest
import torch

import two_rank_worker as worker
from rank_spawn import assert_same_weights, spawn_ranks

SPAWN_DEADLINE_S = 600  # only reached when something hangs: a passing run takes 100-130 s unloaded, more on busy shared cores
ATOL = worker.ATOL
# How stock ZeRO-3's second backward meets a released (empty) param: accumulating its
# gradient, (0.17.6, model built in zero.Init) DeepSpeed's own linear reading the weight, or
# (engine.compile()) the compiled backward's matmul with it.
RELEASED_PARAM_USED = ("size of tensor a (0)", "vec (0)", "mat2 must be a matrix")

TRAINING = [sc for sc in worker.SCENARIOS if sc["kind"] in ("steps", "penalty")]
SANITY = [sc for sc in TRAINING if sc["id"].startswith("sanity-")]
RETAINED = [sc for sc in TRAINING if not sc["id"].startswith("sanity-")]
STAGE3 = [sc for sc in TRAINING if sc["stage"] == 3 and sc["install"]]
# ZeRO-3 with param offload or ZeRO++'s hpZ (their zero_optimization settings).
ZERO3_VARIANTS = [sc for sc in STAGE3 if sc["zero"] and not sc["compile"]]
COMPILED = [sc for sc in TRAINING if sc["compile"]]
STOCK = [sc for sc in worker.SCENARIOS if sc["kind"] == "stock"]
STOCK12 = [sc for sc in worker.SCENARIOS if sc["kind"] == "stock12"]
SEPARATE_ACCUMULATION = [sc for sc in worker.SCENARIOS if sc["kind"] == "zero1_separate_accumulation"]
MULTITASK = [sc for sc in worker.SCENARIOS if sc["kind"] == "multitask"]
FP16 = [sc for sc in worker.SCENARIOS if sc["kind"] == "fp16"]
BUCKET_ORDER = [sc for sc in worker.SCENARIOS if sc["kind"] == "bucket_order"]
STALE = [sc for sc in worker.SCENARIOS if sc["kind"] == "stale"]
AUTOGRAD_GRAD = [sc for sc in worker.SCENARIOS if sc["kind"] == "autograd_grad"]
DEAD = [sc for sc in worker.SCENARIOS if sc["kind"] == "dead"]
DEAD_WINDOW = [sc for sc in worker.SCENARIOS if sc["kind"] == "dead_window"]
COALESCE = [sc for sc in worker.SCENARIOS if sc["kind"] == "coalesce"]
MUON = [sc for sc in worker.SCENARIOS if sc["kind"] == "muon"]
FREEZE = [sc for sc in worker.SCENARIOS if sc["kind"] == "freeze"]
SHARED_CKPT = [sc for sc in worker.SCENARIOS if sc["kind"] == "shared_ckpt"]
FROZEN_MAX_NORM = [sc for sc in worker.SCENARIOS if sc["kind"] == "frozen_max_norm"]
UNMANAGED = [sc for sc in worker.SCENARIOS if sc["kind"] == "unmanaged" and sc["install"]]
UNMANAGED_STOCK = [sc for sc in worker.SCENARIOS if sc["kind"] == "unmanaged" and not sc["install"]]
ORDER_CHECKED = [sc for sc in BUCKET_ORDER if sc["check"] and "gas" not in sc]
ORDER_GAS = [sc for sc in BUCKET_ORDER if "gas" in sc]
ORDER_UNCHECKED = [sc for sc in BUCKET_ORDER if not sc["check"]]
TRACE_CHANGES = [sc for sc in TRAINING if sc["id"].startswith("trace-changes-")]
# DeepSpeed's other bucket reductions (all-reduce with pre-division or prescaling) and
# ZeRO-1/2's round-robin partitioning; their weights against DDP: test_retained_backwards_match_ddp.
REDUCTIONS12 = [sc for sc in RETAINED if sc["id"].startswith(("reduction-", "round_robin-")) and sc["stage"] != 3]
COMM_DTYPES = sorted({(sc["stage"], sc["config"]["communication_data_type"])
                      for sc in worker.SCENARIOS if sc["kind"] == "comm_dtype"})
CHECKPOINTED12 = [sc for sc in RETAINED if sc["model"].startswith("ckpt_") and sc["stage"] in (1, 2)]


def _ids(scenarios):
    return [sc["id"] for sc in scenarios]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_ranks(worker.main, str(tmp_path_factory.mktemp("two_ranks")), worker.WORLD, SPAWN_DEADLINE_S)


def test_ranks_finished(results):
    results.assert_finished(_ids(worker.SCENARIOS))


def _assert_matches_ddp(results, sc):
    for rank, record in enumerate(results.records(sc["id"])):
        # The two oracles (DDP, and local backwards + all_reduce) must agree first.
        oracle_bad = {n: e for n, e in record["oracle_tol_excess"].items() if not e <= ATOL}
        assert not oracle_bad, f"rank {rank}: DDP and all-reduce oracles disagree: {record['oracle_abs_diff']}"
        assert 1e-3 < record["moved"] < 10, f"rank {rank}: oracle weights moved by {record['moved']}"
        bad = {n: record["abs_diff"][n] for n, e in record["tol_excess"].items() if not e <= ATOL}
        assert not bad, f"rank {rank}: engine weights differ from DDP (max abs diff per param): {bad}"


@pytest.mark.parametrize("sc", SANITY, ids=_ids(SANITY))
def test_sanity_plain_backward_matches_ddp(results, sc):
    """One plain backward per step: DeepSpeed's and DDP's rank averaging agree."""
    _assert_matches_ddp(results, sc)


@pytest.mark.parametrize("sc", RETAINED, ids=_ids(RETAINED))
def test_retained_backwards_match_ddp(results, sc):
    _assert_matches_ddp(results, sc)


@pytest.mark.parametrize("sc", REDUCTIONS12, ids=_ids(REDUCTIONS12))
def test_other_reductions_take_the_fused_bucket_fill(results, sc):
    """Every backward filled DeepSpeed's buckets through the fused fill. Before an all-reduce
    DeepSpeed divides (or not) by its own factors, so the fill must leave the values as they are."""
    for rank, record in enumerate(results.records(sc["id"])):
        stats = record["stats"]
        assert stats["bucket_fills"] > 0 and stats["filled_grads"] > 0, f"rank {rank}: {stats}"
        if sc["zero"].get("reduce_scatter") is False:
            assert stats["prescaled_fills"] == 0, f"rank {rank}: {stats}"


@pytest.mark.parametrize("stage, comm", COMM_DTYPES, ids=[f"stage{s}-{c}" for s, c in COMM_DTYPES])
def test_low_precision_communication(results, stage, comm):
    """An fp32 model whose gradients DeepSpeed communicates in bf16 or fp16: installed ends
    within the rounding of the communicated gradients of DDP's fp32 weights, with one backward
    per micro-step and with two (each backward's gradient rounded on its own, so not stock's
    one backward of the summed losses either). With one backward it also ends on stock's
    weights exactly (the fill's conversion rounds as torch's copy does; its division by the 2
    ranks is exact in any dtype)."""
    stock, installed, retained = (results.records(f"comm_{comm}-stage{stage}-{kind}")
                                  for kind in ("stock", "installed", "retained"))
    eps = torch.finfo({"bf16": torch.bfloat16, "fp16": torch.float16}[comm]).eps
    for rank in range(worker.WORLD):
        _assert_near_ddp(installed[rank], rank, eps)
        _assert_near_ddp(retained[rank], rank, eps)
        _assert_installed_is_stock(stage, stock[rank], installed[rank], rank)
        if stage != 3:
            for record in (installed[rank], retained[rank]):
                assert record["stats"]["bucket_fills"] > 0, f"rank {rank}: {record['stats']}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_torch_autocast(results, stage):
    """DeepSpeed's torch_autocast section (bf16): Linear gradients communicated in bf16, the
    LayerNorm's in fp32, in two buckets filled side by side (small ones too, filled and
    reduced mid-backward with overlap_comm). Installed ends within the rounding of the bf16
    communication of DDP under the same autocast, with one backward per micro-step and with
    two; with one it is stock's weights exactly. Stock ZeRO-3's second backward still fails
    (test_stock_stage3_fails_without_install). 0.17.6 has no small-bucket run: its stage 1/2
    fail there, stock too, keying a bucket by the param's dtype in places (README)."""
    stock, installed, retained = (results.records(f"autocast-stage{stage}-{kind}")
                                  for kind in ("stock", "installed", "retained"))
    with_small = worker.deepspeed_release() != "0.17.6"
    small = results.records(f"autocast-stage{stage}-retained_small_buckets") if with_small else None
    eps = torch.finfo(torch.bfloat16).eps
    for rank in range(worker.WORLD):
        for record in (installed[rank], retained[rank]) + ((small[rank], ) if with_small else ()):
            assert record["comm_dtypes"] == ["torch.bfloat16", "torch.float32"], f"rank {rank}: {record['comm_dtypes']}"
            _assert_near_ddp(record, rank, eps)
            assert record["stats"]["bucket_fills"] > 0, f"rank {rank}: {record['stats']}"
            if stage == 3:  # autocast saves lowered copies of most params: each still released
                assert record["stats"]["live_handles"] == 0, f"rank {rank}: {record['stats']}"
                assert record["gathered_non_persistent"] == [], f"rank {rank}: still gathered"
        _assert_installed_is_stock(stage, stock[rank], installed[rank], rank)
        if with_small:  # the buckets filled more often: reduced mid-backward
            assert small[rank]["stats"]["bucket_fills"] > retained[rank]["stats"]["bucket_fills"], f"rank {rank}"


def _assert_near_ddp(record, rank, eps):
    """Within the rounding of gradients communicated in a dtype of ``eps``, twice over."""
    assert 1e-3 < record["moved"] < 10, f"rank {rank}: oracle weights moved by {record['moved']}"
    bound = 2 * eps * record["moved"]
    bad = {n: d for n, d in record["abs_diff"].items() if not d <= bound}
    assert not bad, f"rank {rank}: further than {bound:.2e} from DDP's weights: {bad}"


def _assert_installed_is_stock(stage, stock, installed, rank):
    """One backward per micro-step: installed ends on stock's weights exactly, where stock is right."""
    if stage == 2 and worker.deepspeed_release() == "0.17.6":
        # Stock 0.17.6 ZeRO-2 keeps only the last micro-step's gradients at GAS > 1 (README,
        # DeepSpeed 0.17.6; fp32 communication too): about half its movement off DDP here.
        assert max(stock["abs_diff"].values()) > 0.1 * stock["moved"], f"rank {rank}: stock fixed?"
    else:
        assert_same_weights(installed["weights"], stock["weights"], rank, atol=0, rtol=0)


@pytest.mark.parametrize("sc", CHECKPOINTED12, ids=_ids(CHECKPOINTED12))
def test_bucket_order_check_once_per_backward_under_checkpointing(results, sc):
    """A reentrant checkpoint runs a backward inside the backward, with DeepSpeed's hooks
    firing in it (every trainable param inside one, for ckpt_adapters): the bucket order check
    still runs once per backward that reduces, after its epilogue, in step on both ranks (a raise would fail the scenario; the weights against DDP are
    test_retained_backwards_match_ddp's)."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert record["stats"]["bucket_order_checks"] == _backwards_that_reduce(sc), f"rank {rank}: {record['stats']}"


def _backwards_that_reduce(sc):
    """Every backward of the schedule; on ZeRO-1 with GAS > 1 only those of each window's closing
    micro-step (it runs its epilogue at the boundary only)."""
    if sc["stage"] == 1 and sc["gas"] > 1:
        return sum(n for step, n in enumerate(sc["schedule"]) if (step + 1) % sc["gas"] == 0)
    return sum(sc["schedule"])


@pytest.mark.parametrize("sc", TRACE_CHANGES, ids=_ids(TRACE_CHANGES))
def test_release_decisions_follow_a_rerecorded_trace_on_both_ranks(results, sc):
    """The first step's trace (one backward), then the one recorded at step 2 (two): each
    trace's cached release decisions were dropped as it completed, on both ranks (the weights
    against DDP are test_retained_backwards_match_ddp's)."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert record["stats"]["traces_recorded"] == 2, f"rank {rank}: {record['stats']}"


@pytest.mark.parametrize("sc", STAGE3, ids=_ids(STAGE3))
def test_stage3_releases_everything(results, sc):
    for rank, record in enumerate(results.records(sc["id"])):
        stats = record["stats"]
        assert stats["pinned_params"] == 0, f"rank {rank}: {stats}"
        assert stats["live_handles"] == 0, f"rank {rank}: {stats}"
        assert record["gathered_non_persistent"] == [], f"rank {rank}: still gathered or pinned"
        assert record["non_empty_released"] == [], f"rank {rank}: NOT_AVAILABLE with data.numel() != 0"
        if sc["policy"] == "pin" and record["n_non_persistent"] > 0:
            assert stats["peak_pinned_bytes"] > 0, f"rank {rank}: policy pin never pinned: {stats}"


@pytest.mark.parametrize("sc", ZERO3_VARIANTS, ids=_ids(ZERO3_VARIANTS))
def test_stage3_variants_take_the_fused_gather(results, sc):
    """Param offload and hpZ change where shards live and which group gathers them; the fused
    copy-out still covers every gather (its layout check would send others to the stock wait),
    and with hpZ the backward really had secondary shards to gather from. So with sub-groups,
    a live-param limit or all-reduce buckets; all-reduce fetches gather nothing."""
    for rank, record in enumerate(results.records(sc["id"])):
        stats = record["stats"]
        if sc["zero"].get("stage3_use_all_reduce_for_fetch_params"):
            # DeepSpeed fetches by all-reduce into each param itself: no gather to copy out
            # (unless an earlier hpZ engine left its secondary shards on: see the worker).
            assert record["secondary_tensors"] == 0, f"rank {rank}: hpZ secondary shards without hpZ"
            assert stats["fused_gathers"] == 0 and stats["stock_gathers"] == 0, f"rank {rank}: {stats}"
            continue
        assert stats["fused_gathers"] > 0 and stats["stock_gathers"] == 0, f"rank {rank}: {stats}"
        if "zero_hpz_partition_size" in sc["zero"]:
            assert record["secondary_tensors"] > 0, f"rank {rank}: no param had an hpZ secondary shard"


@pytest.mark.parametrize("sc", COMPILED, ids=_ids(COMPILED))
def test_compiled_scenarios_ran_compiled_code(results, sc):
    """engine.compile() scenarios (weights against DDP: test_retained_backwards_match_ddp):
    every step's graph held AOTAutograd's compiled function, whose saved tensors the
    lifetime hooks saw; ZeRO-3 gathers still took the fused copy-out."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert record["compiled_graphs"] > 0, f"rank {rank}: the backend compiled nothing: {record}"
        assert record["compiled_steps"] == len(sc["schedule"]), f"rank {rank}: {record}"
        if sc["stage"] == 3:
            stats = record["stats"]
            assert stats["fused_gathers"] > 0 and stats["stock_gathers"] == 0, f"rank {rank}: {stats}"


@pytest.mark.parametrize("sc", STALE, ids=_ids(STALE))
def test_stale_graph_refused_on_every_rank_then_training_goes_on(results, sc):
    """A backward through a graph saved before step(): torch refuses it (a param modified in
    place), and so does every rank; the ranks stay in step and train on like the oracle."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert "modified by an inplace operation" in record["raised"].get("oracle", ""), record["raised"]
        assert "modified by an inplace operation" in record["raised"].get("engine", ""), record["raised"]
        bad = {n: e for n, e in record["tol_excess"].items() if not e <= ATOL}
        assert not bad, f"rank {rank}: weights differ from the all-reduced oracle: {record['abs_diff']}"
        if sc["stage"] == 3:
            assert record["stats"]["live_handles"] == 0, record["stats"]


def _assert_matches_the_all_reduced_oracle(results, sc):
    """On every rank the weights equal the all-reduced oracle's, and on ZeRO-3 nothing is
    left held or pinned."""
    for rank, record in enumerate(results.records(sc["id"])):
        bad = {n: e for n, e in record["tol_excess"].items() if not e <= ATOL}
        assert not bad, f"rank {rank}: weights differ from the all-reduced oracle: {record['abs_diff']}"
        if sc["stage"] == 3:
            assert record["stats"]["live_handles"] == 0 and record["stats"]["pinned_params"] == 0, record["stats"]


@pytest.mark.parametrize("sc", FREEZE, ids=_ids(FREEZE))
def test_a_layer_frozen_between_two_backwards_keeps_its_first_gradient_on_both_ranks(results, sc):
    _assert_matches_the_all_reduced_oracle(results, sc)


@pytest.mark.parametrize("sc", FROZEN_MAX_NORM, ids=_ids(FROZEN_MAX_NORM))
def test_a_frozen_embedding_with_max_norm_trains_like_torch_on_both_ranks(results, sc):
    """The trained params are torch's: every lookup renormalizes the same rows alike. The
    frozen weight keeps the renormalization as torch does on ZeRO-1/2 (out of their buffers);
    on ZeRO-3 its rows are back above max_norm (renormalized in the gathered copy the release
    drops; not warned about: nothing that trains sees it)."""
    for rank, record in enumerate(results.records(sc["id"])):
        bad = {n: e for n, e in record["tol_excess"].items() if not e <= ATOL and n != "0.weight"}
        assert not bad, f"rank {rank}: trained weights differ from the all-reduced oracle: {record['abs_diff']}"
        assert record["oracle_row_norm"] <= 1.0 + 1e-6, record
        if sc["stage"] == 3:
            assert record["row_norm"] > 1.5, record
            assert record["stats"]["live_handles"] == 0 and record["stats"]["pinned_params"] == 0, record["stats"]
        else:
            assert record["tol_excess"]["0.weight"] <= ATOL, record


@pytest.mark.parametrize("sc", SHARED_CKPT, ids=_ids(SHARED_CKPT))
def test_a_block_applied_twice_under_reentrant_checkpointing_is_refused_on_every_rank(results, sc):
    """Every rank refuses the same backward (none is left waiting in a collective), and the
    non-reentrant steps after it match the all-reduced oracle."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert record["refused"] and "use_reentrant=False" in record["refused"], f"rank {rank}: {record['refused']}"
    _assert_matches_the_all_reduced_oracle(results, sc)


@pytest.mark.parametrize("sc", COALESCE, ids=_ids(COALESCE))
def test_coalesced_reduction_matches_the_all_reduced_oracle(results, sc):
    """engine.coalesce_grad_reduction() around two retained backwards, or a micro-batch per
    backward: one reduction at the block's exit, the same weights as the oracle on both ranks."""
    _assert_matches_the_all_reduced_oracle(results, sc)


@pytest.mark.parametrize("sc", MUON, ids=_ids(MUON))
def test_muon_two_backwards_match_stock_summed_loss(results, sc):
    """DeepSpeed's Muon optimizer, two retained backwards per micro-step: on both ranks the
    weights equal stock DeepSpeed's after one backward of the summed losses."""
    _assert_matches_the_all_reduced_oracle(results, sc)


@pytest.mark.parametrize("sc", UNMANAGED, ids=_ids(UNMANAGED))
def test_unmanaged_gradient_accumulation_matches_the_all_reduced_oracle(results, sc):
    """managed_gradient_accumulation=False: step() after one to three micro-batches, some of
    them two retained backwards; every gradient reaches the step on both ranks."""
    _assert_matches_the_all_reduced_oracle(results, sc)


@pytest.mark.parametrize("sc", UNMANAGED_STOCK, ids=_ids(UNMANAGED_STOCK))
def test_stock_unmanaged_gradient_accumulation(results, sc):
    """Negative control, with loss.backward(): stock ZeRO-2 fails without optimizer offload (a
    TypeError in its epilogue) and with it trains off the oracle (measured 0.16); stock ZeRO-3
    fails the retained second backward."""
    for rank, record in enumerate(results.records(sc["id"])):
        if sc["stage"] == 3:
            assert record["raised"] is not None and any(m in record["raised"] for m in RELEASED_PARAM_USED), record
        elif not sc["offload"]:
            assert record["raised"] is not None and record["raised"].startswith("TypeError"), record
        else:
            assert record["raised"] is None, record["raised"]
            assert max(record["abs_diff"].values()) > 1e-2, f"rank {rank}: stock matched: {record['abs_diff']}"


@pytest.mark.parametrize("sc", AUTOGRAD_GRAD, ids=_ids(AUTOGRAD_GRAD))
def test_autograd_grad_through_a_trained_graph_on_every_rank(results, sc):
    """torch.autograd.grad and a training backward through one graph: for the input after a
    retained backward, or for a shared weight before the training backward (stock ZeRO-3 fails
    both: the params are released). Each rank's autograd.grad result is the oracle's, the
    steps match the all-reduced oracle, and under "regather" what the ranks gathered again
    for an input gradient is released as that backward ends."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert max(record["grad_diff"]) <= ATOL, f"rank {rank}: {record['grad_diff']}"
        if sc["policy"] == "regather" and sc["wrt"] == "input":
            assert record["gathered_after"] == [[]] * worker.STEPS, record["gathered_after"]
        bad = {n: e for n, e in record["tol_excess"].items() if not e <= ATOL}
        assert not bad, f"rank {rank}: weights differ from the all-reduced oracle: {record['abs_diff']}"
        if sc["stage"] == 3:
            assert record["gathered_at_end"] == [] and record["stats"]["live_handles"] == 0, record


@pytest.mark.parametrize("sc", DEAD, ids=_ids(DEAD))
def test_backward_dying_on_every_rank_then_training_goes_on(results, sc):
    """A backward that dies at the same point on every rank (after a retained one), then
    another backward, a new forward or zero_grad(), and step(): each rank cleans up alike and
    the weights follow the all-reduced oracle over the backwards that completed. Only ZeRO-3
    with a bucket reduced inside the dying backward keeps that bucket (torch keeps what a dead
    backward reached); zero_grad() drops it. Nothing stays gathered or pinned."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert record["raised"] == "loss backward failed", f"rank {rank}: {record['raised']}"
        assert record["stats"]["failed_backwards"] == 1, record["stats"]
        assert not record["step0_bad"], f"rank {rank}: step 0 differs from the oracle: {record['step0_bad']}"
        keeps_reduced = sc["stage"] == 3 and sc["bucket"] == "one_weight" and sc["then"] != "zero_grad"
        assert bool(record["kept_dead"]) == keeps_reduced, f"rank {rank}: {record['kept_dead']}"
        bad = {n: e for n, e in record["tol_excess"].items() if not e <= ATOL}
        assert not bad, f"rank {rank}: weights differ from the all-reduced oracle: {record['abs_diff']}"
        if sc["stage"] == 3:
            assert record["gathered_after_step0"] == [] and record["gathered_at_end"] == [], record
            assert record["stats"]["live_handles"] == 0 and record["stats"]["pinned_params"] == 0, record["stats"]


@pytest.mark.parametrize("sc", DEAD_WINDOW, ids=_ids(DEAD_WINDOW))
def test_backward_dying_inside_an_accumulation_window_on_every_rank(results, sc):
    """GAS 2: a backward dies on every rank after the window's first micro-step. ZeRO-1 keeps
    that micro-step (each rank's unreduced sum in param.grad; the cleanup used to drop it) and
    what the dead backward reached, as torch; dying as the closing micro-step opens, after
    DeepSpeed's hooks moved part of the sums into its buckets, every rank refuses the next
    backward and step() until zero_grad(). Then the weights follow the all-reduced oracle."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert record["raised"] == "loss backward failed", f"rank {rank}: {record['raised']}"
        assert record["stats"]["failed_backwards"] == 1 + len(record.get("refused", [])[:1]), record["stats"]
        if sc["stage"] == 1 and sc["dies"] == "opening_closing":
            assert all(r and "closes the gradient accumulation window" in r for r in record["refused"]), record
        bad = {n: e for n, e in record["tol_excess"].items() if not e <= ATOL}
        assert not bad, f"rank {rank}: weights differ from the all-reduced oracle: {record['abs_diff']}"


@pytest.mark.parametrize("sc", MULTITASK, ids=_ids(MULTITASK))
def test_multitask_matches_allreduced_torch(results, sc):
    """No gradient lost across micro-steps with 2 ranks: weights equal plain torch whose
    gradients are averaged over the ranks (each rank trains on its own data)."""
    for rank, record in enumerate(results.records(sc["id"])):
        bad = {n: d for n, d in record["abs_diff"].items() if not d <= record["tolerance"]}
        assert not bad, f"rank {rank}: engine weights differ from torch (max abs diff per param): {bad}"
        if sc["stage"] in (1, 2):  # the fused fill ran, a few grads per fill, dividing by the world size
            assert record["fused_grads"] > record["fills"] > 0, record
            # DeepSpeed 0.17.6 and 0.18.9 always divide the bucket themselves: the fill never prescales there.
            assert (record["prescaled_fills"] > 0) == (worker.deepspeed_release() == "0.19.8"), record


@pytest.mark.parametrize("sc", FP16, ids=_ids(FP16))
def test_fp16_overflow_on_one_rank_skips_on_both(results, sc):
    """Rank 0's losses overflow in some steps, rank 1's never: both ranks skip exactly the
    steps all-reduced torch skips, halve the scale alike, and match its fp32 master weights."""
    for rank, record in enumerate(results.records(sc["id"])):
        want = record["want_scale_and_skips"]
        assert want[1] == (2 if sc["zero_grad"] else 3), f"rank {rank}: the oracle skipped {want[1]} steps"
        assert record["scale_and_skips"] == want, f"rank {rank}: (loss scale, skipped steps) {record}"
        bad = {n: d for n, d in record["abs_diff"].items() if not d <= 1e-4}
        assert not bad, f"rank {rank}: fp32 master weights differ from torch: {bad}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_multitask_bf16_offload_equals_no_offload(results, stage):
    with_offload = results.records(f"multitask-stage{stage}-offload-per_task-bf16")
    without = results.records(f"multitask-stage{stage}-no_offload-per_task-bf16")
    for rank in range(worker.WORLD):
        assert_same_weights(with_offload[rank]["weights"], without[rank]["weights"], rank, atol=1e-6, rtol=0)


@pytest.mark.parametrize("sc", ORDER_CHECKED, ids=_ids(ORDER_CHECKED))
def test_bucket_order_mismatch_raises_on_every_rank_and_drops_the_mixed_step(results, sc):
    """Rank 1 runs the heads in another order in the first step: both ranks raise, naming
    the params, and the next steps train as DDP over those steps alone."""
    for rank, record in enumerate(results.records(sc["id"])):
        first, *rest = record["raised"]
        assert first is not None and "heads.2" in first and "heads.0" in first, f"rank {rank}: {first}"
        assert rest == [None, None], f"rank {rank}: {rest}"
        assert record["order_checks"] == len(record["raised"]), f"rank {rank}: {record['order_checks']}"
        bad = {n: d for n, d in record["abs_diff"].items() if not d <= 1e-5}
        assert not bad, f"rank {rank}: engine weights differ from DDP: {bad}"


@pytest.mark.parametrize("sc", ORDER_GAS, ids=_ids(ORDER_GAS))
def test_bucket_order_mismatch_inside_an_accumulation_window(results, sc):
    """GAS 2, rank 1's heads in another order in the window's first micro-step only. ZeRO-2
    reduces there: both ranks raise, the window so far is dropped, and the micro-steps after
    it form the next windows (DeepSpeed's count skips the failed one), as DDP over those.
    ZeRO-1 reduces at the boundary only, where the order agrees: no raise, DDP's result."""
    for rank, record in enumerate(results.records(sc["id"])):
        first, *rest = record["raised"]
        if sc["stage"] == 2:
            assert first is not None and "heads.2" in first and "heads.0" in first, f"rank {rank}: {first}"
        else:
            assert first is None, f"rank {rank}: {first}"
        assert rest == [None] * 4, f"rank {rank}: {rest}"
        # ZeRO-2 checks after every backward's epilogue; ZeRO-1 runs its epilogue at the
        # boundaries only (micro-steps 1 and 3 of the five).
        want_checks = len(record["raised"]) if sc["stage"] == 2 else 2
        assert record["order_checks"] == want_checks, f"rank {rank}: {record['order_checks']}"
        bad = {n: d for n, d in record["abs_diff"].items() if not d <= 1e-5}
        assert not bad, f"rank {rank}: engine weights differ from DDP: {bad}"


@pytest.mark.parametrize("sc", ORDER_UNCHECKED, ids=_ids(ORDER_UNCHECKED))
def test_bucket_order_mismatch_unchecked_trains_silently_wrong(results, sc):
    """The controls: stock DeepSpeed, and the check turned off, take every step without an
    error, and the heads end up off DDP (what the check exists for)."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert record["raised"] == [None, None, None], f"rank {rank}: {record['raised']}"
        assert max(record["abs_diff"].values()) > 1e-3, f"rank {rank}: {record['abs_diff']}"


@pytest.mark.parametrize("sc", STOCK12, ids=_ids(STOCK12))
def test_stock_zero12_step_on_two_gloo_ranks(results, sc):
    """Negative control for the flat-buffer repair: stock DeepSpeed 0.18.9 builds its ZeRO-1/2
    flat param buffers in grad mode, and step()'s all-gather into them fails on gloo (the
    installed ZeRO-1/2 scenarios above step on every release). Other releases step."""
    for rank, record in enumerate(results.records(sc["id"])):
        if worker.deepspeed_release() == "0.18.9":
            assert record["raised"] is not None and "Output 0 of Split is a view" in record["raised"], record
        else:
            assert record["raised"] is None, f"rank {rank}: {record['raised']}"


@pytest.mark.parametrize("sc", SEPARATE_ACCUMULATION, ids=_ids(SEPARATE_ACCUMULATION))
def test_zero1_accumulating_in_another_dtype_is_refused_where_deepspeed_reduces_it_wrong(results, sc):
    """ZeRO-1 with an fp64 model (gradients accumulated in fp32, in param.grad_accum) on 2 ranks:
    0.17.6 and 0.18.9 reduce it wrong (stock 0.17.6 1.2 off DDP, 0.18.9 fails in step()), so
    install() refuses it there; on 0.19.8 it installs (the fp64-stage1 scenarios train it)."""
    for rank, record in enumerate(results.records(sc["id"])):
        if worker.deepspeed_release() == "0.19.8":
            assert record["raised"] is None, f"rank {rank}: {record['raised']}"
        else:
            assert record["raised"] is not None and "ZeRO stage 1 with torch.float64 params" in record["raised"], record


@pytest.mark.parametrize("sc", STOCK, ids=_ids(STOCK))
def test_stock_stage3_fails_without_install(results, sc):
    """The bug is real with 2 ranks: stock ZeRO-3's second backward over a retained graph
    crashes (its first one runs; the worker records an error there as a scenario error)."""
    for rank, record in enumerate(results.records(sc["id"])):
        assert record["raised"] is not None, f"rank {rank}: stock ZeRO-3 ran the second backward"
        assert any(m in record["raised"] for m in RELEASED_PARAM_USED), f"rank {rank}: {record['raised']}"
