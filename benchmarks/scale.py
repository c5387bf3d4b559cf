"""Scale benchmark (not a test): the real planner, submitter, ingester and merge on N rows, each next
to a plain-DuckDB baseline timed in the same process, so the ratios hold on a noisy machine.

    .venv/bin/python benchmarks/scale.py               # 1,000,000 rows, plus peak memory at 100k and 1M
    .venv/bin/python benchmarks/scale.py --rows 100000 --no-memory

(a) plan + ledger insert + JSONL write   vs  COPY (SELECT ...) TO ... (FORMAT json) of the same lines
(b) ingest of N result lines into the ledger and the typed output columns
                                         vs  read_json plus the same extraction into a table
(c) a no-op run on the N-row ledger      vs  a run of the same model selecting no rows
(d) peak memory (max RSS of a child process running a, b, c) at 100,000 and at N rows, with DuckDB's
    memory_limit at 1GB (--memory-limit; DuckDB otherwise caches pages up to 80% of RAM, which is
    its cache, not what the pipeline needs)
No provider is called: batches are "submitted" by recording made-up batch ids, and the result file
is written by DuckDB in the OpenAI batch output format.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import duckdb

from dbt_llm_batch import costs, harvest, merge, planner, runner, submit
from dbt_llm_batch.config import parse_config
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.providers.base import BatchState
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

RAW_CONFIG = {"unique_key": "id", "llm_model": "gpt-4o-mini", "llm_system": "Classify the ticket.",
              "llm_output": {"category": ["billing", "bug", "other"], "score": "integer"}, "llm_max_tokens": 20,
              "llm_max_tokens_in_flight": 10**12, "llm_max_batches_in_flight": 1000}
SOURCE = "select i as id, repeat(md5(i::varchar), 16) as prompt from range({n}) t(i)"  # 512-character prompts


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def plan_and_write(con, config, directory) -> int:
    """(a) with the real code: desired rows, plan, estimates, chunks, ledger intents, JSONL files."""
    ledger = Ledger(con, "main", "main.bench")
    columns = planner.check_input(con, planner.INPUT, config)
    planner.build_desired(con, planner.INPUT, columns, config)
    n = planner.build_plan(ledger, config, planner.INPUT, columns)
    rows = planner.plan_rows(config, columns)
    con.execute(f"""update {planner.PLAN} set estimated_input_tokens = x.t
                    from (select custom_id, {costs.estimated_input_tokens_sql(config)} as t from {rows}) x
                    where {planner.PLAN}.custom_id = x.custom_id""")
    provider = OpenAIBatchProvider(config)
    line_sql = provider.request_line_sql()
    n_chunks = planner.assign_chunks(con, line_sql, provider.max_requests_per_batch, provider.max_bytes_per_batch,
                                     rows=rows)
    job_ids = ledger.write_intents(provider.name, config.model, rows, list(range(n_chunks)))
    for chunk, job_id in job_ids.items():  # as submit.submit_chunks does, minus the provider calls
        submit.write_jsonl(con, line_sql, chunk, os.path.join(directory, f"requests-{chunk}.jsonl"), rows)
        ledger.record_submission(job_id, f"batch_bench_{chunk}", None, "validating")
    return n


def baseline_copy(con, directory) -> None:
    """(a) baseline: DuckDB writes the same request lines itself."""
    con.execute(f"""copy (select 'r_' || id as custom_id, 'POST' as method, '/v1/chat/completions' as url,
                            {{'model': 'gpt-4o-mini', 'messages': [{{'role': 'system', 'content': 'Classify the ticket.'}},
                              {{'role': 'user', 'content': prompt}}], 'max_completion_tokens': 20}} as body
                         from {planner.INPUT}) to '{directory}/baseline.jsonl' (format json)""")


def write_results(con, directory) -> list[tuple[str, str]]:
    """An OpenAI batch output file per job, every request answered, in shuffled order."""
    jobs = [r[0] for r in con.execute("select job_id from main.llm_batch_jobs order by job_id").fetchall()]
    for job_id in jobs:
        write_result_file(con, job_id, os.path.join(directory, f"{job_id}.jsonl"))
    return [(job_id, os.path.join(directory, f"{job_id}.jsonl")) for job_id in jobs]


def write_result_file(con, job_id, path) -> None:
    con.execute(f"""copy (select custom_id, 'batch_req_' || custom_id as id,
                            {{'status_code': 200, 'request_id': 'req', 'body': {{'id': 'c', 'object': 'chat.completion',
                              'choices': [{{'index': 0, 'finish_reason': 'stop', 'message': {{'role': 'assistant',
                                'content': '{{"category":"' || (['billing','bug','other'])[cast(1 + hash(custom_id) % 3 as bigint)] ||
                                           '","score":' || cast(hash(custom_id) % 100 as bigint) || '}}'}}}}],
                              'usage': {{'prompt_tokens': 140, 'completion_tokens': 9, 'total_tokens': 149,
                                         'prompt_tokens_details': {{'cached_tokens': 0}}}}}}}} as response,
                            null as error
                         from main.llm_batch_requests where job_id = '{job_id}' order by hash(custom_id))
                    to '{path}' (format json)""")


def ingest(con, config, files) -> None:
    """(b) with the real code: store each job's lines, settle its requests, merge into typed columns."""
    ledger = Ledger(con, "main", "main.bench")
    provider = OpenAIBatchProvider(config)
    price = {"input": 0.15, "output": 0.6, "cache_write": 0.15, "cache_read": 0.075, "batch_discount": 0.5}
    # as harvest.poll_and_harvest does, minus the provider calls
    harvest.store_lines(ledger, [(job_id, "output", path) for job_id, path in files])
    harvest.settle(ledger, provider, config, [(job_id, BatchState(status="completed", ended=True))
                                              for job_id, _ in files], price)
    columns = planner.describe(con, planner.INPUT)
    merge.merge(ledger, config, "main.bench", columns, rebuild=False)


def baseline_ingest(con, files) -> None:
    paths = [path for _, path in files]
    con.execute(f"""create or replace table baseline_out as
                    select custom_id,
                           json_extract_string(response.body.choices[1].message.content, '$.category') as category,
                           cast(json_extract_string(response.body.choices[1].message.content, '$.score') as bigint) as score,
                           response.body.usage.prompt_tokens as input_tokens,
                           response.body.usage.completion_tokens as output_tokens
                    from read_json({paths})""")


def run_once(n: int, memory_limit: str | None = None) -> dict:
    config = parse_config(RAW_CONFIG)
    figures = {"rows": n}
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_bench_") as directory:
        con = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        if memory_limit:  # DuckDB caches pages up to its limit (80% of RAM by default); cap it to see the need
            con.execute(f"set memory_limit = '{memory_limit}'")
        con.execute(f"create table src as {SOURCE.format(n=n)}")
        figures["input_mb"] = con.execute("select sum(strlen(prompt)) / 1e6 from src").fetchall()[0][0]
        con.execute(f"create temp table {planner.INPUT} as select * from src")
        Ledger(con, "main", "main.bench").migrate()  # one-time setup of the ledger tables, not timed

        figures["a_baseline_s"], _ = timed(lambda: baseline_copy(con, directory))
        figures["a_plugin_s"], _ = timed(lambda: plan_and_write(con, config, directory))
        results = write_results(con, directory)
        # Run 1 would have created the (empty) model table; (b) is a later run merging into it.
        merge.merge(Ledger(con, "main", "main.bench"), config, "main.bench", planner.describe(con, planner.INPUT),
                    rebuild=True)
        figures["b_baseline_s"], _ = timed(lambda: baseline_ingest(con, results))
        figures["b_plugin_s"], _ = timed(lambda: ingest(con, config, results))
        assert con.execute("select count(*) from main.bench where llm_status = 'succeeded'").fetchall()[0][0] == n

        def run(sql):
            return runner.run_model(con, schema="main", identifier="bench", target="main.bench",
                                    raw_config=RAW_CONFIG, sql=sql)
        figures["c_empty_s"], _ = timed(lambda: run("select * from src where false"))
        figures["c_noop_s"], summary = timed(lambda: run("select * from src"))
        assert summary.submitted == 0 and summary.merged == 0
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def report(f: dict) -> None:
    print(f"rows: {f['rows']:,}   input prompts: {f['input_mb']:.0f} MB")
    print(f"(a) plan + ledger insert + JSONL write: {f['a_plugin_s']:.2f} s   COPY ... (FORMAT json) baseline: "
          f"{f['a_baseline_s']:.2f} s   ratio {f['a_plugin_s'] / f['a_baseline_s']:.2f}x")
    print(f"(b) ingest into ledger + typed columns: {f['b_plugin_s']:.2f} s   read_json + extraction baseline: "
          f"{f['b_baseline_s']:.2f} s   ratio {f['b_plugin_s'] / f['b_baseline_s']:.2f}x")
    print(f"(c) no-op run on the ledger: {f['c_noop_s']:.2f} s   empty model run: {f['c_empty_s']:.2f} s   "
          f"difference {f['c_noop_s'] - f['c_empty_s']:+.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--no-memory", action="store_true", help="skip (d), the child processes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-limit", default="1GB",
                        help="DuckDB memory_limit for the (d) runs (default 1GB; 'none' for DuckDB's default)")
    args = parser.parse_args()
    limit = None if args.memory_limit == "none" else args.memory_limit
    if args.child:  # (d): a fresh process, so max RSS belongs to this row count alone
        print(json.dumps(run_once(args.rows, limit)))
        return 0
    if not args.no_memory:
        # Children first: Linux keeps a process's max RSS across execve, so a child started after
        # this process grew would report this process's peak instead of its own.
        for n in sorted({100_000, args.rows}):
            out = subprocess.run([sys.executable, __file__, "--rows", str(n), "--child",
                                  "--memory-limit", args.memory_limit], check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            f = json.loads(out)
            print(f"(d) peak memory at {n:,} rows: {f['peak_rss_mb']:.0f} MB max RSS "
                  f"(input prompts {f['input_mb']:.0f} MB; DuckDB memory_limit {args.memory_limit}; "
                  f"a {f['a_plugin_s']:.1f} s, b {f['b_plugin_s']:.1f} s)", flush=True)
    report(run_once(args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
