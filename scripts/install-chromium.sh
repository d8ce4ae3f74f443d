#!/usr/bin/env bash
# Install Debian's headless-capable Chromium (and its driver) for the browser tests of the live web view
# (tests/test_ui.py drives it through playwright with executable_path=/usr/bin/chromium; playwright's own
# browser download is never used). Idempotent: does nothing when /usr/bin/chromium is already there.
# Needs root (or passwordless sudo) on a Debian/Ubuntu box; elsewhere it says why and exits 0, and the
# browser tests skip naming the missing binary.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-chromium: no apt-get here; install Chromium at /usr/bin/chromium to run the browser tests" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "install-chromium: not root and no passwordless sudo; the browser tests will skip" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null
/usr/bin/chromium --version
