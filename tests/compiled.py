"""The compiled extension, for the tests that exercise it directly.

They skip, saying why, where it cannot be loaded. A broken build still fails the suite:
test_env_report requires the compiled tracker and ops outside ZERO_LIFETIME_FORCE_PYTHON=1.
Both load at run time, never at collection (which would build the extension).
"""

import pytest

from zero_lifetime import _native


def compiled_module_or_skip():
    """The loaded module, also under ZERO_LIFETIME_FORCE_PYTHON=1 (which only steers the library)."""
    module = _native.load()
    if module is None:
        pytest.skip(f"compiled extension unavailable: {_native.status()['error']}")
    return module


def compiled_ops_or_skip():
    """The loaded module, where zero_lifetime.ops runs on it (not under ZERO_LIFETIME_FORCE_PYTHON=1)."""
    if _native.force_python():
        pytest.skip("ZERO_LIFETIME_FORCE_PYTHON=1: the ops run the pure-torch reference")
    return compiled_module_or_skip()
