"""The core story on a real DuckDB file and real dbt: submit tonight, merge tomorrow, never pay twice.

Every test here runs once per batch provider (the `provider` fixture): switching provider is one
config line, and the story must not change."""

from __future__ import annotations

from helpers import TRIAGE_SYSTEM, batch_counts, expected_triage, triage_model

MODEL = "models/triage.sql"
SELECT = ["-s", "triage"]


def table_rows(project):
    return project.query(
        """select t.ticket_id, s.subject, s.body, t.category, t.urgent, t.summary, t.llm_status,
                  t.llm_fingerprint, t.llm_batch_id
           from main.triage t join main.support_tickets s using (ticket_id) order by ticket_id"""
    )


def assert_answers_match(project, system):
    """Every row's typed outputs are the emulator's answer for *that row's* prompt."""
    rows = table_rows(project)
    assert rows, "table is empty"
    for ticket_id, subject, body, category, urgent, summary, status, _, _ in rows:
        prompt = f"Subject: {subject}\n\n{body}"
        assert status == "succeeded", ticket_id
        assert (category, urgent, summary) == expected_triage(system, prompt), f"wrong answer on {ticket_id}"


def test_submit_pending_merge_noop_new_rows_change_and_full_refresh(project, emulator, provider):
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")

    # Run 1: one batch with every selected row; the table exists, empty.
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6]
    assert project.query("select count(*) from main.triage") == [(0,)]
    batch_id = emulator.batches()[0]["id"]

    # A run while the batch is still being processed merges nothing and does not fail.
    if provider == "openai":
        emulator.advance(batch_id, "finalizing")  # OpenAI's last state before results exist
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage") == [(0,)]
    assert len(emulator.batches()) == 1

    # After completion: every row merged with its own typed answer.
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage") == [(6,)]
    assert_answers_match(project, TRIAGE_SYSTEM)
    types = dict(
        project.query("select column_name, data_type from information_schema.columns where table_name = 'triage'")
    )
    assert types["category"] == "VARCHAR" and types["urgent"] == "BOOLEAN"
    assert types["llm_completed_at"] == "TIMESTAMP WITH TIME ZONE"
    assert project.query("select distinct llm_batch_id from main.triage") == [(batch_id,)]
    assert project.query("select min(llm_input_tokens) > 0, min(llm_output_tokens) > 0 from main.triage") == [
        (True, True)
    ]

    # Nothing new: no batch, no upload, not a single provider call.
    calls = emulator.stats()["calls"]
    project.dbt("run", *SELECT)
    assert emulator.stats()["calls"] == calls

    # New seed rows: exactly those are sent.
    with open(project.root / "seeds/support_tickets.csv", "a") as f:
        f.write("7,Cannot add teammate,The invite button is greyed out for me.,normal\n")
        f.write("8,VAT number,Where do I enter our VAT number?,low\n")
    project.dbt("seed")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 2]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage") == [(8,)]
    assert_answers_match(project, TRIAGE_SYSTEM)

    # Changing llm_system re-asks every row; old answers stay until the new ones land.
    old_fingerprints = {r[0]: r[7] for r in table_rows(project)}
    new_system = "You are a terse support triage bot."
    project.write(MODEL, triage_model(system=new_system, provider=provider))
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 2, 8]
    assert {r[0]: r[7] for r in table_rows(project)} == old_fingerprints
    assert_answers_match(project, TRIAGE_SYSTEM)
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert_answers_match(project, new_system)
    new_fingerprints = {r[0]: r[7] for r in table_rows(project)}
    assert all(new_fingerprints[k] != old_fingerprints[k] for k in old_fingerprints)

    # Full refresh: the same rows, rebuilt from the ledger, with zero provider calls.
    before_rows = project.query("select * from main.triage order by ticket_id")
    calls = emulator.stats()["calls"]
    project.dbt("run", *SELECT, "--full-refresh")
    assert emulator.stats()["calls"] == calls
    assert project.query("select * from main.triage order by ticket_id") == before_rows


def test_failed_requests_retry_then_fail_with_error(project, emulator, provider):
    project.write(MODEL, triage_model(extra_config="llm_max_attempts = 2,", provider=provider))
    # A server error may pass, so it is retried (a 400 would be final at once: tests/test_final_failures.py).
    emulator.add_fault(
        prompt_contains="Dark mode",
        kind="http_error",
        status_code=500,
        type="server_error",
        message="This prompt was rejected by the test",
        times=None,
    )
    project.dbt("seed")
    project.dbt("run", *SELECT)
    emulator.complete_all()

    # The others merge; the failed one is retried in a new batch and is not in the table yet.
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage") == [(5,)]
    assert batch_counts(emulator) == [6, 1]
    emulator.complete_all()

    # Attempt limit reached: the row is final, `failed`, with the provider's error text.
    project.dbt("run", *SELECT)
    assert project.query("select llm_status, llm_error, category from main.triage where ticket_id = 5") == [
        ("failed", "This prompt was rejected by the test", None)
    ]
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(5,)]
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 1], "an exhausted row must not be sent again"

    # Raising the limit puts it back in the queue; the failed row stays until the new outcome is final.
    emulator.clear_faults()
    project.write(MODEL, triage_model(extra_config="llm_max_attempts = 3,", provider=provider))
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 1, 1]
    assert project.query("select llm_status from main.triage where ticket_id = 5") == [("failed",)]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select llm_status from main.triage where ticket_id = 5") == [("succeeded",)]
