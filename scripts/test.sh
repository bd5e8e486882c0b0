#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, native C++ tests under CTest, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export DS_ACCELERATOR=cpu
cmake -S . -B build/native -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/native
ctest --test-dir build/native --output-on-failure
python3 -m pytest tests -q -p no:cacheprovider "$@"
