"""The user edits a model between runs: the table follows the model's current selection, and no
edit can strand a row, null a key or make a run pay twice."""

from __future__ import annotations

from helpers import TRIAGE_SYSTEM, batch_counts, expected_triage, triage_model


def answers(project, table="triage", key="ticket_id"):
    return project.query(f"select {key}, category, urgent, summary, llm_status from main.{table} order by 1")


def expected(project, system):
    rows = project.query("select ticket_id, subject, body from main.support_tickets order by 1")
    return [(i, *expected_triage(system, f"Subject: {s}\n\n{b}"), "succeeded") for i, s, b in rows]


def merged(project, system, emulator, where=""):
    """Run the triage model with `system`, let the batch finish, and merge it."""
    project.write("models/triage.sql", triage_model(system=system, where=where))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")


def test_reverting_a_prompt_change_shows_the_original_answers_again(project, emulator):
    project.dbt("seed")
    for system in (TRIAGE_SYSTEM, "Another system prompt."):
        merged(project, system, emulator)
        assert answers(project) == expected(project, system)
    project.write("models/triage.sql", triage_model(system=TRIAGE_SYSTEM))
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [6, 6], "the original answers are already paid for"
    assert answers(project) == expected(project, TRIAGE_SYSTEM)
    project.dbt("run", "-s", "triage", "--full-refresh")
    assert answers(project) == expected(project, TRIAGE_SYSTEM)


def test_renaming_the_key_and_adding_a_column_rebuilds_without_a_full_refresh(project, emulator):
    project.dbt("seed")
    merged(project, TRIAGE_SYSTEM, emulator)
    renamed = (
        triage_model()
        .replace("unique_key = 'ticket_id'", "unique_key = 'id'")
        .replace("select ticket_id, subject,", "select ticket_id as id, length(body) as body_len, subject,")
    )
    project.write("models/triage.sql", renamed)
    project.dbt("run", "-s", "triage")  # a new key column: the table is rebuilt from the ledger (schema_change.py)
    assert project.query("select count(*), count(id), count(body_len) from main.triage") == [(6, 6, 6)]
    project.dbt("run", "-s", "triage", "--full-refresh")
    assert project.query("select count(*), count(id), count(body_len) from main.triage") == [(6, 6, 6)]
    assert len(emulator.batches()) == 1, "the key's values did not change: nothing is asked again"


def test_dropping_the_table_rebuilds_it_from_the_ledger(project, emulator):
    project.dbt("seed")
    merged(project, TRIAGE_SYSTEM, emulator)
    project.query("drop table main.triage")
    project.dbt("run", "-s", "triage")
    assert answers(project) == expected(project, TRIAGE_SYSTEM)


def test_lowering_max_attempts_makes_a_failed_row_final(project, emulator):
    project.dbt("seed")
    emulator.add_fault(
        prompt_contains="Dark mode",
        kind="http_error",
        status_code=500,  # retryable
        type="server_error",
        message="rejected",
        times=None,
    )
    project.write("models/triage.sql", triage_model(extra_config="llm_max_attempts = 3,"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage", "--full-refresh")  # harvests the failure, plans nothing
    project.write("models/triage.sql", triage_model(extra_config="llm_max_attempts = 1,"))
    project.dbt("run", "-s", "triage")
    assert project.query("select llm_status, llm_error from main.triage where ticket_id = 5") == [
        ("failed", "rejected")
    ]
    assert batch_counts(emulator) == [6]


def test_a_failed_create_call_is_not_retried_blindly(project, emulator):
    """`create` is not idempotent: a 5xx on it is not retried (the batch may exist); the run goes on
    with a warning, and the next run reconciles the intent (no batch exists) and submits once."""
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    emulator.add_fault(endpoint="POST /v1/batches", kind="http_error", status_code=502, times=1)
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["calls"]["POST /v1/batches"] == 1
    assert "creating a batch failed (HTTP 502" in (project.root / "logs" / "dbt.log").read_text()
    assert project.query("select status from main.llm_batch_jobs") == [("submitting",)]
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [6]
    assert project.query("select status, count(*) from main.llm_batch_jobs group by 1 order by 1") == [
        ("validating", 1),
        ("voided", 1),
    ]


def test_incremental_equals_full_refresh_through_reverts_and_gaps(project, emulator):
    """Prompts changed, changed back, a key left out of a full refresh and back with a new prompt in
    flight: after each step an incremental run and a full refresh on the same ledger agree."""

    def table():
        return project.query("select * exclude (llm_completed_at) from main.triage order by ticket_id")

    def assert_full_refresh_agrees():
        before = table()
        project.dbt("run", "-s", "triage", "--full-refresh")
        assert table() == before

    project.dbt("seed")
    merged(project, "P1", emulator)
    merged(project, "P2", emulator)
    merged(project, "P1", emulator)
    assert_full_refresh_agrees()
    project.write("models/triage.sql", triage_model(system="P3"))
    project.dbt("run", "-s", "triage")  # P3 in flight
    assert_full_refresh_agrees()
    emulator.complete_all()
    project.write("models/triage.sql", triage_model(system="P3", where="where ticket_id <> 3"))
    project.dbt("run", "-s", "triage", "--full-refresh")  # key 3 left out
    project.write("models/triage.sql", triage_model(system="P4"))
    project.dbt("run", "-s", "triage")  # key 3 back, P4 in flight for every key
    assert project.query("select count(*) from main.triage") == [(6,)]
    assert_full_refresh_agrees()
    project.dbt("run", "-s", "triage")  # nothing changed: nothing is rewritten
    summaries = [
        line
        for line in (project.root / "logs" / "dbt.log").read_text().splitlines()
        if "main.triage: submitted" in line
    ]
    assert "merged 0 row(s)" in summaries[-1]


def test_chunks_never_uploaded_wait_again_after_a_failed_upload(project, emulator, monkeypatch):
    from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

    monkeypatch.setattr(OpenAIBatchProvider, "max_requests_per_batch", 2)  # 6 rows -> 3 chunks
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    emulator.add_fault(endpoint="POST /v1/files", kind="http_error", status_code=400, times=1)
    assert not project.dbt("run", "-s", "triage", expect_ok=False).success  # the first upload fails
    # A 400 proves no batch exists: the failed chunk is voided at once, the others wait as deferred.
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1 order by 1") == [
        ("deferred", 4),
        ("voided", 2),
    ]
    project.dbt("run", "-s", "triage")  # everything goes once
    assert sorted(batch_counts(emulator)) == [2, 2, 2]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]


def test_a_column_named_rowid_is_a_config_error(project, emulator):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model().replace("select ticket_id,", "select ticket_id, 1 as rowid,"))
    result = project.dbt("run", "-s", "triage", expect_ok=False)
    assert "a selected column is named 'rowid'" in str(result.result.results[0].message)
    assert emulator.stats()["calls"] == {}


def test_a_key_whose_type_changes_with_a_batch_in_flight_keeps_its_answers(project, emulator):
    """The ledger key of an integer column is built by concatenation, of any other type by to_json:
    both give the same text, so casting the key to text (or back) while a batch is in flight keeps
    every request's key: the batch is harvested and merged, and nothing is asked again."""
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")  # 6 requests in flight, keyed by an integer column
    as_text = triage_model().replace("select ticket_id,", "select cast(ticket_id as varchar) as ticket_id,")
    project.write("models/triage.sql", as_text)
    emulator.complete_all()
    project.dbt("run", "-s", "triage", "--full-refresh")  # the table's key column changes type
    want = [(str(i), *rest) for i, *rest in expected(project, TRIAGE_SYSTEM)]
    assert sorted(answers(project)) == sorted(want)
    assert batch_counts(emulator) == [6]
    project.write("models/triage.sql", triage_model())  # and back to the integer column
    project.dbt("run", "-s", "triage", "--full-refresh")
    project.dbt("run", "-s", "triage")
    assert answers(project) == expected(project, TRIAGE_SYSTEM)
    assert batch_counts(emulator) == [6], "the same keys: nothing is asked again"
    keys = project.query("select distinct key from main.llm_batch_requests order by 1")
    assert keys == [(f'["{i}"]',) for i, *_ in sorted(expected(project, TRIAGE_SYSTEM), key=lambda r: str(r[0]))]
