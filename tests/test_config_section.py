"""install() options from the DeepSpeed JSON config's "zero_lifetime" section."""

import json

import pytest

import deepspeed
import zero_lifetime
from harness import MODELS, ds_config, losses, make_input


def _engine(section=None, stage=3, as_file=None):
    model = MODELS["mlp_norm"]()
    cfg = ds_config(stage)
    if section is not None:
        cfg["zero_lifetime"] = section
    if as_file is not None:
        as_file.write_text(json.dumps(cfg))
        cfg = str(as_file)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def test_section_sets_the_options(tmp_path):
    # From a JSON file, as the deepspeed launcher passes it; 2e9 arrives as a float.
    engine = _engine({"policy": "pin", "max_pinned_bytes": 2e9}, as_file=tmp_path / "ds.json")
    installation = zero_lifetime.install(engine)
    assert (installation.policy, installation.max_pinned_bytes) == ("pin", 2_000_000_000)
    # The options are live: a retained two-loss backward pins under "pin".
    l1, l2 = losses(engine(make_input("mlp_norm", 0)))
    engine.backward(l1, retain_graph=True)
    engine.backward(l2)
    engine.step()
    assert zero_lifetime.stats(engine)["peak_pinned_bytes"] > 0


def test_keyword_arguments_override_the_section():
    engine = _engine({"policy": "pin", "max_pinned_bytes": 1024})
    installation = zero_lifetime.install(engine, policy="regather")
    assert (installation.policy, installation.max_pinned_bytes) == ("regather", 1024)


def test_no_section_gives_the_defaults():
    installation = zero_lifetime.install(_engine())
    assert (installation.policy, installation.max_pinned_bytes) == ("regather", -1)


def test_unknown_keys_are_named():
    engine = _engine({"policy": "pin", "max_pined_bytes": 5, "stric": True})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_pined_bytes', 'stric'\].*known keys"):
        zero_lifetime.install(engine)
    assert "forward" not in engine.__dict__  # nothing installed


@pytest.mark.parametrize("section,match", [
    ({"policy": "keep"}, r'"zero_lifetime" config section: policy must be one of'),
    ({"max_pinned_bytes": -5}, r'"zero_lifetime" config section: max_pinned_bytes must be'),
    ({"strict": "yes"}, r'"zero_lifetime" config section: strict must be true or false'),
    ({"check_bucket_order": 1}, r'"zero_lifetime" config section: check_bucket_order must be true or false'),
    ("pin", r'"zero_lifetime" section must be an object'),
])
def test_bad_values_say_where_they_come_from(section, match):
    with pytest.raises(ValueError, match=match):
        zero_lifetime.install(_engine(section))


def test_bucket_order_check_is_off_on_one_rank_and_can_be_turned_off():
    """On one rank there is nothing to compare: no check, no collective per backward."""
    assert zero_lifetime.install(_engine(stage=2)).bucket_fill.order_check is None
    installation = zero_lifetime.install(_engine({"check_bucket_order": False}, stage=2))
    assert installation.bucket_fill.order_check is None
    with pytest.raises(ValueError, match="check_bucket_order must be true or false"):
        zero_lifetime.install(_engine(stage=2), check_bucket_order="no")
