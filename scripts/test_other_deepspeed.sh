#!/usr/bin/env bash
# The engine tests (every test that builds a DeepSpeed engine) against another supported
# DeepSpeed release, in its own venv (made on first use):
#   bash scripts/test_other_deepspeed.sh 0.18.9 [pytest arguments]
#   bash scripts/test_other_deepspeed.sh 0.17.6 [pytest arguments]
# The DeepSpeed-independent tests (ops, tracker, native) run once, under scripts/test.sh; the
# bench's CLI tests run on every release, since its stock baselines are DeepSpeed's own methods.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: $0 0.18.9|0.17.6 [pytest arguments]" >&2
  exit 2
fi
release=$1
shift
# Every test file but these DeepSpeed-independent ones (so a new engine test runs here unasked):
INDEPENDENT=(test_ops.py test_ops_fuzz.py test_tracker.py test_native_link.py test_cpu_buffer_cache.py
  test_bench_compare.py test_single_rank.py test_jit_lock.py test_repoint.py test_demo.py
  test_gpu_check_script.py test_cuda_engine.py)
ENGINE_TESTS=()
for test_file in tests/test_*.py; do
  case " ${INDEPENDENT[*]} " in *" $(basename "$test_file") "*) ;; *) ENGINE_TESTS+=("$test_file") ;; esac
done
ZL_DEEPSPEED=$release exec bash scripts/test.sh "${ENGINE_TESTS[@]}" "$@"
