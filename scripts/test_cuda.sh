#!/usr/bin/env bash
# tests/test_cuda.py on a machine with an NVIDIA GPU and a CUDA build of torch already installed
# (the engine, lookup drafting, trees and the vLLM plugin's accept step on GPU tensors).
# Usage: bash scripts/test_cuda.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" - <<'PY'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device: tests/test_cuda.py needs one"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name(0)}")
PY
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py "$@"
