#!/usr/bin/env bash
# Set everything up, check lint, format, types and import contracts, and run the whole test suite
# (CI runs this through .ci/run).
# The suite includes a real `dbt build` against the local engine (vLLM + Gemma 3 270M, scripts/engine.sh):
# it is set up here (the first time: a few minutes; the converted model is cached in ~/.cache), started in
# the background so that it warms up while the other tests run, and stopped at the end if this script
# started it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Lint, format, types and import layering first: each fails the script, before the slow suite starts.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports
# The documentation site (mkdocs.yml, docs/): a broken link or anchor, a page missing from the nav or a lost
# snippet fails here, in seconds. It fetches nothing from the internet.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$(mktemp -d)"
./scripts/engine.sh setup
export DO_NOT_TRACK=1
if ! ./scripts/engine.sh status >/dev/null 2>&1; then
  mkdir -p .engine
  ./scripts/engine.sh start >.engine/start-from-tests.log 2>&1 &
  trap './scripts/engine.sh stop >/dev/null 2>&1 || true' EXIT
fi
# Three workers on two cores: many tests wait on dbt subprocesses, retry-after and engine replies.
# --dist loadgroup: the Ray tests (xdist_group "ray") run on one worker, sharing one local Ray cluster.
.venv/bin/python -m pytest -q -n 3 --dist loadgroup "$@"
