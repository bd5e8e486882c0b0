"""The raw JSON config a DeepSpeed engine was built from (DeepSpeed 0.19.8 and 0.17.6 alike)."""

from .errors import require


def raw_config(engine) -> dict:
    """The user's config dict, whether it was passed as a dict, a path or a JSON string."""
    config = require(engine, "_config", "the engine's parsed config")
    params = require(config, "_param_dict", "the raw config dict")
    return params if isinstance(params, dict) else {}
