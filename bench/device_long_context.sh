#!/usr/bin/env bash
# Long context's GPU checks in one device call (issue 30): one cp rank's inner attention on one GPU (sdpa's
# lower-right path, flash_attention_2 when flash_attn imports, flex), correct against full causal attention and
# against the dense mask on packed rows, flex's sinks; then time and peak CUDA memory of one forward+backward at 32k
# tokens against full attention on the whole row. Before it, on the developer machine (as bench/device_gpu_moe.sh):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
# then: run(command="bash bench/device_long_context.sh", carry=[".whl"], timeout_s=420). About 2-4 minutes (flex
# compiles). Results: printed as each part ends, and $OUT/long_context.json.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "carry .whl with the transformers 5.24.0 wheel"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" || echo "flash_attn: not importable"
timeout 360 python3 bench/gpu_long_context.py --seq 32768 --cp 4 "$@"
