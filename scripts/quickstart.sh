#!/usr/bin/env bash
# One command: set everything up, then speculative decoding of a real coding prompt with the
# default pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft), streaming text, then the metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec quickdraft generate \
    "Write a Python function is_prime(n) that returns True if n is a prime number. Keep it short." \
    --method sd --k 4 --temperature 0 --max-new-tokens 128 "$@"
