"""Whether an engine runs ZeRO through DeepCompile (DeepSpeed 0.17.6, 0.18.9, 0.19.8 alike).

DeepCompile (``"compile": {"deepcompile": true}``, then ``engine.compile()``) removes the
engine's forward hooks and moves ZeRO's gathers, releases and gradient reductions into passes
of the compiled graph. zero_lifetime works through the hooks, buckets and gathers it replaces,
so it refuses such an engine rather than patch code that no longer runs. A plain
``engine.compile()`` keeps ZeRO's hooks: that is supported (tests/test_compile.py).
"""

from .errors import UnsupportedDeepSpeedError, require


def require_no_deepcompile(engine) -> None:
    """Raise UnsupportedDeepSpeedError when the engine's config turns DeepCompile on (checked
    at install, whether or not ``engine.compile()`` has run yet: the config decides)."""
    if not require(engine, "is_deepcompile_enabled", "the DeepCompile switch")():
        return
    raise UnsupportedDeepSpeedError(
        "zero_lifetime cannot be installed on this engine: its config turns DeepCompile on "
        '("compile": {"deepcompile": true}), which replaces the ZeRO hooks, gradient buckets and '
        "gathers zero_lifetime works through with passes inside the compiled graph. To use "
        "zero_lifetime, drop \"deepcompile\" (engine.compile() without it is supported). Pass "
        "strict=False to install() to continue without zero_lifetime (a warning, and nothing is "
        "patched).")
