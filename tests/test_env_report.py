"""python -m zero_lifetime.env_report: never raises, says which core and kernels run."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("force_python", [False, True])
def test_env_report(force_python):
    env = dict(os.environ)
    env.pop("ZERO_LIFETIME_FORCE_PYTHON", None)
    if force_python:
        env["ZERO_LIFETIME_FORCE_PYTHON"] = "1"
    done = subprocess.run([sys.executable, "-m", "zero_lifetime.env_report"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(":", 1) for line in done.stdout.splitlines() if " : " in line)
    lines = {k.strip(): v.strip() for k, v in lines.items()}
    from importlib.metadata import version
    from zero_lifetime.adapters import SUPPORTED_DEEPSPEED_VERSIONS
    assert lines["deepspeed"] == version("deepspeed") and lines["deepspeed"] in SUPPORTED_DEEPSPEED_VERSIONS
    if force_python:
        assert lines["tracker impl"].startswith("python")
        assert lines["fused ops"].startswith("pure-torch reference")
    else:
        assert lines["tracker impl"].startswith("compiled")
        assert "CPU" in lines["fused ops"] and "Meta" in lines["fused ops"], lines["fused ops"]
    assert lines["cuda initialized"] == "False"
