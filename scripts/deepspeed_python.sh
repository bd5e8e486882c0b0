# Sourced by setup_env.sh and test.sh: picks the Python for the DeepSpeed release in ZL_DEEPSPEED.
#   ZL_DEEPSPEED=0.19.8 (default): python3 (or $PYTHON) and its own site-packages.
#   ZL_DEEPSPEED=0.18.9 / 0.17.6: a venv of its own ($ZL_VENV, default .venv-ds0189 /
#   .venv-ds0176), so the releases never share (and fight over) one site-packages.
ZL_DEEPSPEED=${ZL_DEEPSPEED:-0.19.8}
case "$ZL_DEEPSPEED" in
  0.19.8) PY=${PYTHON:-python3} ;;
  0.18.9) PY=${ZL_VENV:-.venv-ds0189}/bin/python ;;
  0.17.6) PY=${ZL_VENV:-.venv-ds0176}/bin/python ;;
  *) echo "ZL_DEEPSPEED=$ZL_DEEPSPEED is not supported: use 0.19.8 (default), 0.18.9 or 0.17.6" >&2; exit 2 ;;
esac
export ZL_DEEPSPEED
