"""``python -m zero_lifetime.clear_jit_locks``: remove the torch JIT build locks a killed build
left behind (``--check``: list them only). See :mod:`zero_lifetime.jit_locks`.

A module of its own: ``import zero_lifetime`` imports ``jit_locks`` (to warn), and running a
module the package already imported makes runpy warn of "unpredictable behaviour"."""

import sys

from zero_lifetime.jit_locks import main

if __name__ == "__main__":
    sys.exit(main())
