#!/usr/bin/env bash
# Builds the CPU peer llama.cpp (llama-cpp-python from source, native CPU flags) into the Python environment
# given as $1 (default: this project's .venv/bin/python). About 7 minutes on 2 cores: run it in the background.
# Only the engine benchmark uses it (to compare against llama.cpp on the same GGUF); never the tests or CI.
#
# How the benchmark measures it fairly (parrot/bench/peers.py):
#   * the shipped Q4_1 GGUF as is, and the same file requantized by llama.cpp itself to Q4_0 and Q8_0
#     (llama_cpp.llama_model_quantize): Q4_1 has no fast llama.cpp CPU kernel on every CPU, so both are reported;
#   * batched decode through the low-level batch API (llama_batch + llama_decode with several seq_ids), as
#     llama.cpp's own server does: llama_cpp.server serves one request at a time behind a global lock;
#   * the same thread count as our engine, fresh random prompts per repeat (no cache hits).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
export CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF ${CMAKE_ARGS:-}"
"$PY" -m pip install --disable-pip-version-check --no-binary llama-cpp-python "llama-cpp-python==${VERSION}"
"$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready')"
