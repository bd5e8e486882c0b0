#!/usr/bin/env bash
# Install everything zero_lifetime needs on a fresh CPU machine, then build and install it.
# Idempotent: already-satisfied pins install nothing.
# ZL_DEEPSPEED=0.18.9 or 0.17.6 sets up that DeepSpeed in its own venv instead (scripts/deepspeed_python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deepspeed_python.sh
if [ "$ZL_DEEPSPEED" != 0.19.8 ] && [ ! -x "$PY" ]; then
  python3 -m venv "$(dirname "$(dirname "$PY")")"
fi
# torch first and pinned: an unpinned torch (or one pulled in by deepspeed) would
# fetch a multi-GB CUDA build; 2.13.0 is the CPU build this project supports.
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q "deepspeed==$ZL_DEEPSPEED" "pybind11>=2.12" ninja "pytest>=8" matplotlib  # matplotlib: bench --plot
# The Hugging Face Trainer integration and its tests (tiny models built from configs, no downloads).
"$PY" -m pip install -q "transformers==5.24.0" "accelerate==1.15.0"
# TRL for tests/test_trl.py and the two-rank generation scenarios.
"$PY" -m pip install -q "trl==1.16.0"
# PEFT for tests/test_peft.py (LoRA adapters over a frozen base).
"$PY" -m pip install -q "peft==0.21.2"
# Builds the C++ core ahead of time (zero_lifetime._C) against the installed torch.
"$PY" -m pip install -q --no-build-isolation -e .
# A JIT build killed half-way leaves torch's lock behind, and every later build of that
# extension waits on it for ever: DeepSpeed's CPU comm op is built by every engine here.
"$PY" -m zero_lifetime.clear_jit_locks
