"""What the random lifetime programs run over, on 1 rank and on 2: kept light (no torch, no
DeepSpeed) because the 2-rank test's parent process imports it to list its cases."""

import os

# Every ZeRO stage, and on ZeRO-3 each lifetime policy: (stage, policy).
STAGES_AND_POLICIES = [(1, None), (2, None), (3, "regather"), (3, "pin")]
STAGE_AND_POLICY_IDS = ["stage1", "stage2", "stage3-regather", "stage3-pin"]


def seeds(count_variable: str, default_count: int) -> range:
    """The program seeds: ``count_variable`` of them (default ``default_count``) from
    ZL_LIFETIME_FIRST_SEED (default 0), to run programs no earlier run has tried."""
    first = int(os.environ.get("ZL_LIFETIME_FIRST_SEED", "0"))
    return range(first, first + int(os.environ.get(count_variable, str(default_count))))
