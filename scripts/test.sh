#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, native C++ tests under CTest, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source scripts/deepspeed_python.sh  # ZL_DEEPSPEED: 0.19.8 (default), 0.18.9 or 0.17.6
export DS_ACCELERATOR=cpu
if [ "$ZL_DEEPSPEED" != 0.19.8 ]; then
  # Another DeepSpeed release: the pytest suite only (or the tests given); the native and
  # CUDA build checks below do not depend on DeepSpeed and run with the default.
  # DeepSpeed JIT-builds its CPU comm op under one name for every release: a cache of its
  # own keeps this run from loading (or rebuilding under) another release's build.
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}/deepspeed-$ZL_DEEPSPEED"
  exec "$PY" -m pytest -q -p no:cacheprovider "${@:-tests}"
fi
# The C++ core's native tests: plain, under AddressSanitizer+UBSan, and under
# ThreadSanitizer (its multi-threaded refcount stress test is the point of that one).
# The CUDA kernels' device code also runs there, emulated on the CPU (no GPU in CI).
for variant in native:"" asan:"address,undefined" tsan:"thread"; do
  dir=build/${variant%%:*}
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DZL_SANITIZE="${variant#*:}" \
    -DZL_KERNEL_EMULATION=ON -DPython3_EXECUTABLE="$(command -v python3)" >/dev/null
  cmake --build "$dir"
  ctest --test-dir "$dir" --output-on-failure
done
ZL_REQUIRE_CUDA_BUILD=${ZL_REQUIRE_CUDA_BUILD:-1} bash scripts/check_cuda_build.sh  # CUDA build break fails CI, no GPU needed
python3 -m pytest tests -q -p no:cacheprovider "$@"
if [ $# -eq 0 ]; then
  # Where the extension cannot be built, the pure-Python tracker and the pure-torch ops take
  # over and must train alike, and keep nothing per step (the pure-Python tracker's records
  # are Python objects): the engine tests again with them forced (about 3.5 min).
  ZERO_LIFETIME_FORCE_PYTHON=1 python3 -m pytest -q -p no:cacheprovider tests/test_retain_graph.py \
    tests/test_zero12_bucket_fill.py tests/test_two_ranks.py tests/test_faults.py tests/test_steady_state.py
fi
