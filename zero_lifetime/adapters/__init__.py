"""DeepSpeed's private names: one module per concern, each probing its names at install.

A missing name raises UnsupportedDeepSpeedError (naming the supported versions), so an
unknown DeepSpeed fails loudly instead of half-working. The runtime layers outside this
package reach DeepSpeed's optimizers, IPG buckets, gather handles and coordinator only
through these modules (``tests/test_adapter_boundary.py`` checks it). Two exceptions:
ZeRO-3 params' ``ds_*`` attributes, which the tracker's hot path reads directly, and
``zero_lifetime.bench``, whose stock baselines call DeepSpeed's own methods by name (its
CLI refuses a DeepSpeed outside the supported versions before running anything).
Wrappers of DeepSpeed methods go through ``patching``, so stacked wrappers unwind exactly
(``Zero3Buckets.override`` replaces two methods outright and restores the class's).
"""

from .errors import SUPPORTED_DEEPSPEED_VERSIONS, UnsupportedDeepSpeedError

__all__ = ["SUPPORTED_DEEPSPEED_VERSIONS", "UnsupportedDeepSpeedError"]
