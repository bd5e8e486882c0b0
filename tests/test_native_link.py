"""The compiled extension uses the process's C++ runtime, and its errors are catchable.

Found on the lent GPU machine: its gcc wrapper linked libstdc++.a into the extension,
and the first TORCH_CHECK message with a number in it segfaulted inside that private
copy's iostreams (the fuzz tests' invalid cases). _native links libstdc++.so.6 by name.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from compiled import compiled_module_or_skip
from zero_lifetime import _native


def _compiled_so():
    return compiled_module_or_skip().__file__


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_extension_does_not_carry_its_own_libstdcxx():
    symbols = subprocess.run(["nm", "-D", "--defined-only", _compiled_so()], capture_output=True, text=True,
                             check=True).stdout
    private = [line for line in symbols.splitlines() if "_ZNSt6locale" in line or "codecvt" in line]
    assert not private, f"libstdc++ linked statically into the extension ({len(private)} symbols), e.g. {private[:3]}"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_error_messages_with_numbers_do_not_crash(device):
    _compiled_so()
    # In a child: a crash must fail this test, not kill the test run.
    code = ("import torch\nfrom zero_lifetime import ops\n"
            f"b = torch.zeros(4, device='{device}')\n"
            "for call in (lambda: ops.bucket_fill(b, [torch.ones(3, device=b.device)], [2]),\n"
            "             lambda: torch.ops.zero_lifetime.gather_copy_out(b, b[:2].clone(), [1], [3], 2)):\n"
            "    try:\n        call()\n    except RuntimeError as e:\n        print('caught:', str(e).splitlines()[0])\n"
            "print('compiled ops:', ops.native_available())\n")
    # The compiled ops' messages: the child loads them also in a run that forces the Python fallback.
    env = dict(os.environ, **{_native.FORCE_PYTHON_ENV: ""})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
    caught = [line for line in done.stdout.splitlines() if line.startswith("caught:")]
    assert len(caught) == 2 and "out of bounds" in caught[0], done.stdout
    assert "compiled ops: True" in done.stdout, done.stdout  # the messages were the compiled ops' own
