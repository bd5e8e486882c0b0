"""Choose the tracker implementation: the compiled core, else the pure-Python one."""

import os


def make_tracker(policy: str, max_pinned_bytes: int):
    if os.environ.get("ZERO_LIFETIME_FORCE_PYTHON") != "1":
        try:
            from . import _native
            module = _native.load()
        except ImportError:
            module = None
        if module is not None:
            return module.Tracker(policy, max_pinned_bytes)
    from .tracker_py import Tracker
    return Tracker(policy, max_pinned_bytes)
