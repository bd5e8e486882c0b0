#!/usr/bin/env bash
# The main job on a fresh machine: set up, then show the ZeRO-3 retain_graph fix (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
python3 -m zero_lifetime.env_report
python3 -m zero_lifetime.demo
