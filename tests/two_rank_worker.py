"""Rank process for tests/test_two_ranks.py: every 2-rank scenario in one spawn.

Each rank runs every scenario in SCENARIOS in order. A scenario is a fresh DeepSpeed
engine, with zero_lifetime installed or not, plus two fresh oracles built from the
same seed and fed the same per-rank data shards:

* ``ddp``: torch DistributedDataParallel over the same gloo group. DDP reduces only
  the first backward after a forward (its reducer stops expecting hooks once that
  backward finishes), so a second backward over a retained graph is never reduced.
  The DDP oracle therefore runs ONE backward of the loss whose gradient torch's
  two-backward semantics define: l1 + l2 with no zero_grad between them, and l2
  with one.
* ``allreduce``: a plain model that runs the two backwards itself, then averages
  its .grad over the ranks with all_reduce. It checks the DDP oracle.

One JSON line per scenario and rank goes to ``<out>/rank<r>.jsonl``; the parent
asserts on them. This module imports nothing heavy at the top: the parent imports
it for SCENARIOS, and each rank imports DeepSpeed only after setting its env.
"""

import datetime
import gc
import json
import os
import sys
import time
import traceback

WORLD = 2
ATOL, RTOL = 1e-5, 1e-4
STEPS = 3
# SGD step sizes that keep 3 steps of the unbounded linear loss (harness.losses) tame,
# so the comparison is not amplified by a diverging run (lr 0.1 blows both models up).
LR = {"mlp_norm": 0.01, "tied_lm": 0.001, "ckpt_reentrant": 0.01, "ckpt_nonreentrant": 0.01, "mlp_norm_fp64": 0.01, "llama_ckpt": 0.01, "ckpt_adapters": 0.05, "device_marked": 0.01, "selective_ckpt": 0.05}
# A rank whose peer raised mid-scenario may wait forever (seen: a DeepSpeed collective on
# the CPU, which can go through its shm comm op, ignored the gloo timeout); plain gloo
# collectives give up after COLLECTIVE_TIMEOUT_S.
# The per-scenario status exchange, on its own gloo group, outlasts the latter and
# raises in the rank that failed alone, so the spawn ends (the parent kills the rest).
COLLECTIVE_TIMEOUT_S = 30
CONTROL_TIMEOUT_S = 45


def _scenario(sid, kind, stage, path="engine", zero_grad=False, policy="regather", model="mlp_norm",
              persistence=0, schedule=None, install=True, offload=False, gas=1, zero_init=False, zero=None,
              compile=None, leaf=False, generation=False, config=None, weights="full_fp32", dropped_forward=False,
              forward="engine"):
    """``schedule``: backwards per micro-step; with ``gas`` > 1 every ``gas`` micro-steps make a step.
    ``zero_init``: the model is built inside ``deepspeed.zero.Init`` (partitioned as it is made).
    ``zero``: more zero_optimization settings (param offload, ZeRO++); ``config``: top-level ones.
    ``weights``: "full_fp32", the engine's weights compared are DeepSpeed's fp32 masters;
    "param_data", the params' own data (ZeRO-1/2); "recorded", the masters, also kept in the record.
    ``compile``: a torch.compile backend for ``engine.compile()``, run before ``install``.
    ``leaf``: the LayerNorm is a ZeRO-3 leaf module (``set_z3_leaf_modules``).
    ``generation``: each step begins with a forward in TRL's generation context (``_generate``).
    ``dropped_forward``: the first step begins with a forward whose graph is dropped unbackwarded.
    ``forward``: "module", the engine's forward bypassed (``engine.module(x)``)."""
    return dict(id=sid, kind=kind, stage=stage, path=path, zero_grad=zero_grad, policy=policy, model=model,
                persistence=persistence, schedule=schedule or [2] * STEPS, install=install, offload=offload,
                gas=gas, zero_init=zero_init, zero=zero or {}, compile=compile, leaf=leaf, generation=generation,
                config=config or {}, weights=weights, dropped_forward=dropped_forward, forward=forward)


def _build_scenarios():
    out = []
    # Sanity first: one plain backward per step, as DDP itself does it.
    for stage in (1, 2, 3):
        out.append(_scenario(f"sanity-stage{stage}", "steps", stage, schedule=[1] * STEPS))
    zg_ids = {True: "zero_grad", False: "no_zero_grad"}
    for stage in (1, 2):
        for path in ("engine", "manual"):
            for zero_grad in (True, False):
                out.append(_scenario(f"two-stage{stage}-{path}-{zg_ids[zero_grad]}", "steps", stage, path, zero_grad))
    # ZeRO-1 with contiguous_gradients and overlap_comm off: DeepSpeed makes no gradient hooks
    # and reduces .grad in the boundary backward's epilogue (GAS 1 and 2).
    without_hooks = {"contiguous_gradients": False, "overlap_comm": False}
    for path in ("engine", "manual"):
        for zero_grad in (True, False):
            out.append(_scenario(f"two-stage1-without_hooks-{path}-{zg_ids[zero_grad]}", "steps", 1, path, zero_grad,
                                 zero=without_hooks))
    out.append(_scenario("two-stage1-without_hooks-engine-gas2", "steps", 1, schedule=[2, 2, 1, 2, 2, 1], gas=2,
                         zero=without_hooks))
    # ZeRO-1/2 with CPU optimizer offload: the fp32 gradients carried across backwards, alone
    # (GAS 1) and beside DeepSpeed's micro-step accumulators (GAS 2); no offload as a control.
    for stage in (1, 2):
        for offload in (True, False):
            for gas, schedule in ((1, [2, 1, 2]), (2, [2, 2, 1, 2, 2, 1])):
                sid = f"carry-stage{stage}-{'offload' if offload else 'no_offload'}-gas{gas}"
                out.append(_scenario(sid, "steps", stage, schedule=schedule, offload=offload, gas=gas))
    # An fp64 model: DeepSpeed accumulates its gradients in fp32 (0.19.8 in one flat fp32
    # partition that sums every backward until step(): nothing carried), and copies them into
    # its buckets itself (the fused fill has no fp64 kernel). Against DDP in fp64.
    for stage in (1, 2):
        for offload in (True, False):
            for gas, schedule in ((1, [2, 1, 2]), (2, [2, 2, 1, 2, 2, 1])):
                sid = f"fp64-stage{stage}-{'offload' if offload else 'no_offload'}-gas{gas}"
                out.append(_scenario(sid, "steps", stage, model="mlp_norm_fp64", schedule=schedule, offload=offload,
                                     gas=gas))
    # ZeRO-1 keeps such gradients in param.grad_accum: 0.17.6 and 0.18.9 reduce those wrong over
    # several ranks (stock), and install() refuses it there.
    out.append(dict(id="fp64-stage1-install_refused_before_0.19.8", kind="zero1_separate_accumulation", stage=1))
    # Stage 3: every model x policy x path x zero_grad with all params partitioned
    # (persistence 0); with the default threshold (100000: these small models then keep
    # every param persistent, so the policy has nothing to do) every model x path x zero_grad.
    for model in ("mlp_norm", "tied_lm"):
        for persistence, policies in ((0, ("regather", "pin")), (100_000, ("regather", ))):
            for policy in policies:
                for path in ("engine", "manual"):
                    for zero_grad in (True, False):
                        sid = f"two-stage3-{model}-persist{persistence}-{policy}-{path}-{zg_ids[zero_grad]}"
                        out.append(_scenario(sid, "steps", 3, path, zero_grad, policy, model, persistence))
    # Models built inside zero.Init, as the HF Trainer and large-model scripts build them for
    # ZeRO-3 (on 0.17.6 this is also the only way F.linear becomes DeepSpeed's own linear).
    for model in ("mlp_norm", "tied_lm"):
        for policy in ("regather", "pin"):
            for zero_grad in (True, False):
                sid = f"two-stage3-{model}-zero_init-{policy}-engine-{zg_ids[zero_grad]}"
                out.append(_scenario(sid, "steps", 3, "engine", zero_grad, policy, model, zero_init=True))
    # ZeRO-3 settings that change how DeepSpeed fetches params or steps, each module's params
    # released right after it: fetches by all-reduce instead of all-gather (nothing for the
    # fused copy-out there), optimizer sub-groups smaller than a param (with offload), and a
    # limit on live params below one module's. Before any hpZ engine: DeepSpeed keeps hpZ's
    # process group after that engine and gives every later engine secondary shards
    # (gathered by all-gather, whatever the fetch setting).
    released_at_once = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    zero3_fetches = {"allreduce_fetch": {"stage3_use_all_reduce_for_fetch_params": True},
                     "sub_group10_offload": {"sub_group_size": 10, "offload_optimizer": {"device": "cpu"}},
                     "max_live10": {"stage3_max_live_parameters": 10}}
    for variant, zero in zero3_fetches.items():
        for policy in ("regather", "pin"):
            out.append(_scenario(f"two-stage3-mlp_norm-{variant}-{policy}-engine-no_zero_grad", "steps", 3, "engine",
                                 False, policy, zero=dict(zero, **released_at_once), schedule=[2, 2, 1, 2, 2, 1],
                                 gas=2))
    # ZeRO-3 settings that change where params live or how they are gathered: param offload
    # to the CPU (ZeRO-Offload / ZeRO-Infinity, alone and with optimizer offload) and ZeRO++'s
    # hierarchical partitioning (hpZ: a secondary shard per node group that the backward
    # gathers from). ZeRO++'s quantized weights (qwZ) have no CPU kernel in DeepSpeed.
    zero3_variants = {"offload_param": {"offload_param": {"device": "cpu"}},
                      "offload_param_and_optimizer": {"offload_param": {"device": "cpu"},
                                                      "offload_optimizer": {"device": "cpu"}},
                      "hpz2": {"zero_hpz_partition_size": 2}}
    for variant, zero in zero3_variants.items():
        for model, policy, path, zero_grad in (("mlp_norm", "regather", "engine", False),
                                               ("tied_lm", "pin", "engine", True),
                                               ("tied_lm", "regather", "manual", False)):
            sid = f"two-stage3-{model}-{variant}-{policy}-{path}-{zg_ids[zero_grad]}"
            out.append(_scenario(sid, "steps", 3, path, zero_grad, policy, model, zero=zero))
    # DeepSpeed's other ways of reducing a bucket: an all-reduce instead of its reduce-scatter,
    # with the division split around it (gradient_predivide_factor) or before it
    # (prescale_gradients); on ZeRO-1 also beside the reduce-scatter. Two backwards in the
    # first micro-step of each accumulation window, one plain backward in the second.
    window = [2, 2, 1, 2, 2, 1]
    reductions = {"allreduce-predivide4": ({"reduce_scatter": False}, {"gradient_predivide_factor": 4.0}),
                  "allreduce-prescale": ({"reduce_scatter": False}, {"prescale_gradients": True})}
    for stage in (1, 2, 3):
        for name, (zero, config) in reductions.items():
            for path in ("engine", "manual"):
                out.append(_scenario(f"reduction-stage{stage}-{name}-{path}", "steps", stage, path, schedule=window,
                                     gas=2, zero=zero, config=config))
    out.append(_scenario("reduction-stage1-reduce_scatter-predivide4-engine", "steps", 1, schedule=window, gas=2,
                         config={"gradient_predivide_factor": 4.0}))
    # ZeRO-1/2's round-robin gradient partitioning, made for optimizer offload: DeepSpeed
    # reorders the params in its flat buffers. Its fp32 view of a param
    # (safe_get_full_fp32_param) then reads another param's slice (the mapping assumes the
    # model's order when no padding was added), so these compare the params themselves.
    for stage in (1, 2):
        for offload in (False, True):
            sid = f"round_robin-stage{stage}-{'offload' if offload else 'no_offload'}"
            out.append(_scenario(sid, "steps", stage, schedule=window, gas=2, offload=offload,
                                 zero={"round_robin_gradients": True}, weights="param_data"))
    # Gradients communicated in bf16 or fp16 on an fp32 model (communication_data_type):
    # the buckets hold the low-precision copies the fused fill converts to. Installed, one
    # backward per micro-step and two, against DDP within the rounding of the communicated
    # gradients; with one, also against stock weight for weight.
    for stage in (1, 2, 3):
        for comm in (("bf16", "fp16") if stage == 2 else ("bf16", )):
            config = {"communication_data_type": comm}
            for kind, install, schedule in (("stock", False, [1] * 6), ("installed", True, [1] * 6),
                                            ("retained", True, window)):
                out.append(_scenario(f"comm_{comm}-stage{stage}-{kind}", "comm_dtype", stage, schedule=schedule, gas=2,
                                     install=install, config=config, weights="recorded"))
    # DeepSpeed's torch_autocast section: the forward under torch.autocast (bf16), the fp32
    # params of Linear layers communicated in bf16 and the rest in fp32, so two buckets fill
    # side by side. Oracles: DDP and the all-reduced model with the same autocast forward.
    # The last variant's small buckets fill mid-backward, with overlap_comm's double buffers.
    autocast = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    for stage in (1, 2, 3):
        for kind, install, schedule, path, zero in (
                ("stock", False, [1] * 6, "engine", None), ("installed", True, [1] * 6, "engine", None),
                ("retained", True, window, "engine", None),
                ("retained_small_buckets", True, window, "manual", {"reduce_bucket_size": 40, "overlap_comm": True})):
            out.append(_scenario(f"autocast-stage{stage}-{kind}", "autocast", stage, path, schedule=schedule, gas=2,
                                 install=install, zero=zero, config=autocast, weights="recorded"))
    # Activation checkpointing: a reentrant checkpoint runs a backward inside the backward,
    # with DeepSpeed's hooks firing in it (ZeRO-1/2: the bucket order check must still run
    # once per outer backward, test_two_ranks checks the count).
    for stage in (1, 2, 3):
        for model in ("ckpt_reentrant", "ckpt_nonreentrant"):
            for path in ("engine", "manual"):
                out.append(_scenario(f"two-stage{stage}-{model}-{path}-no_zero_grad", "steps", stage, path, False,
                                     model=model))
    # A transformers Llama under HF reentrant activation checkpointing (ZeRO-3: built inside
    # zero.Init, as the HF Trainer builds it), GAS 1 and 2.
    for stage, policy, zero_init in ((1, "regather", False), (2, "regather", False), (3, "regather", True),
                                     (3, "pin", True)):
        for gas, schedule in ((1, None), (2, [2, 2, 1, 2, 2, 1])):
            init = "-zero_init" if zero_init else ""
            out.append(_scenario(f"two-stage{stage}-llama_ckpt{init}-{policy}-gas{gas}", "steps", stage, policy=policy,
                                 model="llama_ckpt", zero_init=zero_init, gas=gas, schedule=schedule))
    # Every trainable param inside a reentrant checkpoint (LoRA adapters under HF gradient
    # checkpointing): the outer backward's own graph reaches none of them.
    for stage in (1, 2, 3):
        for gas, schedule in ((1, None), (2, [2, 2, 1, 2, 2, 1])):
            for path in ("engine", "manual"):
                out.append(_scenario(f"two-stage{stage}-ckpt_adapters-{path}-gas{gas}", "steps", stage, path,
                                     model="ckpt_adapters", gas=gas, schedule=schedule))
    # A zero-size param (a device marker), which 0.19.8 leaves out of the ZeRO optimizer. Not
    # ZeRO-3: its gather of a zero-size param fails on more than one rank, stock (README).
    for stage in (1, 2):
        for gas, schedule in ((1, None), (2, [2, 2, 1, 2, 2, 1])):
            out.append(_scenario(f"two-stage{stage}-device_marked-gas{gas}", "steps", stage,
                                 model="device_marked", gas=gas, schedule=schedule))
    # torch's selective activation checkpointing (one backward per forward, as it allows), after
    # a first forward whose graph is dropped: ZeRO-3's gathers and releases stay out of its regions.
    for stage, policy in ((1, "regather"), (2, "regather"), (3, "regather"), (3, "pin")):
        out.append(_scenario(f"selective_ckpt-stage{stage}-{policy}-dropped_forward", "steps", stage, policy=policy,
                             model="selective_ckpt", schedule=[1] * STEPS, dropped_forward=True))
    # The other spellings of the clear between the two backwards, the ZeRO optimizer's
    # zero_grad() and torch's model.zero_grad(): each drops what every rank reduced.
    for stage in (1, 2, 3):
        for clear in ("optimizer", "model"):
            out.append(_scenario(f"two-stage{stage}-engine-{clear}_zero_grad", "steps", stage, "engine", clear))
    # A layer frozen between the two backwards of a step (a GAN step in one engine).
    for stage in (1, 2, 3):
        for offload in (False, True):
            out.append(_scenario(f"freeze-stage{stage}-{'offload' if offload else 'no_offload'}", "freeze", stage,
                                 offload=offload))
    # A frozen embedding with max_norm in the trained model: each forward renormalizes rows of
    # its weight in place, in ZeRO-3's gathered copy on 2 ranks.
    for stage in (1, 2, 3):
        out.append(_scenario(f"frozen_max_norm-stage{stage}", "frozen_max_norm", stage))
    # A block applied twice under reentrant checkpointing: refused on every rank (the default
    # bucket, and one smaller than the model, reduced between the two applications), then
    # non-reentrant training goes on.
    for stage in (2, 3):
        for bucket in ("default_bucket", "small_bucket"):
            out.append(_scenario(f"shared_ckpt-stage{stage}-{bucket}", "shared_ckpt", stage,
                                 zero={"reduce_bucket_size": 16} if bucket == "small_bucket" else None))
    # engine.compile() (plain torch.compile of the module, aot_eager: AOTAutograd saves the
    # tensors, no code generation) before install, as accelerate does; ZeRO-3 releases each
    # module's params right after it, so the retained graph outlives every gather.
    eager_release = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    for stage, model, policy, path, zero_grad in ((1, "mlp_norm", "regather", "engine", False),
                                                  (2, "mlp_norm", "regather", "manual", True),
                                                  (2, "ckpt_nonreentrant", "regather", "engine", False),
                                                  (3, "mlp_norm", "regather", "engine", False),
                                                  (3, "mlp_norm", "pin", "manual", True),
                                                  (3, "ckpt_nonreentrant", "regather", "engine", True)):
        sid = f"compiled-stage{stage}-{model}-{policy}-{path}-{zg_ids[zero_grad]}"
        out.append(_scenario(sid, "steps", stage, path, zero_grad, policy, model, compile="aot_eager",
                             zero=eager_release if stage == 3 else None))
    for policy in ("regather", "pin"):
        for path in ("engine", "manual"):
            out.append(_scenario(f"penalty-stage3-{policy}-{path}", "penalty", 3, path, policy=policy))
    for model in ("mlp_norm", "tied_lm"):
        for policy in ("regather", "pin"):
            out.append(_scenario(f"alternating-stage3-{model}-{policy}", "steps", 3, "manual", False, policy, model,
                                 schedule=[2, 1, 2]))
    # ZeRO-3 leaf modules (as transformers sets them on MoE blocks): one hook per module
    # reduces its params' gradients, a collective. Two backwards, a gradient penalty, and
    # torch.autograd.grad before or after the training backward (below) on every rank alike.
    for policy, path, zero_grad in (("regather", "engine", False), ("pin", "manual", True),
                                    ("regather", "manual", True), ("pin", "engine", False)):
        out.append(_scenario(f"leaf-stage3-{policy}-{path}-{zg_ids[zero_grad]}", "steps", 3, path, zero_grad, policy,
                             leaf=True))
    out.append(_scenario("penalty-stage3-leaf-regather-engine", "penalty", 3, "engine", policy="regather", leaf=True))
    # engine.backward divides the loss by GAS (installed 0.18.9 too, whose stock divides only at
    # engine(...)'s outputs): a gradient penalty's double-backward path, a forward through the module.
    for stage in (1, 2, 3):
        out.append(_scenario(f"penalty-stage{stage}-gas2-engine", "penalty", stage, schedule=[1] * 4, gas=2))
        out.append(_scenario(f"two-stage{stage}-module_forward-gas2-engine", "steps", stage, schedule=[2, 1, 2, 2],
                             gas=2, forward="module"))
    # TRL's generation context before every step (GRPO, PPO): DeepSpeed's module hooks are
    # removed and registered anew behind ours, on every rank.
    if _has_trl():
        for model, policy, path in (("mlp_norm", "regather", "engine"), ("tied_lm", "pin", "engine"),
                                    ("mlp_norm", "pin", "manual"), ("tied_lm", "regather", "manual")):
            out.append(_scenario(f"generation-stage3-{model}-{policy}-{path}", "steps", 3, path, False, policy, model,
                                 generation=True))
    # A first step with one backward, then two every step: DeepSpeed re-records its trace at
    # step 2 and its release decisions must follow the new trace on both ranks alike.
    for model in ("mlp_norm", "tied_lm"):
        for policy in ("regather", "pin"):
            out.append(_scenario(f"trace-changes-stage3-{model}-{policy}", "steps", 3, "engine", False, policy, model,
                                 schedule=[1, 2, 2, 2]))
    # The multi-task loop of the gradient-bucket report: one backward per task (GAS =
    # tasks) and one summed backward, with and without CPU optimizer offload; and heads
    # left without a gradient in a step (sampled tasks, zero_grad() between two backwards
    # or between two micro-steps).
    for stage in (1, 2, 3):
        for offload in (False, True):
            for mode in ("per_task", "summed", "sampled", "zero_grad_between", "zero_grad_mid_window",
                         "head_per_backward"):
                sid = f"multitask-stage{stage}-{'offload' if offload else 'no_offload'}-{mode}-fp32"
                out.append(dict(id=sid, kind="multitask", stage=stage, offload=offload, mode=mode, dtype="fp32"))
        for offload in (False, True):  # bf16: with offload must equal without it
            out.append(dict(id=f"multitask-stage{stage}-{'offload' if offload else 'no_offload'}-per_task-bf16",
                            kind="multitask", stage=stage, offload=offload, mode="per_task", dtype="bf16"))
        # bf16 gradients communicated in fp32 (the buckets fp32: the fused fill widens them).
        for offload in (False, True):
            out.append(dict(id=f"multitask-stage{stage}-{'offload' if offload else 'no_offload'}-per_task-bf16-comm_fp32",
                            kind="multitask", stage=stage, offload=offload, mode="per_task", dtype="bf16", comm="fp32"))
    # fp16 with a dynamic loss scale: only rank 0's losses overflow (fp16_scaling.SCHEDULE),
    # and both ranks must skip those steps; zero_grad() between the backwards or not.
    for stage in (1, 2, 3):
        for offload in (False, True):
            for zero_grad in (True, False):
                sid = f"fp16-stage{stage}-{'offload' if offload else 'no_offload'}-{zg_ids[zero_grad]}"
                out.append(dict(id=sid, kind="fp16", stage=stage, offload=offload, zero_grad=zero_grad))
    # ZeRO-1/2 with the heads run in another order on rank 1 in the first step (same-sized
    # buckets, different params in each slot): installed, every rank raises and drops the
    # mixed gradients, and the next steps train as DDP over those steps alone. The controls,
    # the check turned off and stock DeepSpeed, train on silently off DDP (stock 0.18.9 with
    # its flat buffers detached, as install does: it cannot step on 2 gloo ranks otherwise).
    for stage in (1, 2):
        for offload in (False, True):
            for path in ("engine", "manual"):
                sid = f"bucket_order-stage{stage}-{'offload' if offload else 'no_offload'}-{path}"
                out.append(dict(id=sid, kind="bucket_order", stage=stage, offload=offload, path=path, check=True,
                                install=True))
        out.append(dict(id=f"bucket_order-stage{stage}-check_off", kind="bucket_order", stage=stage, offload=False,
                        path="engine", check=False, install=True))
        out.append(dict(id=f"bucket_order-stage{stage}-no-install", kind="bucket_order", stage=stage, offload=False,
                        path="engine", check=False, install=False))
        # GAS 2, the order differs in a non-boundary micro-step only: ZeRO-2 reduces there
        # (raise, the window so far dropped), ZeRO-1 does not (nothing to check, no raise).
        out.append(dict(id=f"bucket_order-stage{stage}-gas2", kind="bucket_order", stage=stage, offload=False,
                        path="engine", check=True, install=True, gas=2))
    # DeepSpeed's Muon optimizer without offload: each boundary epilogue writes Muon's update
    # (not linear in the gradient) into the partitions; installed, two retained backwards per
    # micro-step train as stock's one backward of the summed losses on the same two ranks.
    for stage in (1, 2):
        for gas in (1, 2):
            out.append(dict(id=f"muon-stage{stage}-gas{gas}", kind="muon", stage=stage, gas=gas))
    # A backward through a graph saved before step(): every rank refuses it as torch does,
    # then the ranks train on in step.
    for stage, policy in ((1, "regather"), (2, "regather"), (3, "regather"), (3, "pin")):
        out.append(dict(id=f"stale-stage{stage}-{policy}", kind="stale", stage=stage, policy=policy,
                        zero=eager_release if stage == 3 else {}))
    # torch.autograd.grad through a graph a training backward also runs through: for the input
    # after that backward (retained), or for a shared weight before it (GradNorm). Under
    # "regather" every rank gathers the released params again, in the same order.
    for wrt in ("input", "param"):
        for stage, policy in ((2, "regather"), (3, "regather"), (3, "pin")):
            out.append(dict(id=f"autograd_grad-{wrt}-stage{stage}-{policy}", kind="autograd_grad", wrt=wrt,
                            stage=stage, policy=policy))
        out.append(dict(id=f"autograd_grad-{wrt}-stage3-regather-leaf", kind="autograd_grad", wrt=wrt, stage=3,
                        policy="regather", leaf=True))
    # A backward that dies half-way on every rank at once (a check in the model raising, the
    # same on each rank), after a retained one, then what the user does next: the ranks clean
    # up alike and train on like the oracle. With a bucket as small as one weight, DeepSpeed
    # reduces (a collective) inside the dying backward. "plain": a loss.backward() follows.
    def dead(stage, then, offload=False, bucket="whole_model", dies="engine_backward", policy="regather"):
        sid = f"dead-stage{stage}{'-offload' if offload else ''}-{policy}-{bucket}-{dies}-{then}"
        return dict(id=sid, kind="dead", stage=stage, offload=offload, then=then, bucket=bucket, dies=dies,
                    policy=policy, path="manual" if then == "retained_loss_plain_backward" else "engine")

    for stage, offload in ((1, False), (2, False), (3, False), (2, True)):
        for then in ("retained_loss", "new_forward", "zero_grad"):
            out.append(dead(stage, then, offload))
    for stage in (1, 2, 3):
        for then in ("new_forward", "zero_grad"):
            out.append(dead(stage, then, bucket="one_weight"))
        out.append(dead(stage, "retained_loss_plain_backward"))
    out.append(dead(2, "new_forward", dies="autograd_grad"))
    out.append(dead(3, "retained_loss", dies="autograd_grad"))
    out.append(dead(3, "retained_loss", policy="pin"))  # pinned params of both graphs: all let go
    out.append(dead(3, "new_forward", bucket="one_weight", policy="pin"))
    # GAS 2: a backward dying on every rank after the window's first micro-step, in that
    # micro-step or opening the closing one. ZeRO-1 holds the window's sum unreduced in each
    # rank's param.grad; ZeRO-2 (the control) in its reduced partitions.
    for stage in (1, 2):
        for dies in ("first_micro_step", "opening_closing"):
            out.append(dict(id=f"dead_window-stage{stage}-{dies}", kind="dead_window", stage=stage, dies=dies,
                            policy="regather", offload=False))
    # DeepSpeed 0.19.8's engine.coalesce_grad_reduction(): the backwards of a block leave their
    # gradients on the params and its exit reduces them once (stock ZeRO-3 fails a retained
    # second backward in it like anywhere else).
    if _has_coalesce_grad_reduction():
        for stage, policy in ((1, None), (2, None), (3, "regather"), (3, "pin")):
            for offload in (False, True):
                for mode in ("retained", "two_forwards", "plain_backward"):
                    sid = f"coalesce-stage{stage}-{policy or 'none'}-{'offload' if offload else 'no_offload'}-{mode}"
                    out.append(dict(id=sid, kind="coalesce", stage=stage, policy=policy, offload=offload, mode=mode))
    # DeepSpeed 0.19.8's "managed_gradient_accumulation": false (step() is the boundary, after
    # any number of backwards). Stock controls with loss.backward(): ZeRO-2 fails without offload
    # and trains off the oracle with it, ZeRO-3 fails the retained second backward.
    if _has_coalesce_grad_reduction():
        for stage, policy in ((1, None), (2, None), (3, "regather"), (3, "pin")):
            for offload in (False, True):
                for path in ("engine", "manual"):
                    sid = f"unmanaged-stage{stage}-{policy or 'none'}-{'offload' if offload else 'no_offload'}-{path}"
                    out.append(dict(id=sid, kind="unmanaged", stage=stage, policy=policy, offload=offload, path=path,
                                    install=True))
        for stage, offload in ((2, False), (2, True), (3, True)):
            sid = f"unmanaged-stage{stage}-{'offload' if offload else 'no_offload'}-manual-no-install"
            out.append(dict(id=sid, kind="unmanaged", stage=stage, policy=None, offload=offload, path="manual",
                            install=False))
    # Stock ZeRO-1/2 steps on 2 ranks (0.18.9: its step() fails on gloo; install repairs it).
    for stage in (1, 2):
        out.append(dict(id=f"stock12-stage{stage}-no-install", kind="stock12", stage=stage))
    # Last: a failing backward may leave DeepSpeed's global state odd.
    out.append(_scenario("stock-stage3-no-install", "stock", 3, "engine", True, install=False))
    out.append(_scenario("stock-stage3-zero_init-no-install", "stock", 3, "engine", True, install=False,
                         zero_init=True))
    for variant in ("offload_param", "hpz2"):
        out.append(_scenario(f"stock-stage3-{variant}-no-install", "stock", 3, "engine", True, install=False,
                             zero=zero3_variants[variant]))
    out.append(_scenario("stock-stage3-compiled-no-install", "stock", 3, "engine", True, install=False,
                         zero=eager_release, compile="aot_eager"))
    # DeepSpeed's autocast saves the LayerNorm's fp32 params as they are: stock still fails.
    out.append(_scenario("stock-stage3-torch_autocast-no-install", "stock", 3, "engine", True, install=False,
                         config=autocast))
    if deepspeed_release() == "0.17.6":
        # 0.17.6 reduces a leaf module once per forward: a second pass raises
        # (test_zero3_leaf_modules checks that on 1 rank).
        out = [sc for sc in out if not sc.get("leaf")]
        # 0.17.6 keys its buckets by the communication dtype, but a full bucket's report and a
        # param larger than a bucket under the param's: a KeyError, or a failed narrow of the
        # bucket, in DeepSpeed's own paths (stock too) when the two differ (communication_data_type,
        # or torch_autocast's bf16 communication of fp32 params).
        out = [sc for sc in out if not (sc["kind"] == "multitask" and sc.get("comm"))]
        out = [sc for sc in out if not (sc["kind"] == "autocast" and sc["zero"].get("reduce_bucket_size"))]
    if deepspeed_release() != "0.19.8":
        out = [sc for sc in out if not (sc.get("model") == "mlp_norm_fp64" and sc["stage"] == 1)]  # refused
        # 0.17.6 and 0.18.9 never all-reduce ZeRO-1's .grad on the CPU accelerator (their
        # split_half_float_double looks for "torch.cpu.FloatTensor", which no tensor is; 0.19.8
        # compares dtypes): without hooks each rank steps on its own gradients, stock too.
        out = [sc for sc in out if "without_hooks" not in sc["id"]]
        # 0.17.6 and 0.18.9 refuse a second backward with ZeRO-2 offload and GAS > 1 (test_retain_graph checks that).
        # Muon at GAS 2: stock 0.17.6 keeps only the last micro-step, so it cannot be the oracle.
        # On 0.18.9 the gradient sums reaching Muon differ from the summed loss's by float
        # rounding only (3.6e-7: two backwards add in another order), and its bf16 Newton-Schulz
        # (fixed there; fp32 in these tests on 0.19.8, harness.muon_engine) blows that up on this
        # tiny model's near rank-deficient gradients: ZeRO-2 3.5e-4 off after 3 steps, stock and
        # installed alike (SGD there: equal); ZeRO-1 2.7e-4 on a CPU with native bf16 (Intel
        # AVX512-BF16; it passed on AMD EPYC). No tolerance fits both.
        out = [sc for sc in out if not (sc["kind"] == "muon" and sc["gas"] > 1)]
        out = [sc for sc in out if not (sc.get("stage") == 2 and sc.get("offload") and sc.get("gas", 1) > 1
                                        and not sc.get("zero_grad") and max(sc.get("schedule") or [1]) > 1)]
    return out if _torch_style_backward() else _engine_paths_only(out)


def deepspeed_release() -> str:
    from importlib.metadata import version  # not deepspeed itself: too heavy for the parent
    return version("deepspeed").split("+")[0]


def _has_coalesce_grad_reduction() -> bool:
    """engine.coalesce_grad_reduction() and managed_gradient_accumulation, both new in 0.19
    (the parent does not import DeepSpeed to ask it)."""
    return deepspeed_release() == "0.19.8"


def _has_trl() -> bool:
    import importlib.util
    return importlib.util.find_spec("trl") is not None


def _torch_style_backward() -> bool:
    """DeepSpeed 0.18+ reduces for a plain loss.backward(); 0.17.6 only inside engine.backward()."""
    return deepspeed_release() != "0.17.6"


def _engine_paths_only(scenarios):
    """DeepSpeed 0.17.6: zero_lifetime refuses loss.backward() (test_retain_graph checks that);
    the manual twins of engine scenarios go, the alternating ones run through the engine."""
    return [dict(sc, path="engine") if sc["id"].startswith("alternating-") else sc for sc in scenarios
            if sc.get("path") != "manual" or sc["id"].startswith("alternating-")]


SCENARIOS = _build_scenarios()


# --------------------------------------------------------------------------------------------
# everything below runs in a rank process


def _set_env(rank, port):
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD), OMP_NUM_THREADS="1")


def _quiet(log_path):
    """Send this rank's stdout/stderr (fd level: DeepSpeed and C++ too) to a log file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _shard(model_name, step, rank):
    from harness import make_input
    return make_input(model_name, seed=1000 + 10 * step + rank)  # a different shard per rank


def _compile(engine, sc):
    """engine.compile() with a counting backend when the scenario asks for it, else None."""
    if not sc.get("compile"):
        return None
    import torch
    from harness import CountingBackend
    torch._dynamo.reset()  # compiled code is cached per code object: no earlier scenario's
    backend = CountingBackend(sc["compile"])
    engine.compile(backend=backend)
    return backend


def _engine_step(engine, sc, step, backwards, rank):
    """One step; returns (params with an hpZ secondary shard, whether compiled code saved tensors)."""
    from harness import graph_has_compiled_code, losses, penalty_loss, two_backwards
    x = _shard(sc["model"], step, rank)
    if sc.get("generation"):
        _generate(engine, x)
    if sc.get("dropped_forward") and step == 0:
        engine(x)  # a skipped batch: its graph goes unbackwarded
    forward = engine.module if sc.get("forward") == "module" else engine  # scenarios of other kinds lack it
    if sc["kind"] == "penalty":
        loss = penalty_loss(forward, x)
        compiled = graph_has_compiled_code(loss)
        engine.backward(loss) if sc["path"] == "engine" else loss.backward()
    elif backwards == 1:
        out = forward(x)
        compiled = graph_has_compiled_code(out)
        loss = losses(out)[0]
        engine.backward(loss) if sc["path"] == "engine" else loss.backward()
    else:
        out = forward(x)
        compiled = graph_has_compiled_code(out)
        two_backwards(engine, out, sc["path"], sc["zero_grad"])
    # hpZ keeps a secondary shard from the forward until the step: count them before it goes.
    secondary = sum(getattr(p, "ds_secondary_tensor", None) is not None for p in engine.module.parameters())
    engine.step()
    return secondary, compiled


def _generate(engine, x):
    """What TRL's ``unwrap_model_for_generation`` does around a generation on ZeRO-3 (its own
    hook functions, without the accelerator it takes): the whole model gathered, DeepSpeed's
    module hooks removed, forwards without gradients, the hooks registered anew."""
    import deepspeed
    import torch
    from trl.models.utils import add_hooks, remove_hooks
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        remove_hooks(engine)
        with torch.no_grad():
            engine.module(x)
        add_hooks(engine)


def _at_boundary(sc, step):
    return (step + 1) % sc["gas"] == 0


def _ddp_step(ddp, opt, sc, step, backwards, rank):
    from harness import losses, penalty_loss
    x = _shard(sc["model"], step, rank)
    if sc["kind"] == "penalty":
        loss = penalty_loss(ddp, x)
    elif backwards == 1:
        loss = losses(ddp(x))[0]
    else:
        l1, l2 = losses(ddp(x))
        loss = l2 if sc["zero_grad"] else l1 + l2  # torch's two-backward result, one reduced backward
    (loss / sc["gas"]).backward()  # DeepSpeed divides each loss by the GAS
    if _at_boundary(sc, step):
        opt.step()
        opt.zero_grad()


def _allreduce_step(model, opt, sc, step, backwards, rank):
    from harness import losses, penalty_loss
    x = _shard(sc["model"], step, rank)
    if sc["kind"] == "penalty":
        (penalty_loss(model, x) / sc["gas"]).backward()
    elif backwards == 1:
        (losses(model(x))[0] / sc["gas"]).backward()
    else:
        l1, l2 = losses(model(x))
        (l1 / sc["gas"]).backward(retain_graph=True)
        if sc["zero_grad"]:
            opt.zero_grad()
        (l2 / sc["gas"]).backward()
    if not _at_boundary(sc, step):
        return  # .grad sums the window's micro-steps; reduced once, at its end
    _oracle_step(model, opt)


def average_over_ranks(grads):
    """Each gradient becomes its mean over the ranks, in place (what DeepSpeed reduces to).
    Also lifetime_programs' reference on several ranks."""
    import torch.distributed as dist
    world = dist.get_world_size()
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world


def _oracle_step(oracle, opt):
    """The oracle's SGD step on its gradients averaged over the ranks (a param with none,
    None on every rank alike, is left out), then zero_grad()."""
    average_over_ranks([p.grad for p in oracle.parameters() if p.grad is not None])
    opt.step()
    opt.zero_grad()


def _against_oracle(engine, oracle):
    """(abs_diff, tol_excess) of the engine's full weights against the oracle's (_compare)."""
    from harness import full_weights
    return _compare(full_weights(engine), {n: p.detach() for n, p in oracle.named_parameters()})


def end_engine(engine, record, installed):
    """The end of a rank's run: an installed run's numeric ``stats()`` into ``record``, then
    ``uninstall`` and ``engine.destroy()``; returns ``record``."""
    import zero_lifetime
    if installed:
        record["stats"] = {k: v for k, v in zero_lifetime.stats(engine).items() if isinstance(v, (int, float, bool))}
        zero_lifetime.uninstall(engine)
    engine.destroy()
    return record


def _compare(got, want):
    """Per param: max |got - want| and max (|got - want| - RTOL |want|) (<= ATOL passes).

    A non-finite value on either side reports inf (NaN would compare as passing)."""
    abs_diff, excess = {}, {}
    for name, g, w in zip(want.keys(), got, want.values()):
        if g.shape != w.shape or not (g.isfinite().all() and w.isfinite().all()):
            abs_diff[name] = excess[name] = float("inf")
            continue
        d = (g - w).abs()
        if d.numel() == 0:  # a zero-size param: its shape (checked above) is all there is
            abs_diff[name] = excess[name] = 0.0
            continue
        abs_diff[name] = d.max().item()
        excess[name] = (d - RTOL * w.abs()).max().item()
    return abs_diff, excess


def _run_training(sc, rank):
    """Builds the engine and both oracles, runs the schedule; returns the comparison record."""
    import copy

    import deepspeed
    import torch
    import zero_lifetime
    from harness import MODELS, MORE_MODELS, ds_config, full_weights, install_or_let_stock_step, released_state

    torch.manual_seed(0)
    model = {**MODELS, **MORE_MODELS}[sc["model"]]()
    ddp_model, ar_model = copy.deepcopy(model), copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = LR[sc["model"]]
    offload = {"offload_optimizer": {"device": "cpu"}} if sc["offload"] else {}
    cfg = ds_config(sc["stage"], sc["persistence"], lr=lr, gas=sc["gas"], **offload, **sc.get("zero", {}))
    cfg.update(sc.get("config") or {})
    if sc["zero_init"]:
        model = _built_in_zero_init(sc["model"], cfg, initial)
    _mark_leaf_modules(model, sc)
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, device_ids=None)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    ar_opt = torch.optim.SGD(ar_model.parameters(), lr=lr)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    backend = _compile(engine, sc)
    install_or_let_stock_step(engine, sc["install"], policy=sc["policy"])

    secondary = compiled_steps = 0
    for step, backwards in enumerate(sc["schedule"]):
        step_secondary, step_compiled = _engine_step(engine, sc, step, backwards, rank)
        secondary, compiled_steps = max(secondary, step_secondary), compiled_steps + step_compiled
        with _oracle_forward_context(sc):
            _ddp_step(ddp, ddp_opt, sc, step, backwards, rank)
            _allreduce_step(ar_model, ar_opt, sc, step, backwards, rank)

    record = {"compiled_graphs": backend.graphs if backend else 0, "compiled_steps": compiled_steps}
    # The dtypes DeepSpeed communicates the params' gradients in, one bucket each (torch_autocast
    # marks each param it lowers with comm_dtype).
    record["comm_dtypes"] = sorted({str(getattr(p, "comm_dtype", p.dtype)) for p in engine.module.parameters()})
    gc.collect()  # the step helpers' graphs are gone; nothing may hold a handle now
    record["stats"] = zero_lifetime.stats(engine) if sc["install"] else {}
    if sc["stage"] == 3:
        gathered, inconsistent = released_state(engine)
        record["gathered_non_persistent"] = gathered
        record["non_empty_released"] = inconsistent
        record["n_non_persistent"] = sum(not getattr(p, "ds_persist", False) for p in engine.module.parameters())
        record["secondary_tensors"] = secondary
    want = {n: p.detach() for n, p in ddp_model.named_parameters()}
    got = ([p.detach().clone() for p in engine.module.parameters()] if sc["weights"] == "param_data" else
           full_weights(engine))
    if sc["weights"] == "recorded":
        record["weights"] = {n: g.tolist() for n, g in zip(want, got)}
    record["abs_diff"], record["tol_excess"] = _compare(got, want)
    record["oracle_abs_diff"], record["oracle_tol_excess"] = _compare(
        [p.detach() for p in ar_model.parameters()], want)
    moved = max((want[n] - initial[n]).abs().max().item() for n in want if want[n].numel())
    record["moved"] = moved if moved == moved else float("inf")  # NaN: fails the movement bound
    del engine, ddp
    return record


def _oracle_forward_context(sc):
    """The oracles run under the autocast DeepSpeed's torch_autocast section puts around the
    engine's forward (their backwards too: autograd runs those in the forward's dtypes)."""
    import contextlib

    import torch
    autocast = sc["config"].get("torch_autocast")
    if not autocast:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, autocast["dtype"]))


def _mark_leaf_modules(model, sc):
    if sc.get("leaf"):
        import torch
        from deepspeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(model, [torch.nn.LayerNorm])


def _built_in_zero_init(model_name, cfg, weights):
    """The model made inside zero.Init (each rank keeps only its shards), then given
    ``weights`` (those the oracles start from) through DeepSpeed's gather-and-modify."""
    import deepspeed
    import torch
    from harness import MODELS, MORE_MODELS

    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = {**MODELS, **MORE_MODELS}[model_name]()
    params = dict(model.named_parameters())
    assert all(p.ds_tensor.numel() < p.ds_numel for p in params.values()), "zero.Init did not partition"
    # One param at a time: DeepSpeed 0.17.6 gathers several with one async all-gather each and
    # waits only the last (fixed in 0.19); over gloo an earlier one can land after the copy
    # below and put DeepSpeed's own initial weights back. One param takes its synchronous path.
    for name, p in params.items():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            with torch.no_grad():
                p.copy_(weights[name])
    return model


def _run_stock(sc, rank):
    """Negative control: stock ZeRO-3 (no install); the first backward retains the graph."""
    import deepspeed
    import torch
    from harness import MODELS, ds_config, losses

    torch.manual_seed(0)
    model = MODELS[sc["model"]]()
    cfg = dict(ds_config(3, sc["persistence"], lr=LR[sc["model"]], **sc.get("zero", {})), **sc["config"])
    if sc["zero_init"]:
        model = _built_in_zero_init(sc["model"], cfg, {n: p.detach() for n, p in model.named_parameters()})
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    _compile(engine, sc)
    l1, l2 = losses(engine(_shard(sc["model"], 0, rank)))
    engine.backward(l1, retain_graph=True)  # works on stock: an error here fails the scenario
    if sc["zero_grad"]:
        engine.zero_grad()
    record = {"raised": None}
    try:
        engine.backward(l2)
    except RuntimeError as exc:
        record["raised"] = f"{type(exc).__name__}: {exc}"
    del engine, l1, l2
    return record


def _mlp_engine_and_oracle(sc, zero=None, config=None, prepare=None, install=True, make_model=None):
    """mlp_norm (or ``make_model()``, with mlp_norm's inputs and lr) from one seed twice: a
    DeepSpeed engine of ``sc``'s stage (``zero``: more zero_optimization settings; ``config``:
    top-level ones; ``prepare(model)`` runs before ``deepspeed.initialize``), installed with
    ``sc``'s policy unless ``install`` is False, and the plain-torch oracle with its SGD.
    Returns (engine, oracle, opt)."""
    import copy

    import deepspeed
    import torch
    import zero_lifetime
    from harness import MODELS, ds_config

    torch.manual_seed(0)
    model = (make_model or MODELS["mlp_norm"])()
    oracle = copy.deepcopy(model)
    lr = LR["mlp_norm"]
    opt = torch.optim.SGD(oracle.parameters(), lr=lr)
    if prepare is not None:
        prepare(model)
    cfg = dict(ds_config(sc["stage"], 0, lr=lr, **(zero or {})), **(config or {}))
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    if install:
        zero_lifetime.install(engine, policy=sc["policy"])
    return engine, oracle, opt


def _offload(sc) -> dict:
    return {"offload_optimizer": {"device": "cpu"}} if sc["offload"] else {}


def _run_stale(sc, rank):
    """Step 0: backward l1 (graph retained), step(), then backward l2 through the stale graph:
    refused on every rank (the plain-torch oracle refuses it too). Steps 1-2: retained two
    backwards, against the oracle averaged over the ranks by all_reduce."""
    import zero_lifetime
    from harness import losses

    engine, oracle, opt = _mlp_engine_and_oracle(sc, zero=sc["zero"])
    x = _shard("mlp_norm", 0, rank)
    raised = {}
    e1, e2 = losses(engine(x))
    engine.backward(e1, retain_graph=True)
    engine.step()
    try:
        engine.backward(e2)
    except RuntimeError as exc:
        raised["engine"] = str(exc)
    r1, r2 = losses(oracle(x))
    r1.backward(retain_graph=True)
    _oracle_step(oracle, opt)
    try:
        r2.backward()
    except RuntimeError as exc:
        raised["oracle"] = str(exc)
    del e1, e2, r1, r2
    engine.zero_grad()
    opt.zero_grad()
    steps = dict(kind="steps", model="mlp_norm", gas=1, zero_grad=False, path="engine")
    for step in (1, 2):
        _engine_step(engine, dict(sc, **steps), step, 2, rank)
        _allreduce_step(oracle, opt, steps, step, 2, rank)
    abs_diff, excess = _against_oracle(engine, oracle)
    gc.collect()
    record = {"raised": raised, "abs_diff": abs_diff, "tol_excess": excess, "stats": zero_lifetime.stats(engine)}
    del engine
    return record


def _run_coalesce(sc, rank):
    """3 steps, each one ``engine.coalesce_grad_reduction()`` block (DeepSpeed 0.19.8+: every
    backward in it leaves its gradients on the params, one reduction at its exit): "retained",
    two backwards over one forward; "two_forwards", a forward and engine.backward per micro-batch;
    "plain_backward", the same with loss.backward(). Against the oracle averaged over the ranks."""
    import zero_lifetime
    from harness import losses

    engine, oracle, opt = _mlp_engine_and_oracle(sc, zero=_offload(sc))
    for step in range(STEPS):
        batches = [_shard("mlp_norm", 2 * step + k, rank) for k in range(2)]
        with engine.coalesce_grad_reduction():
            if sc["mode"] == "retained":
                l1, l2 = losses(engine(batches[0]))
                engine.backward(l1, retain_graph=True)
                engine.backward(l2)
            else:
                for x in batches:
                    loss = sum(losses(engine(x)))
                    engine.backward(loss) if sc["mode"] == "two_forwards" else loss.backward()
        engine.step()
        for x in batches[:1] if sc["mode"] == "retained" else batches:
            sum(losses(oracle(x))).backward()
        _oracle_step(oracle, opt)
    abs_diff, excess = _against_oracle(engine, oracle)
    gc.collect()
    record = {"abs_diff": abs_diff, "tol_excess": excess, "stats": zero_lifetime.stats(engine)}
    engine.destroy()
    del engine
    return record


def _run_muon(sc, rank):
    """STEPS steps of GAS ``gas`` under DeepSpeed's Muon optimizer (Muon for the matrices, Adam
    for the rest). Installed: a retained backward of each loss in every micro-step. The oracle
    is stock DeepSpeed on the same ranks, one backward of the summed losses: Muon has no
    plain-torch twin here."""
    from harness import backward_separately_or_summed, full_weights, install_or_let_stock_step, losses, muon_engine

    def train(install):
        engine = muon_engine(sc["stage"], sc["gas"])
        install_or_let_stock_step(engine, install)
        for micro in range(STEPS * sc["gas"]):
            backward_separately_or_summed(engine, *losses(engine(_shard("mlp_norm", micro, rank))), separately=install)
            engine.step()
        weights = full_weights(engine)
        names = [name for name, _ in engine.module.named_parameters()]
        return end_engine(engine, {}, install), dict(zip(names, weights))

    record, got = train(install=True)
    _, want = train(install=False)
    record["abs_diff"], record["tol_excess"] = _compare(list(got.values()), want)
    return record


# managed_gradient_accumulation=False: per step, the micro-batches before step(); 1 is one
# backward of l1 + l2, 2 a retained backward of l1 then one of l2.
UNMANAGED_STEPS = [[1, 1], [2], [2, 1, 2]]


def _run_unmanaged(sc, rank):
    """``"managed_gradient_accumulation": false`` (DeepSpeed 0.19.8): step() is the accumulation
    boundary, after any number of backwards (UNMANAGED_STEPS). Against the oracle averaged over
    the ranks; ``raised`` holds what a stock run raised (the weights are then not compared)."""
    import zero_lifetime
    from harness import backward_both, backward_by, losses

    engine, oracle, opt = _mlp_engine_and_oracle(sc, zero=_offload(sc), install=sc["install"],
                                                 config={"managed_gradient_accumulation": False})
    raised = None
    try:
        for step, micro_batches in enumerate(UNMANAGED_STEPS):
            for k, backwards in enumerate(micro_batches):
                x = _shard("mlp_norm", 4 * step + k, rank)
                l1, l2 = losses(engine(x))
                if backwards == 2:
                    backward_both(engine, l1, l2, sc["path"], zero_grad=False)
                else:
                    backward_by(engine, l1 + l2, sc["path"])
                sum(losses(oracle(x))).backward()
            engine.step()
            _oracle_step(oracle, opt)
    except Exception as exc:  # noqa: BLE001 - a stock run's failure is its result
        if sc["install"]:
            raise
        raised = f"{type(exc).__name__}: {exc}"
    abs_diff, excess = _against_oracle(engine, oracle) if raised is None else ({}, {})
    gc.collect()
    record = {"raised": raised, "abs_diff": abs_diff, "tol_excess": excess,
              "stats": zero_lifetime.stats(engine) if sc["install"] else None}
    engine.destroy()
    del engine
    return record


def _run_freeze(sc, rank):
    """l1 frozen between the two retained backwards of every other step, unfrozen before
    step(): it keeps the first backward's gradient, against the oracle averaged over the ranks
    (DDP reduces once per backward, so it has no such step)."""
    from harness import backward_by, losses

    engine, oracle, opt = _mlp_engine_and_oracle(sc, zero=_offload(sc))
    for step in range(STEPS):
        x = _shard("mlp_norm", step, rank)
        (l1, l2), (r1, r2) = losses(engine(x)), losses(oracle(x))
        backward_by(engine, l1, sc["path"], retain_graph=True)
        r1.backward(retain_graph=True)
        frozen = step % 2 == 0
        for model in (engine.module, oracle):
            model.l1.requires_grad_(not frozen)
        backward_by(engine, l2, sc["path"])
        r2.backward()
        for model in (engine.module, oracle):
            model.l1.requires_grad_(True)
        engine.step()
        _oracle_step(oracle, opt)
    abs_diff, excess = _against_oracle(engine, oracle)
    return end_engine(engine, {"abs_diff": abs_diff, "tol_excess": excess}, installed=True)


def _frozen_max_norm_embedding():
    import torch
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8, max_norm=1.0), torch.nn.Flatten(), torch.nn.Linear(40, 3))
    model[0].weight.requires_grad_(False)
    return model


def _run_frozen_max_norm(sc, rank):
    """Two retained backwards a step through a frozen embedding with ``max_norm``; the weights
    against the all-reduced oracle, and the largest norm of the rows this rank looked up, on the
    engine and in torch (which renormalizes them in the weight for good)."""
    import torch
    from harness import full_weights, losses, two_backwards

    engine, oracle, opt = _mlp_engine_and_oracle(sc, make_model=_frozen_max_norm_embedding)
    looked_up = set()
    for step in range(STEPS):
        tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1000 + 10 * step + rank))
        looked_up.update(tokens.flatten().tolist())
        two_backwards(engine, engine(tokens), sc["path"], zero_grad=False)
        r1, r2 = losses(oracle(tokens))
        r1.backward(retain_graph=True)
        r2.backward()
        engine.step()
        _oracle_step(oracle, opt)
    abs_diff, excess = _against_oracle(engine, oracle)
    rows = sorted(looked_up)
    record = {"abs_diff": abs_diff, "tol_excess": excess,
              "row_norm": full_weights(engine)[0][rows].norm(dim=1).max().item(),
              "oracle_row_norm": oracle[0].weight[rows].detach().norm(dim=1).max().item()}
    return end_engine(engine, record, installed=True)


def _run_shared_ckpt(sc, rank):
    """The first backward through a block applied twice under reentrant checkpointing raises
    GradientReducedTwiceError on every rank (recorded), then the same engine trains with
    non-reentrant checkpointing, two retained backwards per step, against the oracle averaged
    over the ranks (which never saw the refused batch)."""
    from harness import losses
    from test_shared_block_checkpointing import SharedBlockTwice
    from zero_lifetime.grad_hook_guard import GradientReducedTwiceError

    engine, oracle, opt = _mlp_engine_and_oracle(sc, zero=sc["zero"], make_model=SharedBlockTwice)
    oracle.reentrant = False
    refused = None
    try:
        engine.backward(losses(engine(_shard("mlp_norm", 0, rank)))[0])
    except GradientReducedTwiceError as error:
        refused = str(error)
    engine.module.reentrant = False
    for step in range(1, STEPS + 1):
        x = _shard("mlp_norm", step, rank)
        (l1, l2), (r1, r2) = losses(engine(x)), losses(oracle(x))
        engine.backward(l1, retain_graph=True)
        engine.backward(l2)
        (r1 + r2).backward()
        engine.step()
        _oracle_step(oracle, opt)
    abs_diff, excess = _against_oracle(engine, oracle)
    return end_engine(engine, {"abs_diff": abs_diff, "tol_excess": excess, "refused": refused}, installed=True)


def _run_autograd_grad(sc, rank):
    """Per step, in the scenario's order, torch.autograd.grad and a training backward through
    one graph, then step(); against the oracle averaged over the ranks by all_reduce.
    wrt "input": backward l1 (retained), then autograd.grad(l2, x). wrt "param": autograd.grad
    (l1, l1.weight) (retained), then backward l1 + l2. Records per step the autograd.grad
    result's difference to the oracle's and what stayed gathered right after it."""
    import torch
    import zero_lifetime
    from harness import grad_and_backward, released_state

    engine, oracle, opt = _mlp_engine_and_oracle(sc, prepare=lambda model: _mark_leaf_modules(model, sc))

    grad_diff, gathered_after = [], []
    for step in range(STEPS):
        x = _shard("mlp_norm", step, rank).requires_grad_(sc["wrt"] == "input")
        got = grad_and_backward(engine, engine.backward, engine.module.l1.weight, x, sc["wrt"])
        gathered_after.append(released_state(engine)[0] if sc["stage"] == 3 else [])
        engine.step()
        x_ref = _shard("mlp_norm", step, rank).requires_grad_(sc["wrt"] == "input")
        want = grad_and_backward(oracle, torch.Tensor.backward, oracle.l1.weight, x_ref, sc["wrt"])
        grad_diff.append((got - want).abs().max().item() if got.shape == want.shape else float("inf"))
        _oracle_step(oracle, opt)
    abs_diff, excess = _against_oracle(engine, oracle)
    gc.collect()
    record = {"grad_diff": grad_diff, "gathered_after": gathered_after, "abs_diff": abs_diff,
              "tol_excess": excess, "stats": zero_lifetime.stats(engine)}
    if sc["stage"] == 3:
        record["gathered_at_end"] = released_state(engine)[0]
    del engine
    return record


def _run_dead(sc, rank):
    """Step 0 on every rank: backward l1 (graph retained), a backward (or autograd.grad) that
    dies at the LayerNorm's output, sc["then"], step(); steps 1-2: retained two backwards.
    Oracle: plain torch over the backwards that completed, averaged over the ranks by
    all_reduce. ZeRO-3 keeps what it reduced of the dying backward (as torch keeps what a dead
    backward reached): a param that moved so must equal the oracle's step with the dead
    backward's gradient, averaged over the ranks, added; the oracle then goes on from there."""
    import copy

    import torch
    import zero_lifetime
    from harness import HIDDEN, OUT, full_weights, losses, make_backward_die_at, released_state

    lr = LR["mlp_norm"]
    zero = _offload(sc)
    if sc["bucket"] == "one_weight":
        zero["reduce_bucket_size"] = HIDDEN * OUT
    engine, oracle, opt = _mlp_engine_and_oracle(sc, zero=zero)

    def die(model, backward):
        x_dead = _shard("mlp_norm", 100, rank).requires_grad_(sc["dies"] == "autograd_grad")
        hook = make_backward_die_at(model.ln)
        try:
            loss = losses(model(x_dead))[0]
            torch.autograd.grad(loss, [x_dead]) if sc["dies"] == "autograd_grad" else backward(loss)
        except ArithmeticError as exc:
            return str(exc)
        finally:
            hook.remove()
        return None

    x, x_after = _shard("mlp_norm", 0, rank), _shard("mlp_norm", 101, rank)
    e1, e2 = losses(engine(x))
    engine.backward(e1, retain_graph=True)
    raised = die(engine, engine.backward)
    # What the dying pass gave each param in torch before it raised, averaged over the ranks.
    reached_model = copy.deepcopy(oracle)
    die(reached_model, torch.Tensor.backward)
    reached = {n: p.grad for n, p in reached_model.named_parameters()}
    # The same params got none on every rank: the graph is the same.
    average_over_ranks([grad for grad in reached.values() if grad is not None])
    r1, r2 = losses(oracle(x))
    r1.backward(retain_graph=True)
    if sc["then"] == "retained_loss":
        engine.backward(e2)
        r2.backward()
    elif sc["then"] == "retained_loss_plain_backward":
        e2.backward()
        r2.backward()
    elif sc["then"] == "new_forward":
        engine.backward(losses(engine(x_after))[0])
        losses(oracle(x_after))[0].backward()
    else:
        engine.zero_grad()
        opt.zero_grad()
    engine.step()
    _oracle_step(oracle, opt)  # grads None after zero_grad(), on every rank alike
    del e1, e2, r1, r2
    kept_dead, step0_bad = [], []
    with torch.no_grad():
        for (name, want), got in zip(oracle.named_parameters(), full_weights(engine)):
            if torch.allclose(got, want, atol=ATOL, rtol=RTOL):
                continue
            if reached[name] is not None and torch.allclose(got, want - lr * reached[name], atol=ATOL, rtol=RTOL):
                kept_dead.append(name)
                want.copy_(got)
            else:
                step0_bad.append(name)
    gathered_after_step0 = released_state(engine)[0] if sc["stage"] == 3 else []
    steps = dict(kind="steps", model="mlp_norm", gas=1, zero_grad=False, path=sc["path"])
    for step in (1, 2):
        _engine_step(engine, steps, step, 2, rank)
        _allreduce_step(oracle, opt, steps, step, 2, rank)
    abs_diff, excess = _against_oracle(engine, oracle)
    gc.collect()
    record = {"raised": raised, "kept_dead": kept_dead, "step0_bad": step0_bad,
              "gathered_after_step0": gathered_after_step0, "abs_diff": abs_diff, "tol_excess": excess,
              "stats": zero_lifetime.stats(engine)}
    if sc["stage"] == 3:
        record["gathered_at_end"] = released_state(engine)[0]
    del engine
    return record


def _run_dead_window(sc, rank):
    """GAS 2 on every rank: micro-step 1's backward, then a backward dying at the LayerNorm's
    output (after l2's params got gradients), in micro-step 1 or opening the closing micro-step;
    the rest of the window, then a whole one. Oracle: plain torch over the backwards that
    completed (each loss divided by 2), averaged over the ranks; where the engine keeps what the
    dead backward reached (ZeRO-1, dying in micro-step 1) the oracle runs the dying backward too
    and keeps it, as torch does. ZeRO-1 dying opening the closing micro-step: the next backward
    and step() are refused on every rank, then zero_grad() on both."""
    import zero_lifetime
    from harness import losses, make_backward_die_at

    engine, oracle, opt = _mlp_engine_and_oracle(sc, config={"gradient_accumulation_steps": 2})

    def micro_step(step):
        x = _shard("mlp_norm", step, rank)
        engine.backward(losses(engine(x))[0])
        (losses(oracle(x))[0] / 2).backward()  # DeepSpeed divides each loss by the GAS
        engine.step()

    def die(model, backward):
        hook = make_backward_die_at(model.ln)
        try:
            backward(losses(model(_shard("mlp_norm", 100, rank)))[0])
        except ArithmeticError as exc:
            return str(exc)
        finally:
            hook.remove()
        return None

    record = {}
    x = _shard("mlp_norm", 0, rank)
    engine.backward(losses(engine(x))[0])
    (losses(oracle(x))[0] / 2).backward()
    if sc["dies"] == "first_micro_step":
        record["raised"] = die(engine, engine.backward)
        if sc["stage"] == 1:
            die(oracle, lambda loss: (loss / 2).backward())  # DeepSpeed divides each loss by the GAS
        engine.step()
    else:
        engine.step()
        record["raised"] = die(engine, engine.backward)
        if sc["stage"] == 1:
            x = _shard("mlp_norm", 1, rank)
            refused = []
            for call in (lambda: engine.backward(losses(engine(x))[0]), engine.step):
                try:
                    call()
                    refused.append(None)
                except RuntimeError as exc:
                    refused.append(str(exc))
            record["refused"] = refused
            engine.zero_grad()
            opt.zero_grad()
    micro_step(1)  # closes the window
    _oracle_step(oracle, opt)
    micro_step(2)
    micro_step(3)
    _oracle_step(oracle, opt)
    abs_diff, excess = _against_oracle(engine, oracle)
    record.update(abs_diff=abs_diff, tol_excess=excess, stats=zero_lifetime.stats(engine))
    return record


def _run_multitask(sc, rank):
    import multitask as mt
    import zero_lifetime

    model, reference = mt.make_models()
    engine = mt.build_engine(model, sc["stage"], sc["mode"], sc["offload"], sc["dtype"], comm=sc.get("comm"))
    fill = zero_lifetime.install(engine).bucket_fill
    mt.train_engine(engine, sc["mode"], STEPS, rank=rank, dtype=sc["dtype"])
    mt.train_reference(reference, sc["mode"], STEPS, rank=rank, world=WORLD)
    weights = {name: w.tolist() for name, w in mt.engine_weights(engine).items()}
    return {"abs_diff": mt.max_differences(engine, reference), "tolerance": mt.tolerance(sc["dtype"]),
            "weights": weights,
            "fused_grads": fill.fused_grads if fill else None, "fills": fill.fills if fill else None,
            "prescaled_fills": fill.prescaled_fills if fill else None}


def _run_fp16(sc, rank):
    import fp16_scaling as fp16
    import multitask as mt
    import zero_lifetime

    schedule = fp16.SCHEDULE if rank == 0 else [None] * len(fp16.SCHEDULE)
    model, reference = mt.make_models()
    engine = fp16.build_engine(model, sc["stage"], sc["offload"], bucket=1000)
    zero_lifetime.install(engine)
    fp16.train_engine(engine, "engine", sc["zero_grad"], schedule, rank)
    master, scale, skipped, _ = fp16.train_reference(reference, sc["zero_grad"], schedule, rank, WORLD)
    return {"abs_diff": fp16.compare(engine, master), "scale_and_skips": list(fp16.scale_and_skips(engine)),
            "want_scale_and_skips": [scale, skipped]}


# Tasks per micro-step (their forward order) on each rank: the first one differs between
# ranks. GAS 1: three steps; GAS 2: windows of two (five micro-steps).
BUCKET_ORDER_TASKS = {
    1: {0: [(0, 2), (0, 2), (1, 2)], 1: [(2, 0), (0, 2), (1, 2)]},
    2: {0: [(0, 2), (0, 2), (1, 2), (1, 2), (0, 1)], 1: [(2, 0), (0, 2), (1, 2), (1, 2), (0, 1)]},
}


def _run_bucket_order(sc, rank):
    import multitask as mt
    import torch
    import zero_lifetime
    from harness import install_or_let_stock_step

    gas = sc.get("gas", 1)
    model, reference = mt.make_models()
    engine = mt.build_engine(model, sc["stage"], "sampled", sc["offload"], "fp32", gas=gas)
    install_or_let_stock_step(engine, sc["install"], check_bucket_order=sc["check"])
    opt = torch.optim.SGD(reference.parameters(), lr=mt.LR)
    raised = []
    for micro, tasks in enumerate(BUCKET_ORDER_TASKS[gas][rank]):
        xs = mt.batches(micro, rank)
        loss = sum(mt.task_loss(engine(xs[t], t)) for t in tasks)
        try:
            engine.backward(loss) if sc["path"] == "engine" else loss.backward()
        except zero_lifetime.RanksDisagreeError as exc:
            raised.append(str(exc))
            opt.zero_grad()  # the error dropped the window so far: so does the oracle
            continue  # no step() for this micro-batch
        raised.append(None)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        # The oracle: DDP's semantics (a gradient missing on a rank counts as zero, each
        # micro-step's loss divided by the GAS as DeepSpeed does), for the steps the engine took.
        (sum(mt.task_loss(reference(xs[t], t)) for t in tasks) / gas).backward()
        if not boundary:
            continue
        for p in reference.parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.distributed.all_reduce(grad)
            p.grad = grad / WORLD
        opt.step()
        opt.zero_grad()
    stats = zero_lifetime.stats(engine) if sc["install"] else {}
    return {"abs_diff": mt.max_differences(engine, reference), "raised": raised,
            "order_checks": stats.get("bucket_order_checks")}


def _run_stock12(sc, rank):
    """Negative control: one plain step of stock ZeRO-1/2 (no install); what step() raised."""
    import multitask as mt

    model, _ = mt.make_models()
    engine = mt.build_engine(model, sc["stage"], "summed", False, "fp32")
    engine.backward(sum(mt.task_loss(engine(x, t)) for t, x in enumerate(mt.batches(0, rank))))
    try:
        engine.step()
    except RuntimeError as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    return {"raised": None}


def _run_zero1_separate_accumulation(sc, rank):
    """install() on a 2-rank ZeRO-1 engine of the fp64 model; what it raised."""
    import deepspeed
    import torch
    import zero_lifetime
    from harness import Float64MLPNorm, ds_config
    from zero_lifetime.adapters import UnsupportedDeepSpeedError

    torch.manual_seed(0)
    model = Float64MLPNorm()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(1), model_parameters=model.parameters())
    try:
        zero_lifetime.install(engine)
    except UnsupportedDeepSpeedError as exc:
        return {"raised": str(exc)}
    zero_lifetime.uninstall(engine)
    return {"raised": None}


def _run_scenario(sc, rank):
    if sc["kind"] == "stock12":
        return _run_stock12(sc, rank)
    if sc["kind"] == "zero1_separate_accumulation":
        return _run_zero1_separate_accumulation(sc, rank)
    if sc["kind"] == "bucket_order":
        return _run_bucket_order(sc, rank)
    if sc["kind"] == "multitask":
        return _run_multitask(sc, rank)
    if sc["kind"] == "fp16":
        return _run_fp16(sc, rank)
    if sc["kind"] == "stock":
        return _run_stock(sc, rank)
    if sc["kind"] == "stale":
        return _run_stale(sc, rank)
    if sc["kind"] == "autograd_grad":
        return _run_autograd_grad(sc, rank)
    if sc["kind"] == "dead":
        return _run_dead(sc, rank)
    if sc["kind"] == "dead_window":
        return _run_dead_window(sc, rank)
    if sc["kind"] == "coalesce":
        return _run_coalesce(sc, rank)
    if sc["kind"] == "unmanaged":
        return _run_unmanaged(sc, rank)
    if sc["kind"] == "muon":
        return _run_muon(sc, rank)
    if sc["kind"] == "freeze":
        return _run_freeze(sc, rank)
    if sc["kind"] == "shared_ckpt":
        return _run_shared_ckpt(sc, rank)
    if sc["kind"] == "frozen_max_norm":
        return _run_frozen_max_norm(sc, rank)
    return _run_training(sc, rank)


def run_rank(rank, out_dir, port, scenarios, run_one):
    """One rank: join the gloo group, run every scenario, one JSON line each to rank<r>.jsonl."""
    _set_env(rank, port)
    _quiet(os.path.join(out_dir, f"rank{rank}.log"))
    import logging

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", verbose=False,
                               timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # A separate gloo group for the status exchange: never paired with DeepSpeed's collectives.
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    import harness  # noqa: F401  (imported here, before the freeze, rather than by the first scenario)
    gc.freeze()  # the imports: out of every later collection (see conftest.pytest_collection_finish)

    with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "w") as results:
        for sc in scenarios:
            started = time.perf_counter()
            try:
                record = run_one(sc, rank)
                record["error"] = None
            except BaseException:  # noqa: BLE001 - every failure is a result for the parent
                record = {"error": traceback.format_exc(limit=-8)}
            gc.collect()
            gc.freeze()  # what outlives the scenario: out of later collections (conftest.pytest_runtest_protocol)
            record.update(id=sc["id"], rank=rank, seconds=round(time.perf_counter() - started, 3))
            results.write(json.dumps(record) + "\n")
            results.flush()
            statuses = [None] * WORLD
            dist.all_gather_object(statuses, record["error"] is None, group=control)
            if any(statuses) and not all(statuses):
                # Only some ranks failed: DeepSpeed's collectives may be out of step now.
                # Stop; the parent reports every later scenario as not run. (All ranks
                # failing alike, a deterministic error, leaves them in step: go on.)
                break
    dist.barrier(group=control)
    dist.destroy_process_group()


def main(rank, out_dir, port, only=None):
    """torch.multiprocessing entry point: rank runs every scenario (or those named in only)."""
    scenarios = [sc for sc in SCENARIOS if only is None or sc["id"] in only]
    run_rank(rank, out_dir, port, scenarios, _run_scenario)
