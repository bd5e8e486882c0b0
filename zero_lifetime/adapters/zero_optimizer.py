"""Which optimizer a ZeRO engine runs (DeepSpeed 0.19.8 and 0.17.6 alike).

Every other adapter names internals of DeepSpeed's ZeRO optimizers. For some configurations
DeepSpeed runs a different optimizer under the same ZeRO stage; probing its names one by one
would then blame the DeepSpeed version. This check comes first and says what to change.
"""

import torch

from .errors import UnsupportedDeepSpeedError

# (why DeepSpeed runs another optimizer, what to change)
_BF16_WITH_FP32_ACCUMULATION = (
    'ZeRO stage 1 with bf16 and data_types.grad_accum_dtype "fp32" makes DeepSpeed run a bf16 '
    "optimizer of its own (BF16_Optimizer; on 0.17.6 its fp16 wrapper in bf16) instead of its "
    "ZeRO optimizer",
    'drop grad_accum_dtype "fp32" (gradients then accumulate in bf16, DeepSpeed\'s default) or use '
    "ZeRO stage 2, which accumulates in fp32 with it")
_ZERO3_WITHOUT_OPTIMIZER = (
    "a ZeRO-3 engine built without an optimizer only partitions its params and reduces no gradients",
    'give deepspeed.initialize an optimizer (an "optimizer" section in the config, or optimizer=)')


def _zero_optimizer_class(stage: int):
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        return DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return DeepSpeedZeroOptimizer


def _why_another_optimizer(engine, stage: int, found: str):
    # Public engine methods on both releases; the config, not the class, tells this case.
    if stage == 1 and engine.bfloat16_enabled() and engine.get_data_types()[1] == torch.float32:
        return _BF16_WITH_FP32_ACCUMULATION
    if stage == 3 and found == "DeepSpeedZeRoOffload":
        return _ZERO3_WITHOUT_OPTIMIZER
    return f"this engine runs {found}", "build it with DeepSpeed's ZeRO optimizer"


def require_zero_optimizer(engine, stage: int) -> None:
    """Raise UnsupportedDeepSpeedError unless ``engine`` runs the ZeRO optimizer of ``stage``
    (subclasses too: ZenFlow's, for example)."""
    expected = _zero_optimizer_class(stage)
    optimizer = getattr(engine, "optimizer", None)
    if isinstance(optimizer, expected):
        return
    found = type(optimizer).__name__
    why, change = _why_another_optimizer(engine, stage, found)
    raise UnsupportedDeepSpeedError(
        f"zero_lifetime cannot be installed on this engine: {why}. zero_lifetime works with "
        f"DeepSpeed's ZeRO stage {stage} optimizer ({expected.__name__}); this engine's optimizer "
        f"is {found}. To use zero_lifetime, {change}. Pass strict=False to install() to continue "
        f"without zero_lifetime (a warning, and nothing is patched).")
