#!/usr/bin/env bash
# Set everything up and run the main job end to end: integration_project against the local sandbox
# (an emulator of the OpenAI Batch API whose answers are placeholders, not a model's).
#   run 1 submits a batch, the sandbox finishes it, run 2 merges the results, then the table is shown.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export DO_NOT_TRACK=1

PORT="${SANDBOX_PORT:-8787}"
export OPENAI_API_KEY="sk-sandbox-demo"          # the sandbox's key; no real key is needed or used
export OPENAI_BASE_URL="http://127.0.0.1:${PORT}/v1"
.venv/bin/python -m dbt_llm_batch.sandbox --port "$PORT" --api-key "$OPENAI_API_KEY" --auto-advance 1 --quiet &
SANDBOX_PID=$!
trap 'kill $SANDBOX_PID 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -fs "http://127.0.0.1:${PORT}/_emulator/stats" >/dev/null && break; sleep 0.2; done

cd integration_project
export DBT_LLM_BATCH_DUCKDB="${DBT_LLM_BATCH_DUCKDB:-$PWD/integration.duckdb}"
rm -f "$DBT_LLM_BATCH_DUCKDB" "$DBT_LLM_BATCH_DUCKDB.wal"
DBT="../.venv/bin/dbt"
$DBT deps --profiles-dir .
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
../.venv/bin/python - "$DBT_LLM_BATCH_DUCKDB" <<'PY'
import sys, duckdb
con = duckdb.connect(sys.argv[1], read_only=True)
for table in ("ticket_triage", "review_summary"):
    print(f"\n== main.{table}")
    con.sql(f"select * exclude (llm_fingerprint) from main.{table} order by all").show(max_width=200)
print("\n== cost at the shipped gpt-4o-mini batch price vs realtime (main.llm_batch_costs)")
con.sql("select model, rows_succeeded, input_tokens, output_tokens, cost_usd, realtime_cost_usd, savings_usd "
        "from main.llm_batch_costs order by model").show(max_width=200)
PY
