"""Scale rules on small data (timings live in benchmarks/, not here): chunks right at the provider
limits, in-flight caps that make work wait in the ledger, and a no-op run that writes nothing."""

from __future__ import annotations

import json

import duckdb
import pytest
from helpers import batch_counts, triage_model

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import InputError
from dbt_llm_batch.ledger.store import SCHEMA_VERSION
from dbt_llm_batch.pipeline import plan, request_files
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider


@pytest.fixture
def plan_con():
    """A connection holding a plan of 10 requests whose request lines are exactly 300 bytes each,
    each estimated at 5 input tokens, with the columns plan.plan_rows gives."""
    con = duckdb.connect()
    provider = OpenAIBatchProvider(parse_config({"unique_key": "id", "llm_model": "m"}))
    line_sql = provider.request_line_sql()
    base = con.execute(f"select strlen({line_sql}) from (select 'r_00' as custom_id, '' as prompt)").fetchall()[0][0]
    con.execute(f"""create temp table {plan.PLAN} as
                    select 'r_' || lpad(i::varchar, 2, '0') as custom_id, repeat('x', {299 - base}) as prompt,
                           i as plan_row, 5::bigint as estimated_input_tokens,
                           0.001::decimal(18, 9) as estimated_cost_usd
                    from range(10) t(i)""")
    return con, line_sql


def write(con, line_sql, directory=None, max_requests=50_000, max_bytes=10**9, room=None):
    """Request files for the plan; returns [(requests, bytes)] per file."""
    files = request_files.write_request_files(
        con, line_sql, plan.PLAN, directory, max_requests, max_bytes, room or request_files.Room()
    )
    return [(f.requests, f.bytes) for f in files]


def test_files_exactly_at_the_byte_limit(plan_con, tmp_path):
    con, line_sql = plan_con
    # 300 bytes per line with its newline: 3 lines fill 900 bytes exactly; a 4th would not fit.
    assert write(con, line_sql, str(tmp_path), max_bytes=900) == [(3, 900), (3, 900), (3, 900), (1, 300)]
    lines_written = []
    for chunk in range(4):
        path = tmp_path / f"requests-{chunk}.jsonl"
        lines = path.read_bytes().splitlines(keepends=True)
        assert path.stat().st_size == 300 * len(lines) <= 900
        lines_written += [json.loads(line)["custom_id"] for line in lines]
        # The ledger learns each request's file and 1-based line, which validation errors name.
        recorded = con.execute(
            f"""select p.custom_id from {request_files.SENT} s join {plan.PLAN} p using (plan_row)
                                   where s.chunk = ? order by s.line""",
            [chunk],
        ).fetchall()
        assert [r[0] for r in recorded] == [json.loads(line)["custom_id"] for line in lines]
    assert sorted(lines_written) == [f"r_{i:02d}" for i in range(10)]  # each request exactly once
    # One byte less and only two lines fit.
    assert write(con, line_sql, max_bytes=899) == [(2, 600)] * 5


def test_a_request_over_the_byte_limit_on_its_own_is_refused(plan_con):
    con, line_sql = plan_con
    with pytest.raises(InputError, match="300 bytes, larger than the provider's batch limit \\(299 bytes\\)"):
        write(con, line_sql, max_bytes=299)


def test_files_exactly_at_the_count_and_token_limits(plan_con):
    con, line_sql = plan_con
    assert [n for n, _ in write(con, line_sql, max_requests=5)] == [5, 5]
    assert [n for n, _ in write(con, line_sql, max_requests=4)] == [4, 4, 2]
    # Each request is estimated at 5 input tokens: 15 tokens of room hold 3 of them, then the rest waits.
    assert [n for n, _ in write(con, line_sql, room=request_files.Room(tokens=15))] == [3]
    assert con.execute(f"select count(*) from {request_files.SENT}").fetchall() == [(3,)]
    # Room for two batches of at most 4: 8 requests go, 2 wait.
    assert [n for n, _ in write(con, line_sql, max_requests=4, room=request_files.Room(batches=2))] == [4, 4]
    assert [n for n, _ in write(con, line_sql, room=request_files.Room(requests=7))] == [7]


def test_a_request_over_the_token_cap_goes_alone_only_when_nothing_is_in_flight(plan_con):
    con, line_sql = plan_con
    assert [n for n, _ in write(con, line_sql, room=request_files.Room(tokens=4))] == [1]
    assert write(con, line_sql, room=request_files.Room(tokens=4, nothing_in_flight=False)) == []
    assert write(con, line_sql, room=request_files.Room(tokens=4, requests=0)) == []


def test_a_third_batch_waits_in_the_ledger_when_the_cap_is_two(project, emulator, monkeypatch):
    monkeypatch.setattr(OpenAIBatchProvider, "max_requests_per_batch", 2)  # 6 rows -> 3 batches
    project.write("models/triage.sql", triage_model(extra_config="llm_max_batches_in_flight = 2,"))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [2, 2]
    assert project.query("select count(*) from main.llm_batch_requests where status = 'deferred'") == [(2,)]
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "2 request(s) wait in the ledger for a later run: the in-flight caps are reached" in log

    project.dbt("run", "-s", "triage")  # both batches still open: nothing more may go
    assert batch_counts(emulator) == [2, 2]

    # The deferred rows are sent even though the model no longer selects them.
    deferred_keys = project.query("select key from main.llm_batch_requests where status = 'deferred'")
    project.write(
        "models/triage.sql",
        triage_model(
            extra_config="llm_max_batches_in_flight = 2,",
            where="where ticket_id not in (" + ", ".join(k[0].strip('[]"') for k in deferred_keys) + ")",
        ),
    )
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [2, 2, 2]
    assert project.query("select count(*) from main.llm_batch_requests where status = 'deferred'") == [(0,)]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*), count(*) filter (where llm_status = 'succeeded') from main.triage") == [
        (6, 6)
    ]


def ledger_snapshot(project) -> tuple:
    return tuple(
        project.query(f"select * from main.{t} order by all")
        for t in ("llm_batch_jobs", "llm_batch_requests", "llm_batch_results", "triage")
    )


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


def test_a_waiting_request_whose_stored_row_lost_its_prompt_column_fails_alone(project, emulator, monkeypatch):
    """Rows over a cap wait with their row as JSON. If the model's prompt column is renamed before they
    are sent, a later run that no longer selects them cannot build their request: they fail alone,
    with the reason, and every other row is still sent and merged."""
    monkeypatch.setattr(OpenAIBatchProvider, "max_requests_per_batch", 2)  # 6 rows -> 3 batches
    project.write("models/triage.sql", triage_model(extra_config="llm_max_batches_in_flight = 1,"))
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    deferred_keys = [
        k[0].strip('[]"')
        for k in project.query("select key from main.llm_batch_requests where status = 'deferred' order by key")
    ]
    assert len(deferred_keys) == 4
    emulator.complete_all()
    renamed = triage_model(
        extra_config="llm_max_batches_in_flight = 1, llm_prompt_column = 'ticket_text',",
        where="where ticket_id not in (" + ", ".join(deferred_keys) + ")",
    ).replace(" as prompt\n", " as ticket_text\n")
    project.write("models/triage.sql", renamed)
    # The table's columns changed: a full refresh rebuilds it and sends nothing; the waiting requests
    # that can no longer be built fail there, like any row that cannot be sent.
    project.dbt("run", "-s", "triage", "--full-refresh")
    failed = project.query("select count(*), min(error) from main.llm_batch_requests where status = 'failed'")
    assert failed == [
        (
            4,
            "waited over an in-flight cap, but its stored row has no prompt column ticket_text "
            "(the model's prompt column changed); nothing was sent",
        )
    ]
    assert project.query("select count(*) from main.llm_batch_requests where status = 'deferred'") == [(0,)]
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [2], "nothing that cannot be built is sent"
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(2,)]


def test_a_ledger_of_the_previous_version_with_a_batch_in_flight_is_migrated_and_its_batch_harvests(project, emulator):
    """A ledger at schema version 15 (before row answers stored a prompt_hash) with a batch in flight:
    the next run migrates it in place, harvests the batch and asks nothing again; fingerprints and
    custom_ids stay as they were, the row answers learn their hash, and a run after that changes nothing."""
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    sent = batch_counts(emulator)
    identities = project.query("select key, fingerprint, custom_id from main.llm_batch_requests order by all")
    # Back to version 15's shape, as that version left it: no prompt_hash column.
    project.query("alter table main.llm_batch_row_answers drop column prompt_hash")
    project.query("delete from main.llm_batch_meta where schema_version > 15")

    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select max(schema_version) from main.llm_batch_meta") == [(SCHEMA_VERSION,)]
    assert batch_counts(emulator) == sent, "nothing asked again"
    assert project.query("select count(*), count(*) filter (where llm_status = 'succeeded') from main.triage") == [
        (6, 6)
    ]
    assert project.query("select key, fingerprint, custom_id from main.llm_batch_requests order by all") == identities
    assert project.query("select count(*) from main.llm_batch_row_answers where prompt_hash is null") == [(0,)]

    before, calls = ledger_snapshot(project), emulator.stats()["calls"]
    answers = project.query("select * from main.llm_batch_row_answers order by all")
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["calls"] == calls
    assert ledger_snapshot(project) == before
    assert project.query("select * from main.llm_batch_row_answers order by all") == answers
