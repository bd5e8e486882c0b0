"""install() options, from the DeepSpeed JSON config's "zero_lifetime" section.

    {"zero_optimization": {...}, "zero_lifetime": {"policy": "pin", "max_pinned_bytes": 2e9}}

Keyword arguments of install() override the section; unknown keys are an error that
names them, so a typo never silently leaves a default in place.
"""

from typing import Any, Dict, Optional

SECTION = "zero_lifetime"
POLICIES = ("regather", "pin")
DEFAULTS: Dict[str, Any] = {"policy": "regather", "max_pinned_bytes": -1, "strict": True, "check_bucket_order": True}


def _validate(options: Dict[str, Any], where: str) -> None:
    policy = options["policy"]
    if policy not in POLICIES:
        raise ValueError(f"{where}policy must be one of {POLICIES}, got {policy!r}")
    budget = options["max_pinned_bytes"]
    if isinstance(budget, float) and budget.is_integer():  # JSON writes 2e9 as a float
        budget = options["max_pinned_bytes"] = int(budget)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < -1:
        raise ValueError(f"{where}max_pinned_bytes must be an int >= 0, or -1 for no limit; got {budget!r}")
    for flag in ("strict", "check_bucket_order"):
        if not isinstance(options[flag], bool):
            raise ValueError(f"{where}{flag} must be true or false, got {options[flag]!r}")


def section_of(raw_config: dict) -> Dict[str, Any]:
    section = raw_config.get(SECTION, {})
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ValueError(f'the DeepSpeed config\'s "{SECTION}" section must be an object, got {section!r}')
    unknown = sorted(set(section) - set(DEFAULTS))
    if unknown:
        raise ValueError(f'unknown key(s) {unknown} in the DeepSpeed config\'s "{SECTION}" section; '
                         f"known keys: {sorted(DEFAULTS)}")
    return dict(section)


def resolve(raw_config: Optional[dict], **overrides) -> Dict[str, Any]:
    """Defaults, then the config section, then the keyword arguments that were given."""
    options = dict(DEFAULTS)
    from_config = section_of(raw_config or {})
    options.update(from_config)
    if from_config:
        _validate(options, f'"{SECTION}" config section: ')
    options.update({k: v for k, v in overrides.items() if v is not None})
    _validate(options, "")
    return options
