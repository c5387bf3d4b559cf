"""Embeddings at scale (not a test): packing N rows into request lines and merging N vectors, with the
real planner, request files, harvest and merge, each next to a plain-DuckDB baseline timed in the same
process (and its peak memory in a child process of its own), so the ratios hold on a noisy machine.

    .venv/bin/python benchmarks/embed_scale.py                  # 1,000,000 rows, 64-dimension vectors
    .venv/bin/python benchmarks/embed_scale.py --rows 100000 --dimensions 256

(a) pack: plan + ledger insert + packed JSONL write (send.send)  vs  COPY of the same texts as unpacked
    /v1/embeddings lines, one per row (what a client without packing writes); with the lines each wrote
(b) merge: harvest (store each result line, settle every packed request's vector) + merge into the
    FLOAT[n] column  vs  read_json of the same result files, unnested into a FLOAT[n] table
(c) peak memory (max RSS) of a child process doing (a)+(b), against one doing the two baselines
Vectors are made up in SQL (a hash per number); 64 dimensions by default keep a million of them (as the
JSON the provider sends) within this machine's disk and memory.
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
from scale import OfflineProvider  # benchmarks/ is sys.path[0] when this script runs

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.pipeline import merge, plan, runner, send

SOURCE = "select i as id, 'document ' || i || ': ' || repeat(md5(i::varchar), 4) as prompt from range({n}) t(i)"


def config_for(dimensions: int):
    return parse_config(
        {
            "unique_key": "id",
            "llm_task": "embed",
            "llm_model": "text-embedding-3-small",
            "llm_dimensions": dimensions,
            "llm_max_tokens_in_flight": 10**12,
            "llm_max_batches_in_flight": 1000,
            "llm_delete_provider_files": False,
        }
    )


# The real OpenAI provider with its network calls replaced, as in scale.py (packed lines go through it unchanged).
def vector_sql(dimensions: int, seed: str) -> str:
    return f"list_transform(range({dimensions}), lambda k: ((hash({seed} || k) % 2001)::double / 1000 - 1)::float)"


def write_results(con, directory: str, dimensions: int) -> None:
    """Each batch's output file as OpenAI writes it for packed lines: one line per request line, its
    `data` one vector per input (in input order: the line's requests by custom_id)."""
    jobs = con.execute("select job_id, batch_id from main.llm_batch_jobs order by job_id").fetchall()
    for job_id, batch_id in jobs:
        con.execute(f"""copy (
            select min(custom_id) as custom_id, 'batch_req_' || min(custom_id) as id,
                   {{'status_code': 200, 'request_id': 'req',
                     'body': {{'object': 'list', 'model': 'text-embedding-3-small',
                               'data': list({{'object': 'embedding', 'index': pos, 'embedding': v}} order by pos),
                               'usage': {{'prompt_tokens': count(*) * 30, 'total_tokens': count(*) * 30}}}}}} as response,
                   null as error
            from (select custom_id, file_line, row_number() over (partition by file_line order by custom_id) - 1 as pos,
                         {vector_sql(dimensions, "custom_id")} as v
                  from main.llm_batch_requests where job_id = '{job_id}')
            group by file_line) to '{directory}/{batch_id}.jsonl' (format json)""")


def real(n: int, dimensions: int, directory: str) -> dict:
    con = duckdb.connect(os.path.join(directory, "real.duckdb"))
    con.execute(f"create temp table {plan.INPUT} as {SOURCE.format(n=n)}")
    config = config_for(dimensions)
    start = time.perf_counter()
    run = runner.ModelRun(con, config, "main", "main.bench", {}, provider=OfflineProvider(config, directory))
    run.input_columns = plan.check_input(con, plan.INPUT, config)
    plan.build_desired(con, plan.INPUT, run.input_columns, config)
    send.send(run.state, run.passes)
    pack = time.perf_counter() - start
    lines = con.execute("select count(distinct (job_id, file_line)) from main.llm_batch_requests").fetchone()[0]
    write_results(con, directory, dimensions)
    start = time.perf_counter()
    run = runner.ModelRun(con, config, "main", "main.bench", {}, provider=OfflineProvider(config, directory))
    run.input_columns = plan.describe(con, plan.INPUT)
    run.harvest_open()
    merge.merge(run.ledger, config, "main.bench", run.input_columns, rebuild=True)
    merged = time.perf_counter() - start
    rows = con.execute("select count(*), count(llm_embedding) from main.bench").fetchone()
    return {"pack": pack, "merge": merged, "request_lines": lines, "rows": rows}


def baseline(n: int, dimensions: int, directory: str) -> dict:
    con = duckdb.connect(os.path.join(directory, "baseline.duckdb"))
    con.execute(f"create table docs as {SOURCE.format(n=n)}")
    start = time.perf_counter()
    con.execute(f"""copy (select 'r_' || id as custom_id, 'POST' as method, '/v1/embeddings' as url,
                           {{'model': 'text-embedding-3-small', 'input': prompt, 'encoding_format': 'float',
                             'dimensions': {dimensions}}} as body from docs) to '{directory}/unpacked.jsonl' (format json)""")
    pack = time.perf_counter() - start
    # The same output a provider would send for unpacked lines: one vector per line.
    con.execute(f"""copy (select 'r_' || id as custom_id,
                           {{'status_code': 200, 'body': {{'data': [{{'index': 0, 'embedding': {vector_sql(dimensions, "id::varchar")}}}]}}}}
                             as response, null as error from docs) to '{directory}/out.jsonl' (format json)""")
    start = time.perf_counter()
    con.execute(f"""create table out as
                    select custom_id, cast(response.body.data[1].embedding as FLOAT[{dimensions}]) as embedding
                    from read_json('{directory}/out.jsonl',
                                   columns={{'custom_id': 'VARCHAR', 'response': 'STRUCT(body STRUCT(data STRUCT(embedding FLOAT[])[]))'}})""")
    merged = time.perf_counter() - start
    return {
        "pack": pack,
        "merge": merged,
        "request_lines": n,
        "rows": con.execute("select count(*) from out").fetchone(),
    }


def child(kind: str, n: int, dimensions: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        result = (real if kind == "real" else baseline)(n, dimensions, directory)
    result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dimensions", type=int, default=64)
    parser.add_argument("--child", choices=["real", "baseline"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.dimensions)))
        return 0
    out = {}
    for kind in ("baseline", "real"):  # each in a process of its own: its peak memory is its own
        proc = subprocess.run(
            [sys.executable, __file__, "--child", kind, "--rows", str(args.rows), "--dimensions", str(args.dimensions)],
            capture_output=True,
            text=True,
            check=True,
        )
        out[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    r, b = out["real"], out["baseline"]
    print(f"{args.rows:,} rows, {args.dimensions}-dimension vectors")
    print(
        f"(a) pack:  {r['pack']:.1f} s for {r['request_lines']:,} packed lines  vs  {b['pack']:.1f} s writing "
        f"{b['request_lines']:,} unpacked lines (x{r['pack'] / b['pack']:.1f}; lines /{b['request_lines'] / r['request_lines']:.0f})"
    )
    print(
        f"(b) merge: {r['merge']:.1f} s into the ledger and FLOAT[n]  vs  {b['merge']:.1f} s read_json -> FLOAT[n] "
        f"(x{r['merge'] / b['merge']:.1f}); rows {r['rows']} vs {b['rows']}"
    )
    print(
        f"(c) peak memory: {r['max_rss_mb']:.0f} MB  vs  {b['max_rss_mb']:.0f} MB (x{r['max_rss_mb'] / b['max_rss_mb']:.1f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
