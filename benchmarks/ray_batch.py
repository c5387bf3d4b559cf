"""Self-hosted benchmark (not a test): one triage workload on the real local engine (Gemma 3 270M on vLLM's
CPU build, scripts/engine.sh setup) three ways, in one process, each phase alone on the machine:

    .venv/bin/python benchmarks/ray_batch.py --rows 500        # the issue's workload (~15 min on 2 cores)
    .venv/bin/python benchmarks/ray_batch.py --rows 60         # a quick check

1. The plugin's realtime path (`openai_compatible`, the run sends every row itself) at llm_concurrency
   'auto' and at all rows in flight: rows per second of the realtime phase.
2. `llm_provider = 'ray'` on a local single-node Ray cluster (2 CPUs) sending to the same server: the
   time `run_model` takes to return (submitted, job running), then rows per second with start-up (from
   the submitting run's start to the job's end) and without (from the job's first request line read,
   Ray Data's "Starting execution" log line, to its end); a second run merges and counts valid answers.
3. `vllm run-batch` on the same request lines (benchmarks/engine_batch.py's run_batch): with and without
   its model load. The server is stopped first.
The workload, server flags and answer checks are benchmarks/engine_batch.py's. Figures on a busy machine
are noise: the load average is printed beside each.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from datetime import datetime

import duckdb

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

from engine_batch import CATEGORIES, MODEL, PRIORITIES, URL, Server, rate_line, raw_config, run_batch, select_sql  # noqa: E402
from ray_cluster import RayCluster  # noqa: E402

from dbt_llm_batch.pipeline import runner  # noqa: E402


def valid_rows(con) -> int:
    return con.execute(
        f"select count(*) from main.bench where llm_status = 'succeeded' "
        f"and category in {tuple(CATEGORIES)} and priority in {tuple(PRIORITIES)}"
    ).fetchall()[0][0]


def realtime(n: int, concurrency) -> float:
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_bench_") as directory:
        con = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        config = raw_config(runner_system(), concurrency)
        summary = runner.run_model(
            con, schema="main", identifier="bench", target="main.bench", raw_config=config, sql=select_sql(n)
        )
        valid = valid_rows(con)
        con.close()
    assert summary.realtime is not None and summary.realtime.requests == n, summary
    return rate_line(f"realtime, llm_concurrency={concurrency}", n, summary.realtime.seconds, valid)


def runner_system() -> str:
    from engine_batch import SYSTEM

    return SYSTEM


def ray_job(n: int, cluster: RayCluster, concurrency: int, tasks: int) -> tuple[float, float]:
    """Rows per second of the Ray path (with start-up, without)."""
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_bench_") as directory:
        con = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        config = {
            **raw_config(runner_system(), concurrency),
            "llm_provider": "ray",
            "llm_ray_address": cluster.address,
            "llm_ray_storage": os.path.join(directory, "storage"),
            "llm_ray_tasks": tasks,
            "llm_ray_rows_per_task": max(1, n // tasks),
        }
        began = time.perf_counter()
        began_wall = time.time()
        runner.run_model(
            con, schema="main", identifier="bench", target="main.bench", raw_config=config, sql=select_sql(n)
        )
        returned = time.perf_counter() - began
        [(batch_id,)] = con.execute("select batch_id from main.llm_batch_jobs").fetchall()
        client = cluster.client()
        print(
            f"   ray: run_model returned in {returned:.1f} s, job {client.get_job_status(batch_id).value}", flush=True
        )
        while not client.get_job_status(batch_id).is_terminal():
            time.sleep(0.2)
        info = client.get_job_info(batch_id)
        ended_wall = info.end_time / 1000
        logs = client.get_job_logs(batch_id)
        found = re.search(
            r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\s+INFO streaming_executor.py:\d+ -- Starting execution",
            logs,
            re.M,
        )
        runner.run_model(
            con, schema="main", identifier="bench", target="main.bench", raw_config=config, sql=select_sql(n)
        )
        valid = valid_rows(con)
        con.close()
    with_startup = rate_line("ray job, with start-up", n, ended_wall - began_wall, valid)
    without = float("nan")
    if found:
        started = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        without = rate_line("ray job, without start-up", n, ended_wall - started, valid)
    return with_startup, without


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500)
    parser.add_argument("--seqs", type=int, default=64, help="the server's --max-num-seqs")
    parser.add_argument("--ray-tasks", type=int, default=2)
    args = parser.parse_args()
    n = args.rows
    os.environ.setdefault("DO_NOT_TRACK", "1")
    print(f"workload: {n} triage rows, model {MODEL}, server {URL} --max-num-seqs {args.seqs}", flush=True)
    began = time.perf_counter()
    cluster = RayCluster(engine_key="unused").start()
    print(f"   ray: local head started in {cluster.started_in_seconds:.1f} s", flush=True)
    server = Server(args.seqs)
    print(f"   server up in {time.perf_counter() - began:.1f} s (with the Ray head)", flush=True)
    try:
        auto = realtime(n, "auto")
        full = realtime(n, n)
        ray_with, ray_without = ray_job(n, cluster, max(1, args.seqs // args.ray_tasks), args.ray_tasks)
    finally:
        server.stop()
        cluster.stop()
    total, after_load, valid = run_batch(n, args.seqs)
    batch_with = rate_line("vllm run-batch, with model load", n, total, valid)
    batch_without = rate_line("vllm run-batch, without model load", n, after_load, valid)
    print("\n| path | rows/s | × realtime (all in flight) |\n|---|---|---|")
    for label, rate in (
        ("realtime, 'auto'", auto),
        (f"realtime, {n} in flight", full),
        ("Ray job, with start-up", ray_with),
        ("Ray job, without start-up", ray_without),
        ("vllm run-batch, with model load", batch_with),
        ("vllm run-batch, without model load", batch_without),
    ):
        print(f"| {label} | {rate:.2f} | {rate / full:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
