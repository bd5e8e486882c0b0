"""Make a tracker: the compiled core when it builds, else the pure-Python one (one warning)."""


def make_tracker(policy: str, max_pinned_bytes: int):
    from ._native import get_tracker_impl
    return get_tracker_impl()(policy, max_pinned_bytes)
