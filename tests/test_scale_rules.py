"""Scale rules on small data (timings live in benchmarks/, not here): chunks right at the provider
limits, in-flight caps that make work wait in the ledger, and a no-op run that writes nothing."""

from __future__ import annotations

import duckdb
import pytest
from helpers import batch_counts, triage_model

from dbt_llm_batch import planner, submit
from dbt_llm_batch.config import parse_config
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider


@pytest.fixture
def plan_con():
    """A connection holding a plan of 10 requests whose request lines are exactly 300 bytes each."""
    con = duckdb.connect()
    provider = OpenAIBatchProvider(parse_config({"unique_key": "id", "llm_model": "m"}))
    line_sql = provider.request_line_sql()
    base = con.execute(f"select strlen({line_sql}) from (select 'r_00' as custom_id, '' as prompt)").fetchall()[0][0]
    con.execute(f"""create temp table {planner.PLAN} as
                    select 'r_' || lpad(i::varchar, 2, '0') as custom_id, repeat('x', {299 - base}) as prompt,
                           0 as chunk, 5::bigint as estimated_input_tokens, null::bigint as line_bytes
                    from range(10) t(i)""")
    return con, line_sql


def chunk_sizes(con) -> list[int]:
    return [r[0] for r in con.execute(f"select count(*) from {planner.PLAN} group by chunk order by chunk").fetchall()]


def test_chunks_exactly_at_the_byte_limit(plan_con, tmp_path):
    con, line_sql = plan_con
    # 300 bytes per line with its newline: 3 lines fill 900 bytes exactly; a 4th would not fit.
    assert planner.assign_chunks(con, line_sql, max_requests=50_000, max_bytes=900) == 4
    assert chunk_sizes(con) == [3, 3, 3, 1]
    for chunk in range(4):
        path = tmp_path / f"{chunk}.jsonl"
        lines = submit.write_jsonl(con, line_sql, chunk, str(path))
        assert path.stat().st_size == 300 * lines <= 900
    # One byte less and only two lines fit.
    assert planner.assign_chunks(con, line_sql, max_requests=50_000, max_bytes=899) == 5
    assert chunk_sizes(con) == [2, 2, 2, 2, 2]


def test_chunks_exactly_at_the_count_and_token_limits(plan_con):
    con, line_sql = plan_con
    assert planner.assign_chunks(con, line_sql, max_requests=5, max_bytes=10**9) == 2
    assert chunk_sizes(con) == [5, 5]
    assert planner.assign_chunks(con, line_sql, max_requests=4, max_bytes=10**9) == 3
    assert chunk_sizes(con) == [4, 4, 2]
    # Each request is estimated at 5 input tokens: a 15-token cap holds 3 of them per chunk.
    assert planner.assign_chunks(con, line_sql, max_requests=50_000, max_bytes=10**9, max_tokens=15) == 4
    assert chunk_sizes(con) == [3, 3, 3, 1]


def test_a_third_batch_waits_in_the_ledger_when_the_cap_is_two(project, emulator, monkeypatch):
    monkeypatch.setattr(OpenAIBatchProvider, "max_requests_per_batch", 2)  # 6 rows -> 3 batches
    project.write("models/triage.sql", triage_model(extra_config="llm_max_batches_in_flight = 2,"))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [2, 2]
    assert project.query("select count(*) from main.llm_batch_requests where status = 'deferred'") == [(2,)]
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "2 request(s) in 1 batch(es) wait in the ledger for a later run" in log

    project.dbt("run", "-s", "triage")  # both batches still open: nothing more may go
    assert batch_counts(emulator) == [2, 2]

    # The deferred rows are sent even though the model no longer selects them.
    deferred_keys = project.query("select key from main.llm_batch_requests where status = 'deferred'")
    project.write("models/triage.sql", triage_model(
        extra_config="llm_max_batches_in_flight = 2,",
        where="where ticket_id not in (" + ", ".join(k[0].strip('[]"') for k in deferred_keys) + ")"))
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [2, 2, 2]
    assert project.query("select count(*) from main.llm_batch_requests where status = 'deferred'") == [(0,)]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*), count(*) filter (where llm_status = 'succeeded') from main.triage") == [(6, 6)]


def ledger_snapshot(project) -> tuple:
    return tuple(project.query(f"select * from main.{t} order by all")
                 for t in ("llm_batch_jobs", "llm_batch_requests", "llm_batch_results", "triage"))


def test_a_run_with_nothing_new_sends_and_writes_nothing(project, emulator):
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    before, calls = ledger_snapshot(project), emulator.stats()["calls"]
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["calls"] == calls
    assert ledger_snapshot(project) == before
