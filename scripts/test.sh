#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-chromium.sh  # Debian's chromium for the browser tests of /ui (tests/test_ui.py)
bash scripts/install-llama-server.sh  # llama.cpp's llama-server for the external-engine tests (tests/test_backend_*.py)
bash scripts/install-iproute2.sh  # `ip netns` for the multi-host test (tests/test_multihost.py)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
