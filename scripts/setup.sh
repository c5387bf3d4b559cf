#!/usr/bin/env bash
# Create .venv (if missing) and install the package with its test and lint tools (the `dev` extra) from pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'
# The report's browser test (tests/test_report.py) drives Debian's chromium through Playwright (never
# `playwright install`, which downloads a browser build of its own).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null ||
    echo "setup.sh: could not install chromium (apt-get as root); tests/test_report.py needs /usr/bin/chromium" >&2
fi
