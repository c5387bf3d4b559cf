"""The user edits a model between runs: the table follows the model's current selection, and no
edit can strand a row, null a key or make a run pay twice."""

from __future__ import annotations

from helpers import TRIAGE_SYSTEM, batch_counts, expected_triage, triage_model


def answers(project, table="triage", key="ticket_id"):
    return project.query(f"select {key}, category, urgent, summary, llm_status from main.{table} order by 1")


def expected(project, system):
    rows = project.query("select ticket_id, subject, body from main.support_tickets order by 1")
    return [(i, *expected_triage(system, f"Subject: {s}\n\n{b}"), "succeeded") for i, s, b in rows]


def test_reverting_a_prompt_change_shows_the_original_answers_again(project, emulator):
    project.dbt("seed")
    for system in (TRIAGE_SYSTEM, "Another system prompt."):
        project.write("models/triage.sql", triage_model(system=system))
        project.dbt("run", "-s", "triage")
        emulator.complete_all()
        project.dbt("run", "-s", "triage")
        assert answers(project) == expected(project, system)
    project.write("models/triage.sql", triage_model(system=TRIAGE_SYSTEM))
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [6, 6], "the original answers are already paid for"
    assert answers(project) == expected(project, TRIAGE_SYSTEM)
    project.dbt("run", "-s", "triage", "--full-refresh")
    assert answers(project) == expected(project, TRIAGE_SYSTEM)


def test_full_refresh_after_renaming_the_key_and_adding_a_column(project, emulator):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    renamed = triage_model().replace("unique_key = 'ticket_id'", "unique_key = 'id'").replace(
        "select ticket_id, subject,", "select ticket_id as id, length(body) as body_len, subject,")
    project.write("models/triage.sql", renamed)
    assert not project.dbt("run", "-s", "triage", expect_ok=False).success  # asks for --full-refresh
    project.dbt("run", "-s", "triage", "--full-refresh")
    assert project.query("select count(*), count(id), count(body_len) from main.triage") == [(6, 6, 6)]
    assert len(emulator.batches()) == 1, "the key's values did not change: nothing is asked again"


def test_dropping_the_table_rebuilds_it_from_the_ledger(project, emulator):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    project.query("drop table main.triage")
    project.dbt("run", "-s", "triage")
    assert answers(project) == expected(project, TRIAGE_SYSTEM)


def test_lowering_max_attempts_makes_a_failed_row_final(project, emulator):
    project.dbt("seed")
    emulator.add_fault(prompt_contains="Dark mode", kind="http_error", status_code=400,
                       type="invalid_request_error", message="rejected", times=None)
    project.write("models/triage.sql", triage_model(extra_config="llm_max_attempts = 3,"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage", "--full-refresh")  # harvests the failure, plans nothing
    project.write("models/triage.sql", triage_model(extra_config="llm_max_attempts = 1,"))
    project.dbt("run", "-s", "triage")
    assert project.query("select llm_status, llm_error from main.triage where ticket_id = 5") == [("failed", "rejected")]
    assert batch_counts(emulator) == [6]


def test_a_failed_create_call_is_not_retried_blindly(project, emulator):
    """`create` is not idempotent: a 5xx on it fails the run instead of being retried by the SDK;
    the next run reconciles the intent (no batch exists) and submits once."""
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    emulator.add_fault(endpoint="POST /v1/batches", kind="http_error", status_code=502, times=1)
    assert not project.dbt("run", "-s", "triage", expect_ok=False).success
    assert emulator.stats()["calls"]["POST /v1/batches"] == 1
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [6]
    assert project.query("select status, count(*) from main.llm_batch_jobs group by 1 order by 1") == [
        ("validating", 1), ("voided", 1)]
