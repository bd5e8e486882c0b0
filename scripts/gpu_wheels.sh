#!/usr/bin/env bash
# Fill ./.whl (git-ignored) with what the lent GPU machine lacks and cannot fetch (it has no
# network and no DeepSpeed): a wheel of DeepSpeed 0.19.8, which PyPI ships only as an sdist
# (built here, needs torch installed: run scripts/setup_env.sh first), and the pure-Python
# packages DeepSpeed needs that the machine's image lacks, for its Python 3.12.
# Then name ".whl" in the device call's carry and run `bash scripts/gpu_check.sh setup ...`.
# The versions are those this project's suite runs with here.
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=.whl
mkdir -p "$WHL"
python3 -m pip wheel -q --no-deps --no-build-isolation "deepspeed==0.19.8" -w "$WHL"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHL" hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
# gpu_check.sh installs every wheel here: two versions of one package would stop that install.
dups=$(ls "$WHL"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[[ -z "$dups" ]] || { echo "gpu_wheels: more than one wheel of: $dups (remove the older from $WHL)" >&2; exit 1; }
ls -l "$WHL"
