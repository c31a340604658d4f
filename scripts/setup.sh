#!/usr/bin/env bash
# Creates the virtual environment (.venv, or $FASTALIGN_VENV) and installs fastalign with its dev tools
# at the exact versions of requirements/constraints.txt (or $FASTALIGN_CONSTRAINTS, with the extras
# $FASTALIGN_EXTRAS instead of dev: scripts/setup_lowest.sh). Idempotent: a second run with nothing
# changed returns at once.
#
# PyTorch: on a machine without an NVIDIA GPU the CPU build is wanted. `pip install torch==X` gives it
# where a CPU wheel is what the configured index serves (as on our CI machines); elsewhere point
# FASTALIGN_TORCH_INDEX at a CPU wheel index. With a GPU, pip's default CUDA build is used. A torch that
# is already installed in the environment is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${FASTALIGN_VENV:-.venv}
constraints=${FASTALIGN_CONSTRAINTS:-requirements/constraints.txt}
extras=${FASTALIGN_EXTRAS:-dev}
stamp="$venv/.setup-done"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$constraints" ]; then
  exit 0
fi

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade "pip>=24"

torch_pin=$(grep -E '^torch==' "$constraints")
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing the CUDA build of $torch_pin"
    "${pip[@]}" install -q -c "$constraints" "$torch_pin"
  else
    echo "setup: no NVIDIA GPU: installing the CPU build of $torch_pin"
    "${pip[@]}" install -q -c "$constraints" "$torch_pin" ${FASTALIGN_TORCH_INDEX:+--index-url "$FASTALIGN_TORCH_INDEX"}
  fi
fi

"${pip[@]}" install -q -c "$constraints" -e ".[$extras]"
touch "$stamp"
echo "setup: ready ($("$venv/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
