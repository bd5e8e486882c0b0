"""Every DeepSpeed private name used by zero_lifetime lives in this package.

One module per concern; each probes its names at install time and raises
UnsupportedDeepSpeedError (naming the supported versions) when they are missing,
so an unknown DeepSpeed fails loudly instead of half-working.
"""

from .errors import SUPPORTED_DEEPSPEED_VERSIONS, UnsupportedDeepSpeedError

__all__ = ["SUPPORTED_DEEPSPEED_VERSIONS", "UnsupportedDeepSpeedError"]
