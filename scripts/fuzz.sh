#!/usr/bin/env bash
# The long fuzzing run (the test suite runs a bounded one): schemathesis over every operation of the manager's and
# the engine's served OpenAPI, PARROT_FUZZ_EXAMPLES cases per operation (default 500). No 5xx and no response that
# violates its documented schema may appear. Usage: bash scripts/fuzz.sh [examples]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PARROT_FUZZ_EXAMPLES=${1:-${PARROT_FUZZ_EXAMPLES:-500}} exec .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_fuzz_api.py -o log_cli=false
