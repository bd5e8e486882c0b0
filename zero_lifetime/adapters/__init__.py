"""DeepSpeed's private names: one module per concern, each probing its names at install.

A missing name raises UnsupportedDeepSpeedError (naming the supported versions), so an
unknown DeepSpeed fails loudly instead of half-working. Three ZeRO-1/2 layers outside this
package also call the optimizer's private methods and fields: ``grad_accumulation`` (the
epilogue and reduced partitions, probed with ``require`` there), ``micro_step_window``
(the epilogue, probed by ``grad_window``) and ``zero12_bucket_fill`` (the IPG bucket path,
probed by ``zero12_buckets``); each runs those probes first, in its constructor.
"""

from .errors import SUPPORTED_DEEPSPEED_VERSIONS, UnsupportedDeepSpeedError

__all__ = ["SUPPORTED_DEEPSPEED_VERSIONS", "UnsupportedDeepSpeedError"]
