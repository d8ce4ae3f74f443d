#!/usr/bin/env bash
# Install iproute2 (`ip netns`, veth, bridges) for the multi-host test (tests/test_multihost.py runs a manager and
# engines in separate network namespaces). Idempotent: does nothing when `ip` is already there. Needs root on a
# Debian/Ubuntu box; elsewhere it says why and exits 0, and the test skips naming what is missing.
set -euo pipefail

if command -v ip >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-iproute2: no apt-get here; install iproute2 to run the multi-host test" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-iproute2: not root; the multi-host test will skip (it needs root for ip netns anyway)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends iproute2 >/dev/null
ip -V
