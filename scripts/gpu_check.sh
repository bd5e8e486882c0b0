#!/usr/bin/env bash
# GPU validation, for a machine with an NVIDIA GPU and a CUDA torch (not part of CI,
# which has no GPU). Phases, in the order given on the command line (earlier = more important:
# phases the deadline leaves no time for are skipped and reported as such):
#   setup     install carried wheels (./.whl, made here by scripts/gpu_wheels.sh: DeepSpeed and its deps),
#             build zero_lifetime._C with the CUDA kernels in place
#   bench     python -m zero_lifetime.bench all --device cuda (issue 4's GPU figures), then the
#             kernel bench, where the time of one fused-op call goes (benchmarks/profile_ops.py,
#             with the cudaMemcpyAsync route beside the kernel for few large segments)
#             and the host's share of install's step overhead
#   route     after bench: from profile_ops' kernel-vs-memcpy comparison, the segment size from
#             which the cudaMemcpyAsync route won every case (zero_lifetime.bench.memcpy_route);
#             if there is one, bench bucket and bench gather again with the route on from that
#             size, so one call brings back both answers (a second call would start a fresh machine)
#   tests_cuda  only what runs on the GPU: each kernel path once, the CUDA op tests and fuzz,
#             the CUDA engine scenarios, bench's route option (CI runs everything else)
#   sanitize  the CUDA kernels under compute-sanitizer: each kernel path once under memcheck,
#             racecheck, initcheck and synccheck (about 20 s)
#   sanitize_tests  the CUDA op tests and a short fuzz under memcheck: longer than one call
#             leaves after the phases above (on an H200, 22 tests in 150 s), so a call of its own
#   tests     the whole test suite (CUDA op tests, CUDA fuzz, CUDA engine scenarios included)
#
# One lent device call (15 minutes of device time a session, 10 a command), correctness first:
#   bash scripts/gpu_check.sh setup tests_cuda bench route sanitize      (timeout_s 600, carry .whl)
# and, if the session's time allows, at once on the warm machine (the build is kept there; a
# machine idle for 30 s is given back, and a fresh one costs minutes of the session's time):
#   bash scripts/gpu_check.sh sanitize sanitize_tests                    (timeout_s 600)
# (the first call's sanitize runs only if its deadline leaves time: the H200 run of 2026-11-27
# took 526 s for setup, bench, tests_cuda and sanitize without profile_ops, which adds ~60 s).
# The run stops starting work ZL_GPU_DEADLINE_S seconds after it began (default 540), and caps
# each command at what is left, so it ends inside the call with every log packed.
# The device tool returns at most 8 files from $OUT: the logs, JSON and plots go to
# $OUT/gpu_check/ and are packed into $OUT/gpu_check.tar.gz at exit; $OUT/summary.log holds
# each command's status, time and log tail as it ran. $OUT defaults to ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
WORK="$OUT/gpu_check"
mkdir -p "$WORK"
DEADLINE=$((SECONDS + ${ZL_GPU_DEADLINE_S:-540}))
PACK_RESERVE_S=15  # kept back from the deadline for packing the logs
say() { tee -a "$OUT/summary.log"; }  # stdin to the terminal and to the summary
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # the lent machines are Hopper; one arch builds fastest
# The repo root on the path: scripts run as `python3 tests/x.py` see only their own folder,
# and the device machine has no editable install of this package.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d /tmp/zl-site ] && export PYTHONPATH=/tmp/zl-site:$PYTHONPATH
status=0

pack() {
  tar czf "$OUT/gpu_check.tar.gz" -C "$OUT" gpu_check && rm -rf "$WORK"
  echo "== logs, JSON and plots: $OUT/gpu_check.tar.gz; exit status $status" | say
}
trap pack EXIT

run() {  # run NAME CAP_S CMD...: at most CAP_S seconds (less if the deadline is nearer), log to $WORK/NAME.log
  local name=$1 cap=$2; shift 2
  local left=$((DEADLINE - SECONDS - PACK_RESERVE_S))
  if ((left < 10)); then
    echo "== $name: SKIPPED, ${left}s left before the deadline" | say
    status=1
    return
  fi
  ((cap > left)) && cap=$left
  echo "== $name (at most ${cap}s): $*" | say
  local start=$SECONDS
  timeout --kill-after=5 "$cap" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  local verdict="rc $rc"
  ((rc == 124 || rc == 137)) && verdict="rc $rc: CUT at ${cap}s"
  { echo "== $name: $verdict in $((SECONDS - start)) s"; tail -n 25 "$WORK/$name.log" | sed -e '$a\'; } | say
  [ $rc -eq 0 ] || status=1
}

for phase in "$@"; do
  case $phase in
    setup)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | say
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/zl-site .whl/*.whl \
          || { echo "== setup: the carried wheels did not install" | say; status=1; exit 1; }
        # Already first on the path when an earlier call left the wheels installed (see the top).
        case ":$PYTHONPATH:" in *:/tmp/zl-site:*) ;; *) export PYTHONPATH=/tmp/zl-site${PYTHONPATH:+:$PYTHONPATH} ;; esac
      fi
      run build 300 python3 setup.py build_ext --inplace
      run env_report 60 python3 -m zero_lifetime.env_report
      ;;
    bench)
      run bench 240 python3 -m zero_lifetime.bench all --device cuda --repeats "${ZL_BENCH_REPEATS:-10}" \
        --json "$WORK/bench_cuda.json" --plot "$WORK/bench_cuda.png"
      run bench_kernels 90 python3 -m zero_lifetime.bench.kernels --device cuda --json "$WORK/kernels_cuda.json"
      run profile_ops 60 python3 benchmarks/profile_ops.py --device cuda --json "$WORK/profile_cuda.json"
      run step_host_cost 60 python3 benchmarks/step_host_cost.py --rounds 60
      ;;
    route)
      if [ ! -f "$WORK/profile_cuda.json" ]; then
        echo "== route: SKIPPED, no $WORK/profile_cuda.json (the bench phase makes it)" | say
        status=1
        continue
      fi
      run route_choice 30 python3 -m zero_lifetime.bench.memcpy_route "$WORK/profile_cuda.json"
      route_bytes=$(tail -n 1 "$WORK/route_choice.log")
      case $route_bytes in
        never) echo "== route: the kernel won a case with the largest segments; nothing more to run" | say ;;
        ''|*[!0-9]*) echo "== route: no threshold read from route_choice.log" | say; status=1 ;;
        *)
          for bench in bucket gather; do
            run "bench_route_$bench" 120 python3 -m zero_lifetime.bench "$bench" --device cuda \
              --cuda-memcpy-segment-bytes "$route_bytes" --repeats "${ZL_BENCH_REPEATS:-10}" \
              --json "$WORK/bench_route_${bench}_cuda.json"
          done
          ;;
      esac
      ;;
    tests_cuda)
      run kernel_paths 60 python3 tests/kernel_paths.py --device cuda
      run pytest_cuda 240 python3 -m pytest tests/test_ops.py tests/test_ops_fuzz.py tests/test_repoint.py tests/test_native_link.py \
        tests/test_cuda_engine.py tests/test_bench_cli.py -k cuda -q -p no:cacheprovider -rs -s --durations=10
      ;;
    sanitize)
      # No caching allocator: every tensor is its own allocation, so memcheck sees an
      # overrun past a tensor's end instead of into a neighbour inside a cached block.
      # First each kernel path once (tests/kernel_paths.py, seconds) under every tool:
      # racecheck looks at shared memory only, which these kernels do not use, so a clean
      # run says just that; initcheck and synccheck cover reads of unwritten memory and
      # barriers.
      for tool in memcheck racecheck initcheck synccheck; do
        run "sanitize_paths_$tool" 150 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer \
          --tool "$tool" --error-exitcode 99 python3 tests/kernel_paths.py --device cuda
      done
      ;;
    sanitize_tests)
      # 300 instead of 3000 tensors in the many-tensors test: still a table launch, and its
      # sources are made by 10x fewer launches, each slow under the sanitizer.
      run sanitize_memcheck_tests 540 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 ZL_FUZZ_CASES=40 ZL_MANY_TENSORS=300 \
        compute-sanitizer --tool memcheck --error-exitcode 99 python3 -m pytest tests/test_ops.py \
        tests/test_ops_fuzz.py -k cuda -q -p no:cacheprovider --durations=20
      ;;
    tests)
      run pytest 540 python3 -m pytest tests -q -p no:cacheprovider -rs -s --durations=15
      ;;
    *) echo "unknown phase: $phase (setup, bench, route, tests_cuda, sanitize, sanitize_tests, tests)" | say; status=2; exit 2 ;;
  esac
done
exit $status
