"""A DeepSpeed engine's gradient accumulation boundary, when its caller sets it by hand.

``engine.set_gradient_accumulation_boundary(flag)`` (public) overrides DeepSpeed's own count of
micro steps until it is set again; accelerate sets it inside its ``backward()`` from its own
``sync_gradients``. Whether that override is in force is private: ``_is_gradient_accumulation_boundary``
(None until set), the same name in 0.17.6, 0.18.9 and 0.19.8.
"""

from .errors import require


def boundary_set_by_hand(engine) -> bool:
    """True once set_gradient_accumulation_boundary() has been called on ``engine``."""
    return require(engine, "_is_gradient_accumulation_boundary", "the hand-set accumulation boundary") is not None
