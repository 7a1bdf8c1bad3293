#!/usr/bin/env bash
# The GPU bench in one device call (issue 9). Before it, on the developer machine:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
# (and keep .whl out of git), then through the device tool: run(command="bash bench/device_gpu_moe.sh",
# carry=[".whl"], timeout_s=600). The H200 image has torch 2.11 and Triton 3.6; transformers 5.24 comes from .whl.
# Results: printed as each part ends, and $OUT/gpu_moe.json (rewritten after every part).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "carry .whl with the transformers 5.24.0 wheel"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader || true
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout 540 python3 bench/gpu_moe.py "$@"
