"""zero_lifetime: correct and fast parameter lifetimes and gradient buckets for DeepSpeed ZeRO."""

__version__ = "0.1.0"

from .bucket_order_check import RanksDisagreeError  # noqa: E402
from .install import StepWithoutBackwardError, install, stats, uninstall  # noqa: E402
from .jit_locks import warn_if_stale as _warn_if_stale  # noqa: E402

_warn_if_stale()

__all__ = ["install", "uninstall", "stats", "StepWithoutBackwardError", "RanksDisagreeError", "__version__"]
