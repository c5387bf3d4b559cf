"""Kill a real `dbt run` (SIGKILL) at each named point of a run; later runs must finish the work
with nothing billed twice and nothing the provider returned missing from the ledger."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import (
    TRIAGE_SYSTEM,
    assert_triage_rows_answered,
    billed_per_key,
    dbt_subprocess,
    expected_triage,
    is_anthropic,
    kill_then_run_on,
    sorted_batches,
    succeeded_custom_ids,
    triage_model,
)

from dbt_llm_batch.pipeline.crashpoints import POINTS

HARVEST_POINTS = ("after_download", "after_store", "before_merge")


CASES = [
    (provider, point)
    for provider in ("openai", "anthropic")
    for point in POINTS
    if not (provider == "anthropic" and point == "after_upload")  # Anthropic has no upload step
    and point != "after_realtime_group"
    and point != "before_merge_insert"  # only a merge showing stored rows reaches it: its own test below
    and point != "after_create"  # every batch provider's: tests/conformance (test_a_run_killed_at_a_crash_point...)
]  # the realtime path's crash test is in test_realtime.py


@pytest.mark.parametrize("provider_name,point", CASES)
def test_a_killed_run_is_finished_by_later_runs(project, emulator, provider_name, point, tmp_path):
    project.write("models/triage.sql", triage_model(provider=provider_name))
    project.dbt("seed")
    if point in HARVEST_POINTS:  # die in the run that harvests, not the one that submits
        project.dbt("run", "-s", "triage")
        emulator.complete_all()
    kill_then_run_on(project, emulator, tmp_path / "crash-marker", point)

    rows = project.query("""select t.ticket_id, s.subject, s.body, t.category, t.urgent, t.summary, t.llm_status
                            from main.triage t join main.support_tickets s using (ticket_id) order by 1""")
    assert len(rows) == 6
    for _, subject, body, category, urgent, summary, status in rows:
        assert status == "succeeded"
        assert (category, urgent, summary) == expected_triage(TRIAGE_SYSTEM, f"Subject: {subject}\n\n{body}")
    # Nothing lost: every result the provider returned is stored in the ledger.
    returned = succeeded_custom_ids(emulator)
    stored = {r[0] for r in project.query("select custom_id from main.llm_batch_results")}
    assert set(returned) <= stored
    # Nothing billed twice: each key was billed exactly once, counting every batch (finished first) and call.
    key_of_prompt = {f"Subject: {subject}\n\n{body}": key for key, subject, body, *_ in rows}
    billed = billed_per_key(emulator, key_of_prompt)
    assert sorted(billed.values()) == [1] * 6 and set(billed) == set(key_of_prompt.values()), billed


# A model whose plan splits into three batches of two: each provider's per-batch request limit is set
# to 2 inside the killed dbt process (the tests' own runs set it with monkeypatch).
SMALL_BATCHES = """
import sys
from dbt_llm_batch.providers.anthropic_batch import AnthropicBatchProvider
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider
OpenAIBatchProvider.max_requests_per_batch = AnthropicBatchProvider.max_requests_per_batch = 2
from dbt.cli.main import dbtRunner
sys.exit(0 if dbtRunner().invoke(sys.argv[1:]).success else 1)
"""


@pytest.mark.parametrize("provider_name", ["openai", "anthropic"])
@pytest.mark.parametrize("point,occurrence", [("after_create", 1), ("after_create", 2), ("after_intents", 1)])
def test_a_run_killed_between_two_chunks_bills_each_key_once(
    project, emulator, provider_name, point, occurrence, tmp_path, monkeypatch
):
    from dbt_llm_batch.providers.anthropic_batch import AnthropicBatchProvider
    from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

    for cls in (OpenAIBatchProvider, AnthropicBatchProvider):
        monkeypatch.setattr(cls, "max_requests_per_batch", 2)
    project.write("models/triage.sql", triage_model(provider=provider_name))
    project.dbt("seed")
    marker = tmp_path / "crash-marker"
    project.release_database()
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            SMALL_BATCHES,
            "run",
            "-s",
            "triage",
            "--project-dir",
            str(project.root),
            "--profiles-dir",
            str(project.root),
        ],
        env={
            **os.environ,
            "DBT_LLM_BATCH_CRASH_AT": point,
            "DBT_LLM_BATCH_CRASH_OCCURRENCE": str(occurrence),
            "DBT_LLM_BATCH_CRASH_MARKER": str(marker),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stdout[-2000:]
    assert marker.read_text() == point
    # Killed right after chunk k's create: k batches exist, none of the later chunks was sent.
    created = occurrence if point == "after_create" else 0
    assert [sum(b["request_counts"].values()) if is_anthropic(b) else None for b in sorted_batches(emulator)] == [
        (2 if provider_name == "anthropic" else None)
    ] * created

    for _ in range(3):
        project.dbt("run", "-s", "triage")
        emulator.complete_all()
    project.dbt("run", "-s", "triage")

    assert_triage_rows_answered(project)
    # Each key billed exactly once, counting every batch (finished first) and call.
    key_of_prompt = {
        f"Subject: {s}\n\n{b}": k
        for k, s, b in project.query("select ticket_id, subject, body from main.support_tickets")
    }
    billed = billed_per_key(emulator, key_of_prompt)
    assert sorted(billed.values()) == [1] * 6 and set(billed) == set(key_of_prompt.values()), billed
    assert sum(1 for _ in sorted_batches(emulator)) == 3, "three batches of two, none sent twice"


def test_a_run_killed_between_widening_the_merge_and_its_insert_changes_nothing(project, emulator, tmp_path):
    """A merge that shows some rows' stored rows (here: keys no longer selected when their answers land)
    adds the stored values' columns to its scratch table before the insert. Killed there, the table
    and the row answers are as before the run; the next run writes every row, each prompt billed once."""
    terse = TRIAGE_SYSTEM + " Be terse."
    project.write("models/triage.sql", triage_model())
    project.dbt("seed")
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")  # six rows answered
    project.write("models/triage.sql", triage_model(system=terse))
    project.dbt("run", "-s", "triage")  # every row asked again, in flight
    project.write("models/triage.sql", triage_model(system=terse, where="where ticket_id <= 3"))
    emulator.complete_all()
    table = "select * from main.triage order by ticket_id"
    shown = "select key, custom_id, emitted from main.llm_batch_row_answers order by all"
    before = project.query(table), project.query(shown)
    assert len(before[0]) == 6

    project.release_database()
    marker = tmp_path / "crash-marker"
    killed = dbt_subprocess(
        project, {"DBT_LLM_BATCH_CRASH_AT": "before_merge_insert", "DBT_LLM_BATCH_CRASH_MARKER": str(marker)}
    )
    assert killed.returncode == -9, killed.stdout[-2000:]
    assert marker.read_text() == "before_merge_insert"
    assert (project.query(table), project.query(shown)) == before  # the merge's transaction never committed

    project.dbt("run", "-s", "triage")
    rows = project.query("""select t.ticket_id, s.subject, t.subject, s.body, t.category, t.urgent, t.summary, t.llm_status
                            from main.triage t join main.support_tickets s using (ticket_id) order by 1""")
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]  # the unselected keys' rows kept, with their new answers
    for _, subject, shown_subject, body, category, urgent, summary, status in rows:
        assert (status, shown_subject) == ("succeeded", subject)
        assert (category, urgent, summary) == expected_triage(terse, f"Subject: {subject}\n\n{body}")
    # Each key billed twice (once per system prompt), twelve lines sent: nothing asked again after the kill.
    key_of_prompt = {f"Subject: {s}\n\n{b}": k for k, s, _, b, *_ in rows}
    assert billed_per_key(emulator, key_of_prompt) == {k: 2 for k in range(1, 7)}
    assert emulator.stats()["request_lines"] == 12
