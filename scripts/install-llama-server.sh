#!/usr/bin/env bash
# Builds llama.cpp's own HTTP server (`llama-server`) into .venv/llama.cpp/bin/llama-server (idempotent: does
# nothing when the binary exists). The sources are the llama.cpp tree vendored by the pinned llama-cpp-python sdist,
# so the server matches the library the engine benchmark compares against. Only the `llama-server` target is built
# (CPU, native flags, no libcurl: models are local files). About 5 minutes of 2 idle cores (8.5 CPU-minutes;
# 28 minutes on a 2-core box shared with other jobs, 2026-11-26).
# The external-engine tests (tests/test_backend_llamacpp.py) and parrot/bench/backend_bench.py start it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PREFIX=${LLAMA_SERVER_PREFIX:-.venv/llama.cpp}
BIN="$PREFIX/bin/llama-server"
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
if [ -x "$BIN" ]; then
  echo "llama-server present: $BIN"
  exit 0
fi
if ! command -v cmake >/dev/null 2>&1 || ! command -v c++ >/dev/null 2>&1; then
  # a clean Debian box: get the toolchain (root, or passwordless sudo); elsewhere say why and leave the
  # llama.cpp tests to skip, naming the missing binary
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO="none"; fi
  fi
  if [ "$SUDO" = "none" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-llama-server: needs cmake and a C++ compiler; the llama.cpp tests will skip" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends cmake g++ make >/dev/null
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --no-binary llama-cpp-python --no-deps -d "$WORK" \
  "llama-cpp-python==${VERSION}"
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC=$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON >/dev/null
cmake --build "$WORK/build" --target llama-server -j"$JOBS"
mkdir -p "$PREFIX/bin"
cp "$WORK/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
"$BIN" --version 2>&1 | head -n 2 || true
echo "llama-server built: $BIN"
