#!/usr/bin/env bash
# The vLLM plugin's tests in their own environment (.venv-vllm, made by scripts/setup_vllm.sh):
# the accept step inside vLLM's RejectionSampler on synthetic logits, and vLLM's engine end to end
# on a tiny saved model pair (CPU, 1 GiB of KV cache), in process and behind its OpenAI-compatible server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv-vllm/bin/python -m pytest -q -ra tests/test_vllm_plugin.py tests/test_vllm_serve.py "$@"
