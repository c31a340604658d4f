#!/usr/bin/env bash
# Downloads, here, the wheels the GPU image lacks into .whl/ (git-ignored): exactly the packages the GPU
# check (`fastalign bench gpu`) needs beyond that image's (Python 3.12, torch 2.11, triton 3.6,
# transformers 5.17, peft, accelerate, pyarrow, pandas, pytest), pinned, CPython 3.12 manylinux x86_64,
# 46 MiB together (the working tree travels with them: 64 MiB in all). bitsandbytes is 43 MB of it:
# fastalign dequantizes and multiplies NF4 with its own kernels, but quantizing (random_4bit_model, the
# 70B phase) goes through bitsandbytes. On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  trl==1.16.0             # TRL's trainers: the oracle rows
  datasets==5.2.0         # trl's and fastalign's data sets
  dill==0.4.1             # datasets'
  multiprocess==0.70.19   # datasets'
  liger-kernel==0.8.5     # Liger-Kernel's rows
  cut-cross-entropy==25.1.1  # Cut Cross-Entropy's rows
  bitsandbytes==0.50.2    # quantizing the 70B phase's NF4 weights
)
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python
mkdir -p .whl
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -la .whl
