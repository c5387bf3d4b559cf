"""The table matches the selection: a selected column that is not part of the request shows its
current value after an incremental run, without asking anything again, and the same as a full refresh
gives; `llm_on_unselected = 'delete'` drops keys the model no longer selects (the ledger keeps them)."""

from __future__ import annotations

from helpers import TRIAGE_SYSTEM, batch_counts, expected_triage, triage_model

COLUMNS = "ticket_id, subject, priority, prompt, category, urgent, summary, llm_status, llm_fingerprint"


def rows(project) -> list[tuple]:
    return project.query(f"select {COLUMNS} from main.triage order by ticket_id")


def provider_calls(emulator) -> int:
    return sum(emulator.stats()["calls"].values())


def merged(project, emulator, model: str) -> None:
    project.write("models/triage.sql", model)
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")


def test_a_changed_non_prompt_column_is_refreshed_without_asking_again(project, emulator):
    project.dbt("seed")
    merged(project, emulator, triage_model())
    before = rows(project)
    assert {r[2] for r in before} <= {"low", "normal", "high", "urgent"}
    calls = provider_calls(emulator)
    # A selected column's expression changes; the prompt does not.
    changed = triage_model().replace(
        "select ticket_id, subject, priority,", "select ticket_id, subject, upper(priority) as priority,"
    )
    project.write("models/triage.sql", changed)
    project.dbt("run", "-s", "triage")
    incremental = rows(project)
    assert [r[2] for r in incremental] == [r[2].upper() for r in before], "the new expression's values"
    assert [r[:2] + r[3:] for r in incremental] == [r[:2] + r[3:] for r in before], "answers unchanged"
    assert provider_calls(emulator) == calls, "nothing asked again"
    assert batch_counts(emulator) == [6]
    project.dbt("run", "-s", "triage", "--full-refresh")
    assert rows(project) == incremental, "a full refresh gives the rows the incremental run has"


def priority_as(expression: str, where: str = "") -> str:
    """The triage model with its priority column selected as `expression` (not part of the prompt)."""
    return triage_model(where=where).replace(
        "select ticket_id, subject, priority,", f"select ticket_id, subject, {expression} as priority,"
    )


def test_a_column_changed_while_every_answer_is_in_flight_shows_its_value_when_they_land(project, emulator):
    """A harvest merging every selected key writes each row from the current selection (merge.py then
    skips the refresh of the rows it did not write: there are none)."""
    project.dbt("seed")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    project.write("models/triage.sql", priority_as("upper(priority)"))
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    seeded = dict(project.query("select ticket_id, priority from main.support_tickets"))
    assert {r[0]: r[2] for r in rows(project)} == {k: v.upper() for k, v in seeded.items()}
    assert {r[7] for r in rows(project)} == {"succeeded"}


def test_a_harvest_of_some_keys_refreshes_the_rows_of_the_others(project, emulator):
    """Rows of four keys in the table, two keys' requests in flight, the column changed: the harvest of
    the two writes theirs from the current selection and refreshes the four it did not write."""
    project.dbt("seed")
    merged(project, emulator, triage_model(where="where ticket_id <= 4"))
    project.write("models/triage.sql", priority_as("upper(priority)"))
    project.dbt("run", "-s", "triage")  # sends tickets 5 and 6
    assert batch_counts(emulator) == [4, 2]
    project.write("models/triage.sql", priority_as("'p:' || priority"))
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    seeded = dict(project.query("select ticket_id, priority from main.support_tickets"))
    assert {r[0]: r[2] for r in rows(project)} == {k: "p:" + v for k, v in seeded.items()}
    assert {r[7] for r in rows(project)} == {"succeeded"}


def test_a_stale_answer_keeps_the_prompt_it_was_asked_with(project, emulator):
    """While a changed prompt's new request is in flight, the key keeps its last answer, and the
    prompt column still shows the prompt that answer belongs to (the request's own columns are not
    refreshed); the other columns are."""
    project.dbt("seed")
    merged(project, emulator, triage_model())
    before = {r[0]: r for r in rows(project)}
    changed = (
        triage_model()
        .replace("'Subject: ' || subject", "'Re: ' || subject")
        .replace("select ticket_id, subject, priority,", "select ticket_id, subject, upper(priority) as priority,")
    )
    project.write("models/triage.sql", changed)
    project.dbt("run", "-s", "triage")  # submits the new prompts; the table keeps the old answers
    now = {r[0]: r for r in rows(project)}
    assert all(now[k][3] == before[k][3] and now[k][8] == before[k][8] for k in before), "prompt and answer as asked"
    assert all(now[k][2] == before[k][2].upper() for k in before)
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    final = rows(project)
    assert all(r[3].startswith("Re: ") for r in final)
    assert [r[4:7] for r in final] == [expected_triage(TRIAGE_SYSTEM, r[3]) for r in final]


def test_on_unselected_delete_drops_unselected_keys_and_keeps_their_ledger(project, emulator):
    project.dbt("seed")
    merged(project, emulator, triage_model())
    narrowed = triage_model(where="where ticket_id <= 4")
    project.write("models/triage.sql", narrowed)
    project.dbt("run", "-s", "triage")
    assert [r[0] for r in rows(project)] == [1, 2, 3, 4, 5, 6], "'keep' (the default) keeps them"
    project.write(
        "models/triage.sql", triage_model(extra_config="llm_on_unselected = 'delete',", where="where ticket_id <= 4")
    )
    project.dbt("run", "-s", "triage")
    assert [r[0] for r in rows(project)] == [1, 2, 3, 4]
    kept = project.query(
        """select key, status from main.llm_batch_requests where key in ('["5"]', '["6"]') and answer is not null
           order by key"""
    )
    assert kept == [('["5"]', "succeeded"), ('["6"]', "succeeded")], "the ledger keeps every answer"
    # Selected again: shown again from the ledger, nothing asked.
    project.write("models/triage.sql", triage_model(extra_config="llm_on_unselected = 'delete',"))
    project.dbt("run", "-s", "triage")
    assert [r[0] for r in rows(project)] == [1, 2, 3, 4, 5, 6]
    assert batch_counts(emulator) == [6]
    project.dbt("run", "-s", "triage", "--full-refresh")
    assert [r[0] for r in rows(project)] == [1, 2, 3, 4, 5, 6]


def test_a_full_refresh_writes_only_the_selected_keys_and_an_incremental_run_keeps_the_others(project, emulator):
    """llm_on_unselected = 'keep' (the default) is what incremental runs do with a key the model no
    longer selects; a --full-refresh rebuilds the table for the selected keys only (docs/table.md), so
    it drops such rows, and selecting the key again shows its answer again without asking."""
    project.dbt("seed")
    merged(project, emulator, triage_model())
    everything = rows(project)
    calls = provider_calls(emulator)
    project.write("models/triage.sql", triage_model(where="where ticket_id <= 4"))
    project.dbt("run", "-s", "triage")
    assert rows(project) == everything, "an incremental run keeps the rows of keys no longer selected"
    project.dbt("run", "-s", "triage", "--full-refresh")
    assert rows(project) == everything[:4], "a full refresh writes the selected keys' rows only"
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    assert rows(project) == everything, "selected again: shown again from the ledger"
    assert provider_calls(emulator) == calls, "nothing asked again"
    assert batch_counts(emulator) == [6]
