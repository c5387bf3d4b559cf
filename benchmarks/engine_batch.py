"""Self-hosted benchmark (not a test): the plugin against vLLM's own offline batch runner on the real local
engine (Gemma 3 270M on vLLM's CPU build, set up by scripts/engine.sh setup), one workload, one process.

    .venv/bin/python benchmarks/engine_batch.py                # everything below: over an hour on a 2-core CPU (part 2's caching-off run is the slowest)
    .venv/bin/python benchmarks/engine_batch.py --sweep 32,64,all --parts 1,4  # the default vs the best and run-batch, ~15 min
    .venv/bin/python benchmarks/engine_batch.py --rows 500 --sweep 32,64,all,auto --parts 1  # 'auto' vs the best fixed
    .venv/bin/python benchmarks/engine_batch.py --rows 40 --sweep 8,32 --prefix-rows 20 --seqs 64   # a quick check

The workload: --rows support tickets (each text distinct, so deduplication sends every row), a triage
prompt with structured output (category and priority enums), temperature 0, 32 max tokens.

1. The server (the same flags as scripts/engine.sh, on its own port) and the plugin through the real
   run path (runner.run_model on a DuckDB file: plan, ledger, requests in flight, answers settled, merge),
   at the default llm_concurrency, at 'auto' (one run when 'auto' is the default), and at each fixed value
   of --sweep: rows per second of the
   realtime phase.
2. Prefix caching: a ~1,000-token system prompt shared by --prefix-rows requests, with the server's
   prefix caching on (vLLM's default) and off (--no-enable-prefix-caching): rows per second and the
   engine's own counters (vllm:prefix_cache_queries / vllm:prefix_cache_hits on /metrics).
3. For each --seqs value after the first (the first is scripts/engine.sh's --max-num-seqs, 64): the
   server again with that value, the plugin at the default, at 'auto' and at that many in flight.
4. `vllm run-batch` (python -m vllm.entrypoints.openai.run_batch) on the plugin's own request lines
   (the provider's request body, the prompt spliced in), with the same model and engine flags as the
   server: rows per second including its model load (process start to exit) and excluding it (from its
   "Reading batch" log line, written once the engine is up, to exit).
--parts picks some of the parts (1 always runs). Each phase runs alone: the server is stopped before run-batch starts, so they never share the 2 cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import duckdb

from dbt_llm_batch.config import DEFAULTS, parse_config
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import runner
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.providers.base import PROMPT_MARK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_PY = os.path.join(ROOT, ".venv-engine", "bin", "python")
MODEL_DIR = os.path.join(
    os.environ.get("DBT_LLM_BATCH_ENGINE_CACHE", os.path.expanduser("~/.cache/dbt-llm-batch")), "gemma-3-270m"
)
MODEL = "gemma-3-270m"
PORT = int(os.environ.get("DBT_LLM_BATCH_BENCH_PORT", "8793"))
URL = f"http://127.0.0.1:{PORT}/v1"
CATEGORIES = ["billing", "bug", "how_to", "account", "other"]
PRIORITIES = ["low", "normal", "high"]
SYSTEM = "Triage the support ticket: its category and its priority."
# ~1,000 tokens of house rules, the same in every request of part 3.
LONG_SYSTEM = (
    SYSTEM
    + " House rules follow. "
    + " ".join(
        f"Rule {i}: a ticket that mentions topic number {i} in any form is weighed with the usual care and the "
        f"customer's history before its category is chosen."
        for i in range(40)
    )
)
ISSUES = [
    "I was charged twice for my subscription this month.",
    "The export button crashes the app when the report is empty.",
    "How do I invite a colleague to my workspace?",
    "I cannot log in since I changed my email address.",
    "The invoice shows the wrong VAT number for our company.",
    "Dark mode makes the chart labels unreadable.",
    "Where can I download last year's receipts?",
    "My account was locked after three password attempts.",
]


def engine_flags(max_num_seqs: int, prefix_caching: bool) -> list[str]:
    """The engine flags of scripts/engine.sh, with the two this benchmark varies."""
    return [
        "--model", MODEL_DIR, "--served-model-name", MODEL,
        "--chat-template", os.path.join(ROOT, "engine", "gemma3_chat_template.jinja"),
        "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs), "--dtype", engine_dtype(),
        "--gpu-memory-utilization", "0.3",
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
        "--enforce-eager",
    ] + ([] if prefix_caching else ["--no-enable-prefix-caching"])  # fmt: skip


def engine_dtype() -> str:
    """As scripts/engine.sh chooses it: bfloat16 only on a CPU with fast bf16 matmuls."""
    with open("/proc/cpuinfo") as f:
        return "bfloat16" if re.search(r"avx512_bf16|amx_bf16", f.read()) else "float32"


def engine_env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")


def select_sql(n: int) -> str:
    issues = "[" + ", ".join("'" + s.replace("'", "''") + "'" for s in ISSUES) + "]"
    return (
        f"select i as id, 'Ticket ' || i || ' from customer ' || (i * 7919 % 1000) || ': ' || "
        f"{issues}[1 + i % {len(ISSUES)}] as prompt from range({n}) t(i)"
    )


def raw_config(system: str, concurrency) -> dict:
    config = {
        "unique_key": "id",
        "llm_provider": "openai_compatible",
        "llm_model": MODEL,
        "llm_base_url": URL,
        "llm_temperature": 0,
        "llm_system": system,
        "llm_output": {"category": CATEGORIES, "priority": PRIORITIES},
        "llm_max_tokens": 32,
        "llm_realtime_budget_seconds": 3600,
    }
    if concurrency is not None:
        config["llm_concurrency"] = concurrency
    return config


def plugin_run(n: int, concurrency, system: str = SYSTEM) -> tuple[float, int]:
    """The plugin over n fresh rows; returns (seconds of the realtime phase, rows with valid answers)."""
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_engine_") as directory:
        con = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        summary = runner.run_model(
            con,
            schema="main",
            identifier="bench",
            target="main.bench",
            raw_config=raw_config(system, concurrency),
            sql=select_sql(n),
        )
        valid = con.execute(
            f"select count(*) from main.bench where llm_status = 'succeeded' "
            f"and category in {tuple(CATEGORIES)} and priority in {tuple(PRIORITIES)}"
        ).fetchall()[0][0]
        con.close()
    assert summary.realtime is not None and summary.realtime.requests == n, summary
    return summary.realtime.seconds, valid


def request_lines(n: int, system: str) -> list[str]:
    """The plugin's request lines for the workload: the provider's own body with each prompt spliced in."""
    config = parse_config(raw_config(system, None))
    body = get_provider("openai_compatible")(config).request_body()
    template = json.dumps(body)
    mark = json.dumps(PROMPT_MARK)[1:-1]
    prompts = duckdb.sql(select_sql(n)).fetchall()
    return [
        json.dumps(
            {
                "custom_id": f"r{key}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": json.loads(template.replace(mark, json.dumps(prompt)[1:-1])),
            }
        )
        for key, prompt in prompts
    ]


def run_batch(n: int, max_num_seqs: int) -> tuple[float, float, int]:
    """vLLM's offline runner over the same n requests; returns (seconds in all, seconds after the
    engine was up, valid answers)."""
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_runbatch_") as directory:
        source, target = os.path.join(directory, "in.jsonl"), os.path.join(directory, "out.jsonl")
        with open(source, "w") as f:
            f.write("\n".join(request_lines(n, SYSTEM)) + "\n")
        command = [ENGINE_PY, "-m", "vllm.entrypoints.openai.run_batch", "-i", source, "-o", target]
        start = time.perf_counter()
        process = subprocess.Popen(
            command + engine_flags(max_num_seqs, True),
            env=engine_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ready = None
        tail: list[str] = []
        for line in process.stdout:  # its log; "Reading batch from" is written once the engine is up
            tail = (tail + [line])[-30:]
            if ready is None and "Reading batch from" in line:
                ready = time.perf_counter()
        code = process.wait()
        end = time.perf_counter()
        if code != 0 or ready is None:
            raise SystemExit(f"run-batch failed (exit {code}):\n" + "".join(tail))
        valid = 0
        with open(target) as f:
            for line in f:
                result = json.loads(line)
                response = result.get("response") or {}
                body = response.get("body", response)
                try:
                    answer = json.loads(body["choices"][0]["message"]["content"])
                    valid += answer.get("category") in CATEGORIES and answer.get("priority") in PRIORITIES
                except (KeyError, TypeError, ValueError):
                    pass
    return end - start, end - ready, valid


class Server:
    """The OpenAI-compatible server with the given flags, in its own process group."""

    def __init__(self, max_num_seqs: int, prefix_caching: bool = True):
        self.log = tempfile.NamedTemporaryFile(prefix="dbt_llm_batch_engine_", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [ENGINE_PY, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(PORT)]
            + engine_flags(max_num_seqs, prefix_caching),
            env=engine_env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(URL + "/models", timeout=2).read()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise SystemExit("the engine did not start:\n" + tail) from None
                time.sleep(1)

    def log_tail(self) -> str:
        with open(self.log.name) as f:
            return "".join(f.readlines()[-30:])

    def prefix_caching_logged(self) -> str:
        with open(self.log.name) as f:
            found = re.search(r"enable_prefix_caching=(\w+)", f.read())
        return found.group(1) if found else "not logged"

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5).read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            found = re.match(r"(vllm:prefix_cache_(?:queries|hits)(?:_total)?)(?:\{[^}]*\})? ([0-9.e+]+)$", line)
            if found:
                name = found.group(1).removesuffix("_total")
                values[name] = values.get(name, 0.0) + float(found.group(2))
        return values

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


class AutoSettled(logging.Handler):
    """Catches the run's log line saying where llm_concurrency='auto' settled and why."""

    def __init__(self):
        super().__init__()
        self.line = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "'auto' settled at" in message:
            self.line = message.split("'auto' ", 1)[1]

    def __enter__(self) -> AutoSettled:
        log.addHandler(self)
        self._level = log.level
        log.setLevel(min(log.level or logging.INFO, logging.INFO))  # setLevel: clears the logger's cache
        return self

    def __exit__(self, *exc) -> None:
        log.removeHandler(self)
        log.setLevel(self._level)


def rate_line(label: str, n: int, seconds: float, valid: int) -> float:
    rate = n / seconds
    # The load average shows whether anything else competed for the cores during the phase.
    load = os.getloadavg()[0]
    print(
        f"   {label:<34} {n} rows in {seconds:6.1f} s = {rate:6.2f} rows/s ({valid} valid; load {load:.1f})", flush=True
    )
    return rate


def measured(label: str, n: int, concurrency) -> float:
    """rate_line of one plugin run; with 'auto', also where it settled and what the engine said."""
    with AutoSettled() as settled:
        rate = rate_line(label, n, *plugin_run(n, concurrency))
    if settled.line:
        print(f"      'auto' {settled.line}", flush=True)
    return rate


def prefix_part(server: Server, rows: int, label: str) -> None:
    before = server.metrics()
    seconds, valid = plugin_run(rows, 32, LONG_SYSTEM)
    after = server.metrics()
    queries = after.get("vllm:prefix_cache_queries", 0) - before.get("vllm:prefix_cache_queries", 0)
    hits = after.get("vllm:prefix_cache_hits", 0) - before.get("vllm:prefix_cache_hits", 0)
    rate_line(f"long shared prefix, caching {label}", rows, seconds, valid)
    share = f" = {hits / queries:.0%}" if queries else ""
    print(f"      engine counters: {hits:.0f} prefix-cache hit tokens of {queries:.0f} queried{share}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument(
        "--sweep",
        default="4,8,16,24,32,48,64,all",
        help="fixed llm_concurrency values to try; 'all' = every row at once, as run-batch submits them",
    )
    parser.add_argument("--prefix-rows", type=int, default=200)
    parser.add_argument(
        "--seqs", default="64,32", help="the engine's --max-num-seqs values to try (first: scripts/engine.sh's)"
    )
    parser.add_argument("--parts", default="1,2,3,4", help="which of the numbered parts above to run")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(MODEL_DIR, "CONVERTED")):
        raise SystemExit("the engine is not set up: run scripts/engine.sh setup")
    n, default = args.rows, DEFAULTS["llm_concurrency"]
    print(f"workload: {n} tickets, structured triage output, 32 max tokens; prompt of about "
          f"{len(request_lines(1, SYSTEM)[0]) // 4} tokens; long prefix about {len(LONG_SYSTEM) // 4} tokens")  # fmt: skip
    seqs = [int(s) for s in args.seqs.split(",")]
    rates: dict[str, float] = {}

    print(f"1. server, --max-num-seqs {seqs[0]}", flush=True)
    server = Server(seqs[0])
    try:
        print(f"   prefix caching in the engine's config: {server.prefix_caching_logged()}")
        plugin_run(8, 8)  # warm-up: the first requests compile the grammar
        sweep = args.sweep.split(",")
        # 'auto' in --sweep: measured at its place in the sweep (as warm as the fixed values around it).
        if default != "auto" or "auto" not in sweep:
            rates["default"] = measured(f"plugin, default ({default})", n, None)
        if default != "auto" and "auto" not in sweep:
            rates["auto"] = measured("plugin, 'auto'", n, "auto")
        for c in sweep:
            if c == "auto":
                rates["auto"] = measured("plugin, 'auto'", n, "auto")
            else:
                c = str(n) if c == "all" else c
                rates[c] = measured(f"plugin, llm_concurrency {c}", n, int(c))
        rates.setdefault("auto", rates.get("default", 0.0))
        rates.setdefault("default", rates["auto"])  # the default is 'auto': one run measures both
    finally:
        server.stop()
    fixed = {k: v for k, v in rates.items() if k.isdigit()}
    best = max(fixed, key=fixed.get)
    print(f"   best fixed concurrency {best}: {fixed[best]:.2f} rows/s", flush=True)
    for label in ("default", "auto"):
        print(f"   plugin {label}: {rates[label] / fixed[best]:.2f}x the best fixed", flush=True)
    print(f"   auto vs best fixed: {rates['auto'] / fixed[best]:.2f}x (the aim: 0.90x)", flush=True)
    parts = set(args.parts.split(","))
    for on in (True, False) if "2" in parts else ():
        print(f"2. server with prefix caching {'on' if on else 'off'}", flush=True)
        server = Server(seqs[0], prefix_caching=on)
        try:
            if on:
                print(f"   prefix caching in the engine's config: {server.prefix_caching_logged()}")
            plugin_run(8, 8)
            prefix_part(server, args.prefix_rows, "on" if on else "off")
        finally:
            server.stop()
    for s in seqs[1:] if "3" in parts else ():
        print(f"3. server, --max-num-seqs {s}", flush=True)
        server = Server(s)
        try:
            plugin_run(8, 8)
            rate_line(f"plugin, default ({default})", n, *plugin_run(n, None))
            if default != "auto":
                rate_line("plugin, 'auto'", n, *plugin_run(n, "auto"))
            rate_line(f"plugin, llm_concurrency {s}", n, *plugin_run(n, s))
        finally:
            server.stop()
    if "4" not in parts:
        return 0
    # Last: on this CPU build it is the slowest part (the server is stopped, so it runs alone).
    print(f"4. vllm run-batch, --max-num-seqs {seqs[0]}", flush=True)
    total, working, valid = run_batch(n, seqs[0])
    with_load = rate_line("run-batch including model load", n, total, valid)
    without_load = rate_line("run-batch excluding model load", n, working, valid)
    for label in ("default", "auto"):
        print(
            f"   plugin {label}: {rates[label] / without_load:.2f}x run-batch without its load, "
            f"{rates[label] / with_load:.2f}x with it"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
