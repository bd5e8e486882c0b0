"""Rank process for tests/test_two_rank_programs.py: random lifetime programs on 2 ranks.

Every rank runs the same seeded programs (lifetime_programs.py) on its own inputs, one fresh
installed engine each, in one spawn (DeepSpeed's import is paid once per rank). On 2 ranks
ZeRO-3 really partitions: gathers are all-gathers and the copy-out splits them, gradients are
reduce-scattered, ZeRO-1/2 buckets are averaged over the ranks; on 1 rank all of that is a
copy. One JSON line per program and rank goes to ``<out>/rank<r>.jsonl`` (two_rank_worker).

This module imports nothing heavy at the top: the parent imports it for ``cases``.
"""

import two_rank_worker
from program_cases import STAGES_AND_POLICIES
ZERO3 = [(3, "regather"), (3, "pin")]
VARIANTS = [  # (name, run_program's keywords, stages and policies)
    ("plain", {}, STAGES_AND_POLICIES),
    ("gas2", {"gas": 2}, STAGES_AND_POLICIES),
    ("offload", {"offload": True}, STAGES_AND_POLICIES),
    ("gas2_offload", {"gas": 2, "offload": True}, STAGES_AND_POLICIES),
    # DeepSpeed's reuse distance and prefetch: on 2 ranks prefetched all-gathers are in flight
    # while the lifetime releases and re-gathers.
    ("default_windows", {"windows": "default"}, ZERO3),
    # ZeRO-1 without DeepSpeed's gradient hooks: .grad reduced in the boundary epilogue.
    ("no_hooks", {"gradient_hooks": False}, [(1, None)]),
]
# Smaller SGD steps than on 1 rank (0.1). DeepSpeed averages each backward's gradients over
# the ranks as it reduces them, torch's reference the sum of a step's backwards: another order
# of addition, a few ulps apart after the first step with two backwards (bit-equal with one),
# which a program whose training runs away (the second loss is unbounded) magnifies past any
# tolerance (tied_lm, seed 0, 4e-5 at its third step). Steps these small keep it tame.
LR = {"tied_lm": 0.001}
DEFAULT_LR = 0.01


def cases(model_names, seeds, length: int, release: str):
    out = []
    for variant, options, stages_and_policies in VARIANTS:
        for stage, policy in stages_and_policies:
            if release != "0.19.8" and _not_on_older_releases(stage, options):
                continue
            for model_name in model_names:
                for seed in seeds:
                    label = f"stage{stage}" + (f"-{policy}" if policy else "")
                    out.append(dict(id=f"{variant}-{label}-{model_name}-{seed}", stage=stage, policy=policy,
                                    model=model_name, seed=seed, length=length,
                                    options=dict(options, lr=LR.get(model_name, DEFAULT_LR))))
    return out


def _not_on_older_releases(stage: int, options: dict) -> bool:
    """0.18.9 and 0.17.6 refuse a second backward in a micro-step of ZeRO-2 with CPU offload
    at GAS > 1 (documented; offload at GAS 1 runs there). And on the CPU they never all-reduce
    ZeRO-1's .grad without gradient hooks (two_rank_worker: each rank steps on its own)."""
    if stage == 2 and options.get("gas", 1) > 1 and options.get("offload"):
        return True
    return not options.get("gradient_hooks", True)


def _run_case(case, rank):
    from lifetime_programs import run_program
    runner = run_program(case["model"], case["stage"], case["policy"], case["seed"], case["length"],
                         **case["options"])
    return {"operations": runner.operations, "forwards": runner.forwards, "world": runner.world}


def main(rank, out_dir, port, cases_to_run):
    two_rank_worker.run_rank(rank, out_dir, port, cases_to_run, _run_case)
