#!/usr/bin/env bash
# Creates the second virtual environment, .venv-lowest (or $FASTALIGN_VENV), at the lowest versions
# pyproject.toml allows (requirements/constraints-lowest.txt: torch 2.11, triton 3.6, transformers 5.17,
# peft 0.19, accelerate 1.3), with fastalign and its test tools only (`make test-lowest` runs the
# checkpointing, offloading, patching, loading and some kernel tests in it). Idempotent, like setup.sh,
# which does the work.
#
# PyTorch: PyPI's torch 2.11.0 for Linux x86_64 is the CUDA 13.0 build (torch 2.13's CPU wheel is what
# the main environment gets from the machine's wheel directory); it runs on CPU, but with its nvidia-*
# wheels it is about 3 GB to download and 4.6 GB installed. Where the CPU wheel index can be reached,
# FASTALIGN_TORCH_INDEX=https://download.pytorch.org/whl/cpu gets the 200 MB CPU build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
export FASTALIGN_VENV=${FASTALIGN_VENV:-.venv-lowest}
export FASTALIGN_CONSTRAINTS=requirements/constraints-lowest.txt
export FASTALIGN_EXTRAS=test
exec bash scripts/setup.sh
