"""Scale benchmark (not a test): the real planner, submitter, ingester and merge on N rows, each next
to a plain-DuckDB baseline timed in the same process, so the ratios hold on a noisy machine.

    .venv/bin/python benchmarks/scale.py               # 1,000,000 rows, 3 rounds, plus peak memory at 100k and 1M
    .venv/bin/python benchmarks/scale.py --rows 100000 --no-memory --repeat 1
    .venv/bin/python benchmarks/scale.py --rows 10000000 --repeat 2 --rounds-memory-limit 4GB --temp-directory /tmp/spill
        # 3 rounds at 1M, 2 at 10M, and each step's growth between them (against the rows' 10x)

(a) plan + ledger insert + JSONL write   vs  COPY (SELECT ...) TO ... (FORMAT json) of the same lines
    and next to its floor: the least the ledger's invariants ask, in plain DuckDB (each row's md5
    fingerprint and request id, the row as asked stored before sending, and the same COPY)
(b) ingest of N result lines into the ledger and the typed output columns
                                         vs  read_json plus the same extraction into a table
    and next to its floor: the least the invariants ask, in plain DuckDB (every raw line stored
    before anything reads it, then one parse of each into a table with the row stored with its request)
(c) a no-op run on the N-row ledger      vs  a run of the same model selecting no rows (alone: --noop-only)
    and next to its floor: the least a run must do to know nothing is new, in plain DuckDB (one copy
    of the selected rows with each key and prompt hash, and an anti join with the stored ones)
(c') the same model with llm_updated_at = 'updated_at' (pipeline/settled.py): the run that records the
    settled signature, then a run with nothing new, which skips, vs the run selecting no rows; its
    floor is a new one, that reads no prompt: one aggregate, count(*) and sum(hash(key, updated_at)),
    over only the key and updated_at columns of the model's SQL
Each round runs on a fresh database file; the median ratio over the rounds is reported.
(e) planning N rows of which 30 % repeat another row's prompt, with llm_dedup on (70 % of the requests
    sent, every row answered) vs llm_dedup = false (one request per row): planning as the run's step 6
    does it (each row's fingerprint, plan.build_desired, then the plan, plan.build_plan; wall and CPU
    time), the planner alone (build_plan), and plan + ledger insert + JSONL write; the ratio on / off
    (the aim: within 10 %)
(d) peak memory (max RSS of a child process running a, b, c) at 100,000 and at N rows, next to its
    max RSS once only the input is loaded (the input relation itself), with DuckDB's
    memory_limit at 1GB (--memory-limit; DuckDB otherwise caches pages up to 80% of RAM, which is
    its cache, not what the pipeline needs)
The real code runs through runner.ModelRun with an offline provider (OfflineProvider): no network;
batches are "submitted" by recording made-up batch ids, and each batch's result file is written by
DuckDB in the OpenAI batch output format.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import duckdb

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.pipeline import merge, plan, runner, send
from dbt_llm_batch.providers.base import BatchState, Submission
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider
from dbt_llm_batch.sql import joins_as_written

RAW_CONFIG = {
    "unique_key": "id",
    "llm_model": "gpt-4o-mini",
    "llm_system": "Classify the ticket.",
    "llm_output": {"category": ["billing", "bug", "other"], "score": "integer"},
    "llm_max_tokens": 20,
    "llm_max_tokens_in_flight": 10**12,
    "llm_max_batches_in_flight": 1000,
    "llm_delete_provider_files": False,
}  # the made-up batches have no files to delete
# 512-character prompts; updated_at for (c'), llm_updated_at
SOURCE = (
    "select i as id, repeat(md5(i::varchar), 16) as prompt, timestamp '2026-01-01' + to_seconds(i) as updated_at "
    "from range({n}) t(i)"
)
UPDATED_CONFIG = {**RAW_CONFIG, "llm_updated_at": "updated_at"}
# (e): rows whose last digit is 0, 1 or 2 repeat the prompt of the row ending in 3 of their ten: 30 % duplicates.
DUP_SOURCE = (
    "select i as id, repeat(md5((case when i % 10 < 3 then i - i % 10 + 3 else i end)::varchar), 16) as prompt "
    "from range({n}) t(i)"
)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class OfflineProvider(OpenAIBatchProvider):
    """The real OpenAI provider (request lines, result parsing) with its network calls replaced: a
    submission is recorded, not uploaded, and results are files written here. So the figures are the
    plugin's own work, without the network I/O that no implementation avoids."""

    def __init__(self, config, directory):
        super().__init__(config)
        self.directory = directory

    def upload(self, jsonl_path, token):
        return f"file_{token}"

    def create(self, jsonl_path, file_id, token, model_name):
        return Submission(batch_id=f"batch_{token}", status="validating", input_file_id=file_id)

    def poll(self, batch_id):
        return BatchState(status="completed", ended=True, output_file_id=f"out_{batch_id}")

    def download_results(self, state, batch_id, directory):
        return [("output", os.path.join(self.directory, f"{batch_id}.jsonl"))]


def model_run(con, config, directory) -> runner.ModelRun:
    """A run of the benchmark model, as runner.run_model sets one up (the input is already loaded)."""
    run = runner.ModelRun(con, config, "main", "main.bench", {}, provider=OfflineProvider(config, directory))
    run.input_columns = plan.check_input(con, plan.INPUT, config)
    plan.build_desired(con, plan.INPUT, run.input_columns, config)
    return run


def plan_and_write(con, config, directory) -> int:
    """(a) with the real code: validate, plan, estimate, write the request files, write the ledger
    intents, "submit" (send.send, the one path of every run, with an offline provider)."""
    run = model_run(con, config, directory)
    send.send(run.state, run.passes)
    return run.summary.submitted


def baseline_copy(con, directory) -> None:
    """(a) baseline: DuckDB writes the same request lines itself."""
    con.execute(f"""copy (select 'r_' || id as custom_id, 'POST' as method, '/v1/chat/completions' as url,
                            {{'model': 'gpt-4o-mini', 'messages': [{{'role': 'system', 'content': 'Classify the ticket.'}},
                              {{'role': 'user', 'content': prompt}}], 'max_completion_tokens': 20}} as body
                         from {plan.INPUT}) to '{directory}/baseline.jsonl' (format json)""")


def floor_plan(con, directory) -> None:
    """(a) floor: what any implementation of the ledger's invariants must do before a batch is sent,
    in plain DuckDB: fingerprint each row (md5 over a config prefix and the prompt), derive its request
    id (sha256 of the fingerprint), store the id, key, fingerprint and the row as asked (JSON, ZSTD, as
    the ledger compresses it) in a table (invariant 1: recorded before anything could bill it), then
    write the request lines (the baseline's COPY). No plan, no history, no caps, no row answers."""
    con.execute("begin")
    con.execute("""create or replace table floor_requests (
                     custom_id varchar using compression uncompressed, key varchar using compression uncompressed,
                     fingerprint varchar using compression uncompressed, row_json varchar using compression zstd)""")
    con.execute(f"""insert into floor_requests
                    select 'r_' || sha256(fingerprint)[:40], id::varchar, fingerprint, row_json
                    from (select id, md5('prefix' || prompt) as fingerprint,
                                 to_json(struct_pack(id := id, prompt := prompt)) as row_json
                          from {plan.INPUT})""")
    con.execute("commit")
    baseline_copy(con, directory)
    con.execute("drop table floor_requests")


def design_floor_plan(con, directory) -> None:
    """(a) the design's floor: what this design's steps ask at the least, in plain DuckDB with nothing
    between its statements: each row's fingerprint kept (the plan and the row answers read it), the
    plan (one request per distinct fingerprint: llm_dedup, which is on by default), the requests stored
    with their rows (the plan joined back to the input), one row answer per request, and the request
    lines (the same join, written by COPY as the baseline writes them). Over the floor above, it is what
    the design asks beyond the invariants; the plugin over it, what the implementation adds."""
    con.execute("begin")
    con.execute(f"""create or replace temp table design_fingerprints as
                    select rowid as row_id, id::varchar as key, md5('prefix' || prompt) as fingerprint from {plan.INPUT}""")
    con.execute("""create or replace temp table design_plan as
                   select min(row_id) as row_id, arg_min(key, row_id) as key, fingerprint,
                          'r_' || sha256(fingerprint)[:40] as custom_id
                   from design_fingerprints group by fingerprint""")
    con.execute("""create or replace table design_requests (
                     custom_id varchar using compression uncompressed, key varchar using compression uncompressed,
                     fingerprint varchar using compression uncompressed, row_json varchar using compression zstd)""")
    con.execute(f"""insert into design_requests
                    select p.custom_id, p.key, p.fingerprint, to_json(struct_pack(id := i.id, prompt := i.prompt))
                    from {plan.INPUT} i join design_plan p on i.rowid = p.row_id""")
    con.execute("""create or replace table design_row_answers (
                     key varchar using compression uncompressed, fingerprint varchar using compression uncompressed,
                     custom_id varchar using compression uncompressed)""")
    con.execute("insert into design_row_answers select key, fingerprint, custom_id from design_plan")
    con.execute("commit")
    con.execute(f"""copy (select p.custom_id, 'POST' as method, '/v1/chat/completions' as url,
                            {{'model': 'gpt-4o-mini', 'messages': [{{'role': 'system', 'content': 'Classify the ticket.'}},
                              {{'role': 'user', 'content': i.prompt}}], 'max_completion_tokens': 20}} as body
                         from {plan.INPUT} i join design_plan p on i.rowid = p.row_id)
                    to '{directory}/design.jsonl' (format json)""")
    for table in ("design_requests", "design_row_answers", "design_plan", "design_fingerprints"):
        con.execute(f"drop table {table}")
    os.remove(f"{directory}/design.jsonl")


def write_results(con, directory) -> None:
    """An OpenAI batch output file per submitted batch, every request answered, in shuffled order."""
    for job_id, batch_id in con.execute("select job_id, batch_id from main.llm_batch_jobs order by job_id").fetchall():
        write_result_file(con, job_id, os.path.join(directory, f"{batch_id}.jsonl"))


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


def ingest(con, config, directory) -> None:
    """(b) with the real code: poll, store each batch's lines, settle its requests (ModelRun.harvest_open
    with the offline provider), then merge into the typed columns of the model table."""
    run = runner.ModelRun(con, config, "main", "main.bench", {}, provider=OfflineProvider(config, directory))
    run.input_columns = plan.describe(con, plan.INPUT)
    run.harvest_open()
    merge.merge(run.ledger, config, "main.bench", run.input_columns, rebuild=False)


def result_paths(directory) -> list[str]:
    return sorted(os.path.join(directory, name) for name in os.listdir(directory) if name.startswith("batch_"))


def baseline_ingest(con, paths) -> None:
    con.execute(f"""create or replace table baseline_out as
                    select custom_id,
                           json_extract_string(response.body.choices[1].message.content, '$.category') as category,
                           cast(json_extract_string(response.body.choices[1].message.content, '$.score') as bigint) as score,
                           response.body.usage.prompt_tokens as input_tokens,
                           response.body.usage.completion_tokens as output_tokens
                    from read_json({paths})""")


def floor_ingest(con, paths) -> None:
    """(b) floor: what any implementation of the invariants must do with N result lines, in plain
    DuckDB: store every raw line (ZSTD, as the ledger does) in its own transaction before anything
    reads it (invariant 2), then parse each line once into a table of the answer's typed columns and
    its usage (each request's outcome, appended, not updated), joined to the key and prompt stored
    with its request (invariant 3: the table comes from the ledger). No checks, no winners, no costs."""
    con.execute("begin")
    con.execute("""create or replace table floor_results (
                     custom_id varchar using compression uncompressed, raw varchar using compression zstd)""")
    con.execute(f"insert into floor_results select json ->> 'custom_id', json from read_ndjson_objects({paths})")
    con.execute("commit")
    con.execute("begin")
    con.execute("""create or replace table floor_out (custom_id varchar, key varchar,
                     prompt varchar using compression zstd, category varchar, score bigint, input_tokens bigint,
                     output_tokens bigint)""")  # the prompt column compressed as the model table's is (merge.py)
    con.execute("""insert into floor_out
                   select r.custom_id, q.key, q.row_json ->> 'prompt' as prompt,
                          json_extract_string(r.content, '$.category') as category,
                          cast(json_extract_string(r.content, '$.score') as bigint) as score,
                          r.input_tokens, r.output_tokens
                   from (select custom_id, r.response.body.choices[1].message.content as content,
                                r.response.body.usage.prompt_tokens as input_tokens,
                                r.response.body.usage.completion_tokens as output_tokens
                         from (select custom_id, json_transform(raw, '{"response": {"body": {"choices":
                                 [{"message": {"content": "VARCHAR"}}], "usage": {"prompt_tokens": "BIGINT",
                                 "completion_tokens": "BIGINT"}}}}') as r from floor_results)) r
                        join main.llm_batch_requests q using (custom_id)""")
    con.execute("commit")
    written = con.execute("select count(*) from floor_out").fetchall()[0][0]
    assert written == con.execute("select count(*) from floor_results").fetchall()[0][0]
    con.execute("drop table floor_results")
    con.execute("drop table floor_out")


def design_ledger(con) -> None:
    """(b)'s design floor works on copies of the ledger's requests and row answers (untimed), in a
    ledger schema of their own created by the real migrations, so its tables are declared (columns,
    compression) as the plugin's are, and the plugin's step after it finds its own untouched."""
    Ledger(con, "design", "main.bench").migrate()
    for table in ("llm_batch_requests", "llm_batch_row_answers"):
        con.execute(f"insert into design.{table} select * from main.{table}")
    con.execute("checkpoint")


def design_floor_ingest(con, config, paths) -> None:
    """(b) the design's floor: what this design's harvest asks at the least, in plain DuckDB with
    nothing between its statements: every raw line stored first (as the floor above, with the file it
    came from), one parse of each, each request updated with its outcome (status, answer, usage, cost:
    the design keeps a request's outcome on its ledger row), the model table written from the model's
    rows (the current selection, with the key's answer: row answers join the two) and the typed
    columns, and each row answer marked as the one the table shows. Over the floor above, it is what
    the design asks beyond the invariants; the plugin over it, what the implementation adds."""
    key = plan.row_facts_sql(config, plan.describe(con, plan.INPUT))[0]
    con.execute("begin")
    con.execute(
        f"""insert into design.llm_batch_results (custom_id, model, job_id, source, raw, stored_at)
            select json ->> 'custom_id', 'main.bench', filename, filename, json, now()
            from read_ndjson_objects({paths}, filename = true)"""
    )
    con.execute("commit")
    con.execute("begin")
    con.execute(
        """create or replace temp table design_outcomes as
           select custom_id, r.response.body.choices[1].message.content as answer,
                  r.response.body.usage.prompt_tokens as input_tokens,
                  r.response.body.usage.completion_tokens as output_tokens
           from (select custom_id, json_transform(raw, '{"response": {"body": {"choices":
                   [{"message": {"content": "VARCHAR"}}], "usage": {"prompt_tokens": "BIGINT",
                   "completion_tokens": "BIGINT"}}}}') as r from design.llm_batch_results)"""
    )
    con.execute(
        """update design.llm_batch_requests q set status = 'succeeded', is_final = true, answer = o.answer,
             input_tokens = o.input_tokens, output_tokens = o.output_tokens,
             cost_usd = (o.input_tokens * 0.075 + o.output_tokens * 0.3) / 1e6, completed_at = now()
           from design_outcomes o where q.custom_id = o.custom_id"""
    )
    con.execute("commit")
    con.execute("begin")
    # The answers are the join's build side and the model's rows, prompts and all, stream through it
    # (as the plugin's merge joins them: sql.joins_as_written); built over the prompts it took 1.5x.
    # The prompt column ZSTD, as the model table's is (merge.py; the floor's table is too).
    con.execute(
        """create or replace table design_model (id bigint, prompt varchar using compression zstd,
             updated_at timestamp, category varchar, score bigint, llm_status varchar, llm_cost_usd decimal(18, 9))"""
    )
    with joins_as_written(con):
        con.execute(
            f"""insert into design_model
                select i.*, json_extract_string(n.answer, '$.category') as category,
                       cast(json_extract_string(n.answer, '$.score') as bigint) as score,
                       n.status as llm_status, n.cost_usd as llm_cost_usd
                from {plan.INPUT} i
                     right join (select a.key, q.answer, q.status, q.cost_usd
                                 from design.llm_batch_row_answers a join design.llm_batch_requests q using (custom_id)) n
                     on n.key = {key}"""
        )
    con.execute("update design.llm_batch_row_answers set emitted = 'merged'")
    con.execute("commit")
    written, parsed = con.execute(
        "select (select count(*) from design_model), (select count(*) from design_outcomes)"
    ).fetchall()[0]
    assert written == parsed, (written, parsed)
    con.execute("drop table design_outcomes")
    con.execute("drop table design_model")
    con.execute("drop schema design cascade")


def floor_noop(con, config, source: str) -> int:
    """(c) floor, one side: what any run must do to know that nothing is new while keeping the model's
    rows for the rest of the run (read once: the model's SQL runs once), in plain DuckDB: one copy of
    the selected rows with each row's key and prompt hash (the same expressions the plugin uses, so
    they match the stored ones), then one anti join with the (key, prompt hash) of the stored row
    answers. Returns how many rows are new. Timed on the model's rows and on none: the difference is
    the floor of (c)."""
    facts = plan.row_facts_sql(config, plan.describe(con, "src"))
    con.execute(
        f"create or replace temp table floor_input as select *, {facts[0]} as k, {facts[1]} as h from ({source})"
    )
    new = con.execute(
        """select count(*) from floor_input i
           anti join (select key, prompt_hash from main.llm_batch_row_answers where model = 'main.bench') a
           on a.key = i.k and a.prompt_hash = i.h"""
    ).fetchall()[0][0]
    con.execute("drop table floor_input")
    return new


def floor_skip(con) -> int:
    """(c') floor: one aggregate over only the key and updated_at columns of the model's rows."""
    return con.execute("select count(*), sum(hash(id, updated_at)) from (select * from src)").fetchall()[0][0]


def run_bench_model(con, sql: str, raw_config: dict | None = None):
    """One run of the benchmark's model (main.bench) selecting `sql`, through the real runner."""
    return runner.run_model(
        con, schema="main", identifier="bench", target="main.bench", raw_config=raw_config or RAW_CONFIG, sql=sql
    )


def settled_runs(con, figures: dict) -> None:
    """(c'): with llm_updated_at, the run that records the signature, then the one that skips."""

    figures["c_record_s"], _ = timed(lambda: run_bench_model(con, "select * from src", UPDATED_CONFIG))
    figures["c_skip_s"], summary = timed(lambda: run_bench_model(con, "select * from src", UPDATED_CONFIG))
    assert summary.submitted == 0 and summary.merged == 0
    assert con.execute("select count(*) from main.llm_batch_settled").fetchall()[0][0] == 1
    figures["c_skip_floor_s"], rows = timed(lambda: floor_skip(con))
    assert rows == figures["rows"]


def run_once(n: int, memory_limit: str | None = None, temp_directory: str | None = None) -> dict:
    config = parse_config(RAW_CONFIG)
    figures = {"rows": n}
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_bench_") as directory:
        con = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        if memory_limit:  # DuckDB caches pages up to its limit (80% of RAM by default); cap it to see the need
            con.execute(f"set memory_limit = '{memory_limit}'")
        if temp_directory:  # where DuckDB spills what outgrows memory_limit (a dbt-duckdb `settings` key too)
            con.execute(f"set temp_directory = '{temp_directory}'")
        con.execute(f"create table src as {SOURCE.format(n=n)}")
        figures["input_mb"] = con.execute("select sum(strlen(prompt)) / 1e6 from src").fetchall()[0][0]
        con.execute(f"create temp table {plan.INPUT} as select * from src")
        Ledger(con, "main", "main.bench").migrate()  # one-time setup of the ledger tables, not timed
        figures["input_rss_mb"] = max_rss_mb()  # the input relation loaded: what (d) is measured against

        def step(key, fn):
            """A timed step, then an untimed checkpoint: what one step wrote (or dropped) is not written
            out by the next step's commit, so each starts from the same state whatever ran before it."""
            figures[key], result = timed(fn)
            con.execute("checkpoint")
            return result

        step("a_baseline_s", lambda: baseline_copy(con, directory))
        step("a_floor_s", lambda: floor_plan(con, directory))
        step("a_design_s", lambda: design_floor_plan(con, directory))
        submitted = step("a_plugin_s", lambda: plan_and_write(con, config, directory))
        assert submitted == n
        write_results(con, directory)
        # Run 1 would have created the (empty) model table; (b) is a later run merging into it.
        merge.merge(
            Ledger(con, "main", "main.bench"), config, "main.bench", plan.describe(con, plan.INPUT), rebuild=True
        )
        step("b_baseline_s", lambda: baseline_ingest(con, result_paths(directory)))
        step("b_floor_s", lambda: floor_ingest(con, result_paths(directory)))
        design_ledger(con)
        step("b_design_s", lambda: design_floor_ingest(con, config, result_paths(directory)))
        step("b_plugin_s", lambda: ingest(con, config, directory))
        assert con.execute("select count(*) from main.bench where llm_status = 'succeeded'").fetchall()[0][0] == n

        figures["c_empty_s"], _ = timed(lambda: run_bench_model(con, "select * from src where false"))
        figures["c_noop_s"], summary = timed(lambda: run_bench_model(con, "select * from src"))
        assert summary.submitted == 0 and summary.merged == 0
        figures["c_floor_empty_s"], _ = timed(lambda: floor_noop(con, config, "select * from src where false"))
        figures["c_floor_s"], new = timed(lambda: floor_noop(con, config, "select * from src"))
        assert new == 0
        settled_runs(con, figures)
    figures["peak_rss_mb"] = max_rss_mb()
    return figures


def noop_report(n: int, repeat: int) -> None:
    """(c) alone: one answered ledger of N rows (built untimed, as in run_once), then `repeat` rounds of
    an empty-model run and a no-op run back to back on it (round 1 is run_once's (c)); the median
    difference in wall and in CPU time (all threads: it moves less when other processes share the machine)."""
    config = parse_config(RAW_CONFIG)
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_bench_") as directory:
        con = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        con.execute(f"create table src as {SOURCE.format(n=n)}")
        con.execute(f"create temp table {plan.INPUT} as select * from src")
        Ledger(con, "main", "main.bench").migrate()
        plan_and_write(con, config, directory)
        write_results(con, directory)
        merge.merge(
            Ledger(con, "main", "main.bench"), config, "main.bench", plan.describe(con, plan.INPUT), rebuild=True
        )
        ingest(con, config, directory)

        def run(sql):
            cpu = time.process_time()
            wall, summary = timed(lambda: run_bench_model(con, sql))
            assert summary.submitted == 0 and summary.merged == 0
            return wall, time.process_time() - cpu

        walls, cpus, floors, skips, skip_walls = [], [], [], [], []
        for _ in range(repeat):
            empty, empty_cpu = run("select * from src where false")
            noop, noop_cpu = run("select * from src")
            walls.append(noop - empty)
            cpus.append(noop_cpu - empty_cpu)
            floor_empty, _ = timed(lambda: floor_noop(con, config, "select * from src where false"))
            floor, new = timed(lambda: floor_noop(con, config, "select * from src"))
            assert new == 0
            floors.append(floor - floor_empty)
            settled: dict = {"rows": n}
            settled_runs(con, settled)
            skips.append(settled["c_skip_s"] - empty)
            skip_walls.append(settled["c_skip_s"])
            print(
                f"(c) no-op {noop:.2f} s - empty model {empty:.2f} s = {noop - empty:+.2f} s "
                f"(floor {floor - floor_empty:+.2f} s)   (c') with llm_updated_at: recording run "
                f"{settled['c_record_s']:.2f} s, then nothing new {settled['c_skip_s']:.3f} s - empty model = "
                f"{settled['c_skip_s'] - empty:+.2f} s (floor {settled['c_skip_floor_s']:.3f} s)",
                flush=True,
            )
        con.close()
    print(
        f"(c) {n:,} rows: no-op run vs empty model run: median difference {statistics.median(walls):+.2f} s "
        f"(CPU time {statistics.median(cpus):+.2f} s; median of {repeat}); its floor (one copy of the rows with keys "
        f"and prompt hashes + an anti join with the stored ones) {statistics.median(floors):+.2f} s; "
        f"(c') with llm_updated_at: {statistics.median(skips):+.2f} s ({statistics.median(skip_walls):.3f} s in all)"
    )


def dedup_once(n: int, dedup: bool) -> dict:
    """(e) one round: the planner alone, then plan + ledger insert + JSONL write, on a fresh database."""
    config = parse_config({**RAW_CONFIG, "llm_dedup": dedup})
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_bench_") as directory:
        con = duckdb.connect(os.path.join(directory, "bench.duckdb"))
        con.execute(f"create temp table {plan.INPUT} as {DUP_SOURCE.format(n=n)}")
        Ledger(con, "main", "main.bench").migrate()
        run = runner.ModelRun(con, config, "main", "main.bench", {}, provider=OfflineProvider(config, directory))
        run.input_columns = plan.check_input(con, plan.INPUT, config)  # validation (step 1): not planning
        cpu = time.process_time()
        desired_s, _ = timed(lambda: plan.build_desired(con, plan.INPUT, run.input_columns, config, run.ledger))
        plan_s, planned = timed(
            lambda: plan.build_plan(run.ledger, config, plan.INPUT, run.input_columns, run.passes[0].price)
        )
        planning_cpu = time.process_time() - cpu
        full_s, _ = timed(lambda: plan_and_write(con, config, directory))
        submitted = con.execute("select count(*) from main.llm_batch_requests").fetchall()[0][0]
        answers = con.execute("select count(*) from main.llm_batch_row_answers").fetchall()[0][0]
        con.close()
    assert planned == submitted == (n - 3 * (n // 10) - min(3, n % 10) if dedup else n), (planned, submitted)
    assert answers == n
    return {
        "plan_s": plan_s,
        "planning_s": desired_s + plan_s,
        "planning_cpu": planning_cpu,
        "full_s": full_s,
        "requests": submitted,
    }


def dedup_report(n: int, repeat: int) -> None:
    """(e): median times of each side over `repeat` rounds, and their ratio."""
    # Interleaved, after one unrecorded round of each: all of one side first measured the first side
    # in a colder process (run alone, the side run first came out about 1.4x slower than inside the
    # full benchmark, where (a) to (c) had run before it).
    dedup_once(n, True), dedup_once(n, False)
    on, off = [], []
    for _ in range(repeat):
        on.append(dedup_once(n, True))
        off.append(dedup_once(n, False))
    med = lambda rounds, k: statistics.median(r[k] for r in rounds)  # noqa: E731
    print(
        f"(e) {n:,} rows, 30 % duplicates: llm_dedup on sends {on[0]['requests']:,} requests, off {off[0]['requests']:,}; "
        f"planning (fingerprints + plan, the run's step 6) {med(on, 'planning_s'):.2f} s vs {med(off, 'planning_s'):.2f} s = "
        f"{med(on, 'planning_s') / med(off, 'planning_s'):.2f}x (CPU {med(on, 'planning_cpu'):.2f} s vs "
        f"{med(off, 'planning_cpu'):.2f} s = {med(on, 'planning_cpu') / med(off, 'planning_cpu'):.2f}x); "
        f"planner alone {med(on, 'plan_s'):.2f} s vs {med(off, 'plan_s'):.2f} s = {med(on, 'plan_s') / med(off, 'plan_s'):.2f}x; "
        f"plan + ledger + JSONL {med(on, 'full_s'):.2f} s vs {med(off, 'full_s'):.2f} s = "
        f"{med(on, 'full_s') / med(off, 'full_s'):.2f}x (median of {repeat})",
        flush=True,
    )


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def report(rounds: list[dict]) -> None:
    """Each round's figures, then the median of each ratio (and of the no-op difference)."""
    print(f"rows: {rounds[0]['rows']:,}   input prompts: {rounds[0]['input_mb']:.0f} MB   rounds: {len(rounds)}")
    for i, f in enumerate(rounds, 1):
        print(
            f"round {i}: (a) plugin {f['a_plugin_s']:.2f} s / COPY baseline {f['a_baseline_s']:.2f} s = "
            f"{f['a_plugin_s'] / f['a_baseline_s']:.2f}x (floor {f['a_floor_s']:.2f} s = "
            f"{f['a_floor_s'] / f['a_baseline_s']:.2f}x, design floor {f['a_design_s']:.2f} s)   (b) plugin {f['b_plugin_s']:.2f} s / read_json baseline "
            f"{f['b_baseline_s']:.2f} s = {f['b_plugin_s'] / f['b_baseline_s']:.2f}x (floor {f['b_floor_s']:.2f} s = "
            f"{f['b_floor_s'] / f['b_baseline_s']:.2f}x, design floor {f['b_design_s']:.2f} s)   (c) no-op {f['c_noop_s']:.2f} s"
            f" - empty model {f['c_empty_s']:.2f} s = {f['c_noop_s'] - f['c_empty_s']:+.2f} s (floor "
            f"{f['c_floor_s'] - f['c_floor_empty_s']:+.2f} s)   (c') with llm_updated_at {f['c_skip_s']:.3f} s "
            f"(floor {f['c_skip_floor_s']:.3f} s)"
        )
    median = lambda values: statistics.median(values)  # noqa: E731
    print(
        f"(a) plan + ledger insert + JSONL write vs COPY ... (FORMAT json): median ratio "
        f"{median([f['a_plugin_s'] / f['a_baseline_s'] for f in rounds]):.2f}x; the floor the ledger's invariants "
        f"set (md5 + request id + the row stored before sending + COPY) "
        f"{median([f['a_floor_s'] / f['a_baseline_s'] for f in rounds]):.2f}x; the plugin over its floor "
        f"{median([f['a_plugin_s'] / f['a_floor_s'] for f in rounds]):.2f}x; the design's floor (the same plus "
        f"the plan's dedup, the join back to the input, the row answers) over the floor "
        f"{median([f['a_design_s'] / f['a_floor_s'] for f in rounds]):.2f}x, the plugin over the design's floor "
        f"{median([f['a_plugin_s'] / f['a_design_s'] for f in rounds]):.2f}x"
    )
    print(
        f"(b) ingest into ledger + typed columns vs read_json + extraction: median ratio "
        f"{median([f['b_plugin_s'] / f['b_baseline_s'] for f in rounds]):.2f}x; the floor the ledger's invariants "
        f"set (raw lines stored first + one parse into a table with the stored rows) "
        f"{median([f['b_floor_s'] / f['b_baseline_s'] for f in rounds]):.2f}x; the plugin over its floor "
        f"{median([f['b_plugin_s'] / f['b_floor_s'] for f in rounds]):.2f}x; the design's floor (the same plus "
        f"each request updated with its outcome, the model table from the model's rows, row answers marked) over "
        f"the floor {median([f['b_design_s'] / f['b_floor_s'] for f in rounds]):.2f}x, the plugin over the design's "
        f"floor {median([f['b_plugin_s'] / f['b_design_s'] for f in rounds]):.2f}x"
    )
    print(
        f"(c) no-op run on the ledger vs empty model run: median difference "
        f"{median([f['c_noop_s'] - f['c_empty_s'] for f in rounds]):+.2f} s; the floor (one copy of the rows with "
        f"keys and prompt hashes + an anti join with the stored ones) "
        f"{median([f['c_floor_s'] - f['c_floor_empty_s'] for f in rounds]):+.2f} s"
    )
    print(
        f"(c') with llm_updated_at, a run with nothing new vs empty model run: median difference "
        f"{median([f['c_skip_s'] - f['c_empty_s'] for f in rounds]):+.2f} s; its floor (one aggregate over the key and "
        f"updated_at) {median([f['c_skip_floor_s'] for f in rounds]):.3f} s, the skipping run in all "
        f"{median([f['c_skip_s'] for f in rounds]):.3f} s; the run recording the signature "
        f"{median([f['c_record_s'] for f in rounds]):.2f} s (the no-op run without the key "
        f"{median([f['c_noop_s'] for f in rounds]):.2f} s)"
    )


def growth_report(small: list[dict], large: list[dict]) -> None:
    """Each step's median time at both row counts, its growth against the rows', and its floor's."""
    med = lambda rounds, k: statistics.median(f[k] for f in rounds)  # noqa: E731
    rows = large[0]["rows"] / small[0]["rows"]
    print(
        f"growth from {small[0]['rows']:,} ({len(small)} rounds) to {large[0]['rows']:,} rows ({len(large)} rounds), "
        f"{rows:.0f}x the rows (the aim: at most {rows * 1.1:.1f}x):"
    )
    steps = {
        "(a) plan + ledger + request files": ("a_plugin_s", "a_floor_s", "a_baseline_s", None),
        "(b) ingest + typed columns": ("b_plugin_s", "b_floor_s", "b_baseline_s", None),
        "(c) a run with nothing new": ("c_noop_s", "c_floor_s", None, ("c_empty_s", "c_floor_empty_s")),
        # (c') alone, not a difference: the skipping run does less than a run of a model selecting no rows
        "(c') the same with llm_updated_at": ("c_skip_s", "c_skip_floor_s", None, None),
    }
    for name, (plugin, floor, baseline, empty) in steps.items():

        def cost(rounds, key, minus):  # (c) is the difference from the run of a model selecting no rows
            return statistics.median(f[key] - (f[minus] if minus else 0) for f in rounds)

        p0, p1 = cost(small, plugin, empty and empty[0]), cost(large, plugin, empty and empty[0])
        f0, f1 = cost(small, floor, empty and empty[1]), cost(large, floor, empty and empty[1])
        line = (
            f"{name}: {p0:.3f} -> {p1:.3f} s ({p1 / max(p0, 1e-9):.1f}x); its floor {f0:.3f} -> {f1:.3f} s "
            f"({f1 / max(f0, 1e-9):.1f}x)"
        )
        if baseline:
            line += (
                f"; baseline {med(small, baseline):.2f} -> {med(large, baseline):.2f} s "
                f"({med(large, baseline) / med(small, baseline):.1f}x); plugin over floor "
                f"{p0 / f0:.2f}x -> {p1 / f1:.2f}x"
            )
        if plugin in ("a_plugin_s", "b_plugin_s"):
            design = plugin.replace("plugin", "design")
            d0, d1 = med(small, design), med(large, design)
            line += f"; the design's floor {d0:.2f} -> {d1:.2f} s ({d1 / d0:.1f}x), plugin over it {p0 / d0:.2f}x -> {p1 / d1:.2f}x"
        print(line, flush=True)
    print(f"peak RSS of this process {max_rss_mb():.0f} MB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--no-memory", action="store_true", help="skip (d), the child processes")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of (a), (b), (c), each on a fresh database")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dedup-only", action="store_true", help="run only (e), planning with and without dedup")
    parser.add_argument("--noop-only", action="store_true", help="run only (c), a no-op run vs an empty model")
    parser.add_argument(
        "--memory-limit",
        default="1GB",
        help="DuckDB memory_limit for the (d) runs (default 1GB; 'none' for DuckDB's default)",
    )
    parser.add_argument("--rounds-memory-limit", default=None, help="DuckDB memory_limit of the (a)-(c) rounds")
    parser.add_argument("--temp-directory", default=None, help="DuckDB temp_directory of every round (spills)")
    parser.add_argument(
        "--growth-from",
        type=int,
        default=1_000_000,
        help="with --rows above it, rounds at this count first "
        "(--growth-repeat of them) and each step's growth between the two (0: none)",
    )
    parser.add_argument("--growth-repeat", type=int, default=3)
    args = parser.parse_args()
    limit = None if args.memory_limit == "none" else args.memory_limit
    if args.child:  # (d): a fresh process, so max RSS belongs to this row count alone
        print(json.dumps(run_once(args.rows, limit, args.temp_directory)))
        return 0
    if args.dedup_only:
        dedup_report(args.rows, args.repeat)
        return 0
    if args.noop_only:
        noop_report(args.rows, args.repeat)
        return 0
    if not args.no_memory:
        # Children first: Linux keeps a process's max RSS across execve, so a child started after
        # this process grew would report this process's peak instead of its own.
        for n in sorted({100_000, args.rows} | ({args.growth_from} if args.rows > args.growth_from > 0 else set())):
            out = (
                subprocess.run(
                    [sys.executable, __file__, "--rows", str(n), "--child", "--memory-limit", args.memory_limit]
                    + (["--temp-directory", args.temp_directory] if args.temp_directory else []),
                    check=True,
                    capture_output=True,
                    text=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            f = json.loads(out)
            print(
                f"(d) peak memory at {n:,} rows: {f['peak_rss_mb']:.0f} MB max RSS; with only the input loaded "
                f"{f['input_rss_mb']:.0f} MB, so the pipeline adds {f['peak_rss_mb'] - f['input_rss_mb']:+.0f} MB "
                f"(input prompts {f['input_mb']:.0f} MB; DuckDB memory_limit {args.memory_limit})",
                flush=True,
            )
    rounds_settings = (args.rounds_memory_limit, args.temp_directory)
    if args.growth_from and args.rows > args.growth_from:
        small = [run_once(args.growth_from, *rounds_settings) for _ in range(args.growth_repeat)]
        report(small)
        large = [run_once(args.rows, *rounds_settings) for _ in range(args.repeat)]
        report(large)
        growth_report(small, large)
        return 0  # (e) at 10M rows is its own run: --dedup-only
    report([run_once(args.rows, *rounds_settings) for _ in range(args.repeat)])
    dedup_report(args.rows, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
