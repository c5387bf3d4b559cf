#!/usr/bin/env bash
# Set everything up and run the main job end to end.
#
#   ./scripts/demo.sh            the main job on a REAL model: Gemma 3 270M served by a local vLLM engine
#                                (CPU build; scripts/engine.sh). No key, no account, nothing leaves the machine.
#                                The first time installs the engine and converts the model (several minutes).
#   ./scripts/demo.sh --sandbox  the asynchronous batch lifecycle against the sandbox, an emulator of the
#                                OpenAI Batch API whose answers are placeholders, not a model's: run 1 submits
#                                a batch, the sandbox finishes it, run 2 merges the results.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
./scripts/setup.sh
export DO_NOT_TRACK=1
MODE="${1:-local}"
DBT="../.venv/bin/dbt"

fresh_project() {  # into integration_project, with a new DuckDB file and the package installed
  cd "$ROOT/integration_project"
  export DBT_LLM_BATCH_DUCKDB="${DBT_LLM_BATCH_DUCKDB:-$PWD/integration.duckdb}"
  rm -f "$DBT_LLM_BATCH_DUCKDB" "$DBT_LLM_BATCH_DUCKDB.wal"
  $DBT deps --profiles-dir .
}

show_tables() {  # DuckDB file, then table names: each table's key, answer and status columns
  ../.venv/bin/python "$ROOT/scripts/demo_tables.py" "$@"
}

if [ "$MODE" = "--sandbox" ]; then
  PORT="${SANDBOX_PORT:-8787}"
  export OPENAI_API_KEY="sk-sandbox-demo"          # the sandbox's key; no real key is needed or used
  export OPENAI_BASE_URL="http://127.0.0.1:${PORT}/v1"
  .venv/bin/python -m dbt_llm_batch.sandbox --port "$PORT" --api-key "$OPENAI_API_KEY" --auto-advance 1 --quiet &
  SANDBOX_PID=$!
  trap 'kill $SANDBOX_PID 2>/dev/null || true' EXIT
  for _ in $(seq 50); do curl -fs "http://127.0.0.1:${PORT}/_emulator/stats" >/dev/null && break; sleep 0.2; done
  fresh_project
  echo "== run 1: select rows, submit one batch per model (the tables exist, empty)"
  $DBT build --profiles-dir . --select +tag:batch
  echo "== waiting for the sandbox to finish the batches"
  for _ in $(seq 60); do
    curl -fs "http://127.0.0.1:${PORT}/_emulator/batches" | grep -qE '"status": ?"(validating|in_progress|finalizing)"' || break
    sleep 0.5
  done
  echo "== run 2: harvest the finished batches and merge the results"
  $DBT build --profiles-dir . --select +tag:batch
  ../.venv/bin/dbt-llm-batch status --database "$DBT_LLM_BATCH_DUCKDB"
  show_tables "$DBT_LLM_BATCH_DUCKDB" ticket_triage review_summary
  exit 0
fi

[ "$MODE" = "local" ] || { echo "usage: scripts/demo.sh [--sandbox]" >&2; exit 2; }
./scripts/engine.sh setup
if ! ./scripts/engine.sh status >/dev/null 2>&1; then
  ./scripts/engine.sh start
  trap '"$ROOT/scripts/engine.sh" stop' EXIT
else
  ./scripts/engine.sh start  # already running: wait until it answers
fi
fresh_project
echo "== run 1: every ticket goes to the local engine, answers are merged in the same run, then dbt tests run"
$DBT build --profiles-dir . --select +tag:local
echo "== run 2: nothing new, so nothing is sent"
$DBT build --profiles-dir . --select +tag:local
../.venv/bin/dbt-llm-batch status --database "$DBT_LLM_BATCH_DUCKDB"
show_tables "$DBT_LLM_BATCH_DUCKDB" ticket_triage_local
