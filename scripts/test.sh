#!/usr/bin/env bash
# One command: set everything up (including the default models, which the end-to-end tests use)
# and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -q -ra "$@"
