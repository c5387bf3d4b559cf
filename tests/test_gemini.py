"""llm_provider = 'gemini' through real dbt against the sandbox's Gemini face, driven by google-genai
over HTTP: a run submits and returns, a later run merges every row; a lost create answer or a run
SIGKILLed right after the create pays nothing twice (the job is found again by its display name); an
expired or failed job keeps its finished results and only the rest are sent again; the table's cost is
the usage the face billed at Gemini's batch price."""

from __future__ import annotations

import collections
from decimal import Decimal

import pytest
from conftest import failure_messages
from helpers import GEMINI_MODEL, assert_triage_rows_answered, end_backoff, gemini_triage_model, kill_then_run_on

# Gemini's prices per million tokens (input, output), as prices.csv ships them; the Batch API takes 50 % off.
PRICES = {"gemini-2.5-flash": (Decimal("0.30"), Decimal("2.50"))}
(PRICE_IN, PRICE_OUT), BATCH = PRICES[GEMINI_MODEL], Decimal("0.5")


def gemini_batches(emulator) -> list[dict]:
    return [b for b in reversed(emulator.batches()) if b.get("object") == "gemini_batch"]  # creation order


def billed_per_prompt(emulator) -> collections.Counter:
    emulator.complete_all()  # a job the last run left behind bills when it ends
    return collections.Counter(b["prompt"] for b in emulator.billed() if b["face"] == "gemini")


def billed_cost(emulator) -> Decimal:
    usage = emulator.stats()["usage_by_face"]["gemini"]
    tokens_in, tokens_out = usage["promptTokenCount"], usage["candidatesTokenCount"]
    return (tokens_in * PRICE_IN + tokens_out * PRICE_OUT) / Decimal(1_000_000) * BATCH


def assert_cost_is_what_was_billed(project, emulator) -> None:
    table = project.query("select sum(llm_cost_usd) from main.triage")[0][0]
    ledger = project.query("select sum(cost_usd) from main.llm_batch_requests")[0][0]
    assert table == ledger == billed_cost(emulator) > 0


@pytest.mark.parametrize("mode", ["inline", "file"])
def test_a_run_submits_and_returns_and_a_later_run_merges_every_row(gemini_project, emulator, mode):
    project = gemini_project
    project.write("models/triage.sql", gemini_triage_model(f"llm_gemini_input = '{mode}',"))
    project.dbt("run", "-s", "triage")
    (batch,) = gemini_batches(emulator)
    assert batch["metadata"]["state"] == "BATCH_STATE_PENDING"
    assert batch["metadata"]["displayName"].startswith("dbt_llm_batch-")  # the ledger's job id
    assert project.query("select requests_pending, rows_pending from main.llm_batch_progress") == [(6, 6)]
    uploads = emulator.stats()["calls"].get("POST /gemini/upload/{version}/files", 0)
    assert uploads == (0 if mode == "inline" else 2)  # a resumable upload is a start and a finalize

    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert_triage_rows_answered(project)
    assert project.query("select distinct status, provider from main.llm_batch_jobs") == [
        ("JOB_STATE_SUCCEEDED", "gemini")
    ]
    assert_cost_is_what_was_billed(project, emulator)
    # What the provider keeps is deleted once the results are stored: the job and (file mode) both files.
    face = {f.name: f for f in emulator.faces}["gemini"]
    assert face.jobs == {} and face.files == {}
    project.dbt("run", "-s", "triage")  # nothing new: nothing asked again
    assert len(gemini_batches(emulator)) == 1


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_create_that_answered_500_is_adopted_by_its_display_name_or_sent_once(gemini_project, emulator, when):
    """A 500 to the create says nothing about the job: `after` the handler it exists at the provider,
    `before` it does not. The next run lists the jobs back by display name: it adopts the one that
    exists, or voids the submission and creates one; either way one job, each request billed once."""
    project = gemini_project
    emulator.add_fault(endpoint="POST /gemini/{version}/models/{model}:batchGenerateContent", when=when)
    project.dbt("run", "-s", "triage")
    assert len(gemini_batches(emulator)) == (1 if when == "after" else 0)
    assert project.query("select status from main.llm_batch_jobs") == [("submitting",)]
    project.dbt("run", "-s", "triage")  # reconciliation: adopt (after) or void and resubmit (before)
    assert len(gemini_batches(emulator)) == 1
    live = project.query("select status, batch_id from main.llm_batch_jobs where status <> 'voided'")
    assert live == [("JOB_STATE_PENDING", gemini_batches(emulator)[0]["name"])]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert_triage_rows_answered(project)
    assert set(billed_per_prompt(emulator).values()) == {1}
    assert_cost_is_what_was_billed(project, emulator)


def test_a_run_killed_right_after_create_pays_nothing_twice(gemini_project, emulator, tmp_path):
    project = gemini_project
    kill_then_run_on(project, emulator, tmp_path / "marker", "after_create")
    assert_triage_rows_answered(project)
    assert len(gemini_batches(emulator)) == 1  # the killed run's job was adopted, not created again
    billed = billed_per_prompt(emulator)
    assert len(billed) == 6 and set(billed.values()) == {1}
    assert_cost_is_what_was_billed(project, emulator)


def test_an_expired_job_keeps_its_finished_results_and_resends_the_rest(gemini_project, emulator):
    project = gemini_project
    project.dbt("run", "-s", "triage")
    (first,) = gemini_batches(emulator)
    emulator.advance(first["name"], "expired", done_fraction=0.5)  # 3 of 6 requests ran before it expired
    project.dbt("run", "-s", "triage")
    assert project.query("select llm_status, count(*) from main.triage group by 1") == [("succeeded", 3)]
    assert project.query("select rows_pending from main.llm_batch_progress") == [(3,)]
    second = gemini_batches(emulator)[1]
    assert second["metadata"]["batchStats"]["requestCount"] == "3"  # only the unfinished ones
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert_triage_rows_answered(project)
    billed = billed_per_prompt(emulator)
    assert len(billed) == 6 and set(billed.values()) == {1}
    assert_cost_is_what_was_billed(project, emulator)
    # The unfinished requests were voided (sent again without using an attempt), none failed.
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1 order by 1") == [
        ("succeeded", 6),
        ("voided", 3),
    ]


def test_poll_harvests_a_gemini_job_between_runs_and_the_next_run_merges_without_a_call(
    gemini_project, emulator, capsys
):
    from dbt_llm_batch.ops.cli import main as cli
    from dbt_llm_batch.ops.poller import EXIT_DONE

    project = gemini_project
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    capsys.readouterr()
    assert cli(["poll", "--database", str(project.db_path)]) == EXIT_DONE, capsys.readouterr().out
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1") == [("succeeded", 6)]
    calls = dict(emulator.stats()["calls"])
    project.dbt("run", "-s", "triage")
    assert_triage_rows_answered(project)
    assert dict(emulator.stats()["calls"]) == calls  # merged from the ledger: no provider call
    assert_cost_is_what_was_billed(project, emulator)


def test_a_failed_job_keeps_its_finished_results_and_resends_the_rest_after_a_back_off(gemini_project, emulator):
    """JOB_STATE_FAILED names no request: like an OpenAI batch that failed as a whole, its unanswered
    requests are resubmitted after a growing back-off (and given up after 3 such failures in a row),
    not at once by every run while the provider keeps failing them."""
    project = gemini_project
    project.dbt("run", "-s", "triage")
    (first,) = gemini_batches(emulator)
    emulator.advance(first["name"], "failed", done_fraction=0.5)  # 3 of 6 requests ran before it failed
    project.dbt("run", "-s", "triage")
    assert project.query("select llm_status, count(*) from main.triage group by 1") == [("succeeded", 3)]
    assert len(gemini_batches(emulator)) == 1  # the other 3 wait out the back-off
    waiting = project.query(
        "select count(*) from main.llm_batch_requests where status = 'voided' and not_before > now()"
    )
    assert waiting == [(3,)]
    end_backoff(project)
    project.dbt("run", "-s", "triage")
    assert gemini_batches(emulator)[1]["metadata"]["batchStats"]["requestCount"] == "3"
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert_triage_rows_answered(project)
    billed = billed_per_prompt(emulator)
    assert len(billed) == 6 and set(billed.values()) == {1}
    assert_cost_is_what_was_billed(project, emulator)


def test_a_config_key_gemini_refuses_fails_the_model_before_anything_is_sent(gemini_project, emulator):
    """llm_gemini_input and the schema subset are the provider's own checks, run by dbt's parse of
    the model's config: the message says what to write, and Gemini is never called."""
    project = gemini_project
    project.write("models/triage.sql", gemini_triage_model("llm_gemini_input = 'bucket',"))
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "llm_gemini_input must be one of ['auto', 'inline', 'file'], got 'bucket'" in message
    assert emulator.stats()["calls"] == {}
