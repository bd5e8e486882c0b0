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
ENGINE_TESTS=(tests/test_retain_graph.py tests/test_install_api.py tests/test_grad_hooks.py
  tests/test_micro_step_window.py tests/test_zero12_bucket_fill.py tests/test_zero3_fused.py
  tests/test_two_ranks.py tests/test_faults.py tests/test_soak.py tests/test_hf_trainer.py
  tests/test_config_section.py tests/test_reporting.py tests/test_env_report.py tests/test_launchers.py
  tests/test_unreached_params.py tests/test_several_forwards.py tests/test_fp16_loss_scale.py
  tests/test_adapter_boundary.py tests/test_gan.py tests/test_compile.py tests/test_stale_graph.py
  tests/test_lifetime_programs.py tests/test_bench_cli.py tests/test_zero3_leaf_modules.py
  tests/test_gathered_parameters.py tests/test_user_patterns.py tests/test_chained_engines.py)
ZL_DEEPSPEED=$release exec bash scripts/test.sh "${ENGINE_TESTS[@]}" "$@"
