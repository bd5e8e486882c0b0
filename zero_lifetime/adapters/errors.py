"""Version errors shared by the adapters."""

SUPPORTED_DEEPSPEED_VERSIONS = ("0.17.6", "0.18.9", "0.19.8")


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed lacks an internal name zero_lifetime relies on."""


def deepspeed_version() -> str:
    import deepspeed
    # Source builds append a local part ("0.17.6+abc123"): the release is what matters.
    return deepspeed.__version__.split("+")[0]


def require_supported_version() -> str:
    """The installed DeepSpeed release, or a version error when it is not one we tested.

    The adapters pick their code path by probing names; this check keeps a release nobody
    ran the suite on from passing the probes by chance and half-working.
    """
    version = deepspeed_version()
    if version not in SUPPORTED_DEEPSPEED_VERSIONS:
        raise UnsupportedDeepSpeedError(
            f"zero_lifetime does not support DeepSpeed {version}. Supported DeepSpeed versions: "
            f"{', '.join(SUPPORTED_DEEPSPEED_VERSIONS)}. Pass strict=False to install() to continue "
            f"without zero_lifetime (a warning, and nothing is patched).")
    return version


def unsupported_feature(feature: str, why: str):
    """A version error for a configuration the installed DeepSpeed cannot support."""
    return UnsupportedDeepSpeedError(
        f"zero_lifetime cannot support {feature} on DeepSpeed {deepspeed_version()}: {why}. "
        f"Supported DeepSpeed versions: {', '.join(SUPPORTED_DEEPSPEED_VERSIONS)}.")


def unrecognised(what: str) -> UnsupportedDeepSpeedError:
    """A version error for an internal of the installed DeepSpeed that is not as expected."""
    return UnsupportedDeepSpeedError(
        f"zero_lifetime does not recognise DeepSpeed {deepspeed_version()}: {what}. Supported DeepSpeed "
        f"versions: {', '.join(SUPPORTED_DEEPSPEED_VERSIONS)}. Pass strict=False to install() to "
        f"continue without zero_lifetime (a warning, and nothing is patched).")


def require(obj, name: str, what: str):
    """Return ``getattr(obj, name)`` or raise a version error that says what is missing."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise unrecognised(f"{what} (`{type(obj).__name__}.{name}`) is missing") from None
