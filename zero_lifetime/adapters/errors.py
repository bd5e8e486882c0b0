"""Version errors shared by the adapters."""

SUPPORTED_DEEPSPEED_VERSIONS = ("0.19.8", )


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed lacks an internal name zero_lifetime relies on."""


def require(obj, name: str, what: str):
    """Return ``getattr(obj, name)`` or raise a version error that says what is missing."""
    try:
        return getattr(obj, name)
    except AttributeError:
        import deepspeed
        raise UnsupportedDeepSpeedError(
            f"zero_lifetime does not recognise DeepSpeed {deepspeed.__version__}: {what} "
            f"(`{type(obj).__name__}.{name}`) is missing. Supported DeepSpeed versions: "
            f"{', '.join(SUPPORTED_DEEPSPEED_VERSIONS)}. Pass strict=False to install() to "
            f"continue without zero_lifetime (a warning, and nothing is patched).") from None
