"""Which optimizer a ZeRO engine runs (DeepSpeed 0.19.8 and 0.17.6 alike).

Every other adapter names internals of DeepSpeed's ZeRO optimizers. For some configurations
DeepSpeed runs a different optimizer under the same ZeRO stage; probing its names one by one
would then blame the DeepSpeed version. This check comes first and says what to change; so does
the refusal of a configuration whose gradients DeepSpeed itself reduces wrong on some releases.
"""

import torch

from .errors import UnsupportedDeepSpeedError, deepspeed_version, require, unsupported_feature

# (why DeepSpeed runs another optimizer, what to change)
_BF16_WITH_FP32_ACCUMULATION = (
    'ZeRO stage 1 with bf16 and data_types.grad_accum_dtype "fp32" makes DeepSpeed run a bf16 '
    "optimizer of its own (BF16_Optimizer; on 0.17.6 its fp16 wrapper in bf16) instead of its "
    "ZeRO optimizer",
    'drop grad_accum_dtype "fp32" (gradients then accumulate in bf16, DeepSpeed\'s default) or use '
    "ZeRO stage 2, which accumulates in fp32 with it")


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
    return f"this engine runs {found}", "build it with DeepSpeed's ZeRO optimizer"


def runs_without_optimizer(engine) -> bool:
    """An engine built without an optimizer, on ZeRO-3 (DeepSpeed runs only its parameter
    offload manager, DeepSpeedZeRoOffload, which partitions the params and reduces no gradients)
    or stage 0 (no optimizer; with bf16, DeepSpeed's BF16_Optimizer over a DummyOptim); 0.17.6 to
    0.19.8. install() handles it as a frozen model (``frozen_engine``)."""
    stage = int(engine.zero_optimization_stage())
    optimizer = getattr(engine, "optimizer", None)
    if stage == 3:
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
        return isinstance(optimizer, DeepSpeedZeRoOffload)
    if stage == 0:
        from deepspeed.runtime.utils import DummyOptim
        return optimizer is None or isinstance(getattr(optimizer, "optimizer", None), DummyOptim)
    return False


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


# Releases whose ZeRO-1 reduces gradients accumulated in another dtype wrong over several ranks.
_ZERO1_SEPARATE_ACCUMULATION_WRONG = ("0.17.6", "0.18.9")


def require_zero1_accumulation_it_reduces_right(engine, stage: int) -> None:
    """ZeRO-1 keeps gradients in ``param.grad_accum`` when they accumulate in another dtype than
    the params' (fp16 with ``data_types.grad_accum_dtype: "fp32"``; an fp64 model, whose
    accumulation dtype is DeepSpeed's fp32 default). Over more than one data-parallel rank,
    0.17.6 and 0.18.9 reduce those wrong themselves (measured on 2 gloo ranks against DDP:
    stock 0.17.6 1.2 off after two steps, silently; 0.18.9 fails in step(), and with its flat
    buffers mended by install() it trains as wrong as 0.17.6). 0.19.8 and one rank are right."""
    if stage != 1 or deepspeed_version() not in _ZERO1_SEPARATE_ACCUMULATION_WRONG:
        return
    optimizer = engine.optimizer
    if not require(optimizer, "use_grad_accum_attribute", "the ZeRO-1/2 separate accumulation flag"):
        return
    group = require(optimizer, "dp_process_group", "the data-parallel group")
    if torch.distributed.get_world_size(group=group) <= 1:
        return
    params, accumulation = require(optimizer, "dtype", "the ZeRO-1/2 param dtype"), require(
        optimizer, "gradient_accumulation_dtype", "the ZeRO-1/2 accumulation dtype")
    raise unsupported_feature(
        f"ZeRO stage 1 with {params} params whose gradients accumulate in {accumulation} (fp16 with "
        f'data_types.grad_accum_dtype "fp32", or an fp64 model) over more than one data-parallel rank',
        "DeepSpeed's own reduction of such an engine is wrong on this release (stock 0.17.6 ends 1.2 off "
        "torch DDP after two steps on 2 ranks; 0.18.9 fails in step()). Use DeepSpeed 0.19.8 (right there), "
        "ZeRO stage 2, or accumulate in the params' dtype; strict=False to install() continues without "
        "zero_lifetime")
