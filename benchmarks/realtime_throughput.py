"""Realtime throughput benchmark (not a test): the openai_compatible provider's real code path
(runner.run_model on a DuckDB file: plan, ledger intents, concurrent requests, answers stored and
settled as they arrive, merge), measured in one process next to baselines.

    .venv/bin/python benchmarks/realtime_throughput.py                 # both parts
    .venv/bin/python benchmarks/realtime_throughput.py --skip-engine   # the loopback part only

1. Loopback: a server that answers every request after a fixed 200 ms with 64 slots
   (benchmarks/loopback_chat_server.py, in its own process): its limit is 64 / 0.2 s = 320 req/s.
   Printed: a plain asyncio client using the `openai` SDK with a semaphore of 64 (no ledger), and the
   provider at llm_concurrency 64 with ledger writes included, each as a fraction of the limit.
2. The real local engine (scripts/engine.sh start; DBT_LLM_BATCH_ENGINE_URL, default
   http://127.0.0.1:8791/v1): the provider one request at a time (llm_concurrency 1) against
   llm_concurrency 32, as requests per second and their ratio; every answer must be a valid enum value.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import duckdb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from realtime_spike import HERE, free_port, run_openai, server_stats  # noqa: E402

from dbt_llm_batch.pipeline import runner  # noqa: E402

CATEGORIES = ["billing", "bug", "how_to", "other"]
ENGINE_URL = os.environ.get("DBT_LLM_BATCH_ENGINE_URL", "http://127.0.0.1:8791/v1")


def provider_run(base_url: str, model: str, n: int, concurrency: int) -> tuple[float, float, int]:
    """Run the model over n fresh rows through the real provider path; returns (seconds of the
    realtime phase, seconds of the whole run, rows that succeeded with a valid category)."""
    config = {
        "unique_key": "id",
        "llm_provider": "openai_compatible",
        "llm_model": model,
        "llm_base_url": base_url,
        "llm_concurrency": concurrency,
        "llm_temperature": 0,
        "llm_system": "Classify the support ticket.",
        "llm_output": {"category": CATEGORIES},
        "llm_max_tokens": 24,
        "llm_realtime_budget_seconds": 3600,
    }
    sql = (
        f"select i as id, 'Ticket ' || i || ': I was charged twice for my subscription.' as prompt from range({n}) t(i)"
    )
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_rt_") as directory:
        con = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        start = time.perf_counter()
        summary = runner.run_model(
            con, schema="main", identifier="bench", target="main.bench", raw_config=config, sql=sql
        )
        total = time.perf_counter() - start
        valid = con.execute(
            f"select count(*) from main.bench where llm_status = 'succeeded' and category in {tuple(CATEGORIES)}"
        ).fetchall()[0][0]
        con.close()
    assert summary.realtime is not None and summary.realtime.requests == n, summary
    return summary.realtime.seconds, total, valid


def loopback(n: int, slots: int, delay: float) -> None:
    limit = slots / delay
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "loopback_chat_server.py"),
            "--port",
            str(port),
            "--concurrency",
            str(slots),
            "--delay",
            str(delay),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().startswith("listening"), "the loopback server did not start"
        url = f"http://127.0.0.1:{port}/v1"
        print(f"1. loopback server: {slots} slots x {delay * 1000:.0f} ms = limit {limit:.0f} req/s; {n} requests each")
        for run in (1, 2):
            t0 = time.perf_counter()
            asyncio.run(run_openai(url, n, slots))
            sdk = n / (time.perf_counter() - t0)
            phase, total, valid = provider_run(url, "loopback", n, slots)
            assert valid == n, f"{valid} of {n} rows succeeded"
            assert server_stats(port)["max_in_service"] <= slots
            print(
                f"   run {run}: plain openai SDK client (semaphore {slots}, no ledger): {sdk:6.1f} req/s = "
                f"{sdk / limit:.2f} of the limit | provider with ledger writes: {n / phase:6.1f} req/s = "
                f"{n / phase / limit:.2f} of the limit (whole dbt-less run incl. plan and merge {total:.2f} s)",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(timeout=10)


def engine(sequential_rows: int, concurrent_rows: int, concurrency: int) -> None:
    try:
        urllib.request.urlopen(ENGINE_URL + "/models", timeout=3).read()
    except OSError as exc:
        print(f"2. real engine: not reachable at {ENGINE_URL} ({exc}); start it with scripts/engine.sh start")
        return
    print(f"2. real engine at {ENGINE_URL} (Gemma 3 270M on vLLM's CPU build), structured enum output, 24 max tokens")
    phase1, _, valid1 = provider_run(ENGINE_URL, "gemma-3-270m", sequential_rows, 1)
    phase2, _, valid2 = provider_run(ENGINE_URL, "gemma-3-270m", concurrent_rows, concurrency)
    rate1, rate2 = sequential_rows / phase1, concurrent_rows / phase2
    print(f"   one at a time: {sequential_rows} rows in {phase1:.1f} s = {rate1:.2f} req/s ({valid1} valid)")
    print(
        f"   llm_concurrency {concurrency}: {concurrent_rows} rows in {phase2:.1f} s = {rate2:.2f} req/s "
        f"({valid2} valid)"
    )
    print(f"   ratio: {rate2 / rate1:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-loopback", action="store_true")
    args = parser.parse_args()
    if not args.skip_loopback:
        loopback(args.requests, 64, 0.2)
    if not args.skip_engine:
        engine(16, 96, 32)
    return 0


if __name__ == "__main__":
    sys.exit(main())
