#!/usr/bin/env bash
# GPU validation, for a machine with an NVIDIA GPU and a CUDA torch (not part of CI,
# which has no GPU). Phases, in the order given on the command line:
#   setup     install carried wheels (./.whl, made here by scripts/gpu_wheels.sh: DeepSpeed and its deps),
#             build zero_lifetime._C with the CUDA kernels in place
#   tests_cuda  only what runs on the GPU: the CUDA op tests and fuzz, the CUDA engine
#             scenarios, each kernel path once (minutes; CI runs everything else)
#   tests     the whole test suite (CUDA op tests, CUDA fuzz, CUDA engine scenarios included)
#   sanitize  the CUDA kernels under compute-sanitizer: each kernel path once under memcheck,
#             racecheck, initcheck and synccheck, then the CUDA op tests under memcheck
#   bench     python -m zero_lifetime.bench all --device cuda, the kernel bench, and where
#             the time of one fused-op call goes (benchmarks/profile_ops.py)
# Logs, JSON and plots go to $OUT (default ./gpu-out).
# Example: bash scripts/gpu_check.sh setup tests sanitize bench
# Within 10-minute device calls: `setup tests_cuda sanitize`, then `setup bench` (a later
# call may find a fresh machine), then `setup tests` if device time is left.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # the lent machines are Hopper; one arch builds fastest
[ -d /tmp/zl-site ] && export PYTHONPATH=/tmp/zl-site${PYTHONPATH:+:$PYTHONPATH}
status=0

run() {  # run NAME CMD...: log to $OUT/NAME.log, remember a failure, go on with the next phase
  local name=$1; shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - start)) s"; tail -n 25 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}

for phase in "$@"; do
  case $phase in
    setup)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zl-site .whl/*.whl || exit 1
        export PYTHONPATH=/tmp/zl-site${PYTHONPATH:+:$PYTHONPATH}
      fi
      run build python3 setup.py build_ext --inplace
      run env_report python3 -m zero_lifetime.env_report
      ;;
    tests_cuda)
      run kernel_paths python3 tests/kernel_paths.py --device cuda
      run pytest_cuda python3 -m pytest tests/test_ops.py tests/test_ops_fuzz.py tests/test_native_link.py \
        tests/test_cuda_engine.py -k cuda -q -p no:cacheprovider -rs -s --durations=10
      ;;
    tests)
      run pytest python3 -m pytest tests -q -p no:cacheprovider -rs -s --durations=15
      ;;
    sanitize)
      # No caching allocator: every tensor is its own allocation, so memcheck sees an
      # overrun past a tensor's end instead of into a neighbour inside a cached block.
      # First each kernel path once (tests/kernel_paths.py, seconds) under every tool:
      # racecheck looks at shared memory only, which these kernels do not use, so a clean
      # run says just that; initcheck and synccheck cover reads of unwritten memory and
      # barriers. Then memcheck over the op tests and the CUDA fuzz (minutes).
      for tool in memcheck racecheck initcheck synccheck; do
        run "sanitize_paths_$tool" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer \
          --tool "$tool" --error-exitcode 99 python3 tests/kernel_paths.py --device cuda
      done
      run sanitize_memcheck_tests env PYTORCH_NO_CUDA_MEMORY_CACHING=1 ZL_FUZZ_CASES=150 timeout 400 \
        compute-sanitizer --tool memcheck --error-exitcode 99 python3 -m pytest tests/test_ops.py \
        tests/test_ops_fuzz.py -k cuda -q -p no:cacheprovider
      ;;
    bench)
      run bench python3 -m zero_lifetime.bench all --device cuda --repeats 15 --json "$OUT/bench_cuda.json" \
        --plot "$OUT/bench_cuda.png"
      run bench_kernels python3 -m zero_lifetime.bench.kernels --device cuda --json "$OUT/kernels_cuda.json"
      run profile_ops python3 benchmarks/profile_ops.py --device cuda --json "$OUT/profile_cuda.json"
      # The host's share of install's step overhead (saved-tensor hooks, per-step walks) on this machine's CPU.
      run step_host_cost python3 benchmarks/step_host_cost.py --rounds 60
      ;;
    *) echo "unknown phase: $phase (setup, tests_cuda, tests, sanitize, bench)"; exit 2 ;;
  esac
done
exit $status
