#!/usr/bin/env bash
# Set everything up and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export DO_NOT_TRACK=1
exec .venv/bin/python -m pytest -q "$@"
