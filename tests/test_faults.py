"""Provider outcomes and transport failures, through the emulator and real dbt runs: validation errors
that name lines, the token-limit back-off, results whose retention ended, throttling inside the
per-run retry budget, cut-off downloads, held Anthropic submissions, and odd result files."""

from __future__ import annotations

import os
import time

import anthropic
import openai
import pytest
from helpers import (
    append_result_lines,
    assert_all_succeeded,
    batch_counts,
    end_backoff,
    line_for_an_unknown_custom_id,
    log_text,
    result_lines,
    run,
    setup,
    sorted_batches,
    table,
)
from helpers import request_statuses as statuses

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError

RESULTS_ENDPOINT = {"openai": "GET /v1/files/{id}/content", "anthropic": "GET /v1/messages/batches/{id}/results"}
POLL_ENDPOINT = {"openai": "GET /v1/batches/{id}", "anthropic": "GET /v1/messages/batches/{id}"}


# -- 1. validation errors that name lines -------------------------------------------------------

NOT_RETRIED = (
    " (not retried: the provider rejected this request line itself, which would be rejected again; "
    "fix the prompt or the model's config)"
)


def test_lines_named_by_validation_fail_alone_the_rest_resubmit(project, emulator):
    setup(project, "openai", "llm_max_attempts=1,")
    emulator.add_fault(
        kind="invalid_line",
        prompt_contains="row 2",
        times=None,
        code="invalid_value",
        message="Invalid value for 'messages[1].content': rejected by the test.",
    )
    emulator.add_fault(kind="invalid_line", prompt_contains="row 4", times=None, message="Line 4 is bad.")
    run(project)
    emulator.complete_all()
    first = sorted_batches(emulator)[0]
    assert first["status"] == "failed"
    # The lines the provider named are the 1-based positions, in the uploaded file, of rows 2 and 4,
    # and the ledger recorded each request's line in that file.
    lines = sorted(e["line"] for e in first["errors"]["data"])
    prompt_of_line = dict(
        project.query("select file_line, json_extract_string(row_json, '$.prompt') from main.llm_batch_requests")
    )
    assert sorted(prompt_of_line) == [1, 2, 3, 4, 5, 6]
    assert sorted(prompt_of_line[n] for n in lines) == ["row 2", "row 4"]

    run(project)  # harvest: rows 2 and 4 fail with the provider's message; the others go again
    assert table(project) == {
        2: (
            "failed",
            "invalid_value: Invalid value for 'messages[1].content': rejected by the test." + NOT_RETRIED,
            None,
        ),
        4: ("failed", "invalid_request: Line 4 is bad." + NOT_RETRIED, None),
    }
    assert batch_counts(emulator) == [6, 4], "exactly the rows not at fault are resubmitted"
    voided = project.query("select count(*), min(error) from main.llm_batch_requests where status = 'voided'")
    assert voided == [
        (4, "the batch failed validation on other request lines; this request was not at fault and is resubmitted")
    ]
    emulator.complete_all()
    run(project)
    final = table(project)
    assert [a for a, v in sorted(final.items()) if v[0] == "succeeded"] == [0, 1, 3, 5]
    # The resubmitted rows used no attempt: with llm_max_attempts=1 they still succeeded.
    assert project.query("select count(*) from main.llm_batch_requests where status = 'failed'") == [(2,)]


# -- 2. token_limit_exceeded back-off --------------------------------------------------------------


def backoff_seconds(project) -> list[float]:
    return [
        r[0]
        for r in project.query(
            """select distinct round(epoch(not_before) - epoch(completed_at)) from main.llm_batch_requests
           where status = 'voided' and not_before > now() order by 1"""
        )
    ]


def test_token_limit_backs_off_doubling_then_resubmits_without_using_attempts(project, emulator):
    setup(project, "openai", "llm_max_attempts=1,")
    emulator.add_fault(kind="token_limit", times=2)
    run(project)
    emulator.complete_all()
    run(project)  # harvest: voided with a 10-minute back-off; nothing resubmitted in this run
    assert batch_counts(emulator) == [6]
    assert backoff_seconds(project) == [600]
    assert "its 6 request(s) will be resubmitted after" in log_text(project)
    run(project)  # still backing off
    assert batch_counts(emulator) == [6]
    assert (
        "6 request(s) wait for a back-off (token limit, or a failed batch) and will be resubmitted after"
        in log_text(project)
    )
    assert "pending 0; waiting 6 (back-off)" in log_text(project), "the run line shows what waits"
    assert project.query("select requests_pending, requests_waiting from main.llm_batch_progress") == [(0, 6)]

    end_backoff(project)
    run(project)
    assert batch_counts(emulator) == [6, 6]
    emulator.complete_all()
    run(project)  # the second consecutive token-limit failure doubles the wait
    assert backoff_seconds(project) == [1200]
    end_backoff(project)
    run(project)
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)
    assert batch_counts(emulator) == [6, 6, 6]
    assert project.query("select count(*) from main.llm_batch_requests where status = 'failed'") == [(0,)]


def test_backoff_schedule_is_capped():
    from dbt_llm_batch.pipeline.batch_failures import backoff_seconds as schedule

    assert [schedule(n) for n in (1, 2, 3, 6, 7, 20)] == [600, 1200, 2400, 19200, 6 * 3600, 6 * 3600]


# -- 3. retention ended --------------------------------------------------------------------------

RETENTION = "results no longer retrievable at the provider (retention ended); resubmitted"


def test_results_gone_are_resubmitted_and_stored_results_kept(project, emulator, provider):
    # Files are kept at the provider here (llm_delete_provider_files) so their retention can end.
    setup(project, provider, "llm_delete_provider_files=false,")
    run(project)
    emulator.complete_all()
    first = sorted_batches(emulator)[0]["id"]
    emulator.expire_results(first)
    run(project)  # nothing can be fetched: every request is voided and sent again in the same run
    assert f"batch {first}: {RETENTION}" in log_text(project)
    assert project.query("select count(*), min(error) from main.llm_batch_requests where status = 'voided'") == [
        (6, RETENTION)
    ]
    assert batch_counts(emulator) == [6, 6]
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)
    # Stored results outlive the provider's retention: a full refresh rebuilds from the ledger alone.
    emulator.expire_results(sorted_batches(emulator)[1]["id"])
    before, calls = project.query("select * from main.m order by a"), emulator.stats()["calls"]
    project.dbt("run", "-s", "m", "--full-refresh")
    assert project.query("select * from main.m order by a") == before
    assert emulator.stats()["calls"] == calls


def test_an_archived_anthropic_batch_has_its_results_gone_whatever_the_results_endpoint_says(project, emulator):
    """Anthropic Message Batches: `archived_at` is set once the results are no longer available; which
    status the results endpoint then answers is not documented. The run trusts `archived_at` and does
    not ask for the results (here the endpoint would answer a 500, a transient outage to the run)."""
    setup(project, "anthropic", "llm_delete_provider_files=false,")
    run(project)
    emulator.complete_all()
    first = sorted_batches(emulator)[0]["id"]
    emulator.archived_results_status = 500
    emulator.expire_results(first)
    run(project)
    assert f"batch {first}: {RETENTION}" in log_text(project)
    assert emulator.stats()["calls"].get(RESULTS_ENDPOINT["anthropic"], 0) == 0
    assert project.query("select count(*), min(error) from main.llm_batch_requests where status = 'voided'") == [
        (6, RETENTION)
    ]
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)


def test_a_deleted_error_file_loses_only_its_own_lines(project, emulator):
    setup(project, "openai")
    emulator.add_fault(prompt_contains="row 3", status_code=500, message="Upstream failure.", times=1)
    run(project)
    emulator.complete_all()
    batch = sorted_batches(emulator)[0]
    client = openai.OpenAI(base_url=emulator.openai_base_url, api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
    client.files.delete(batch["error_file_id"])  # gone; the output file is still there
    run(project)
    assert sorted(table(project)) == [0, 1, 2, 4, 5], "the output file's answers are stored and merged"
    assert project.query("select error from main.llm_batch_requests where status = 'voided'") == [(RETENTION,)]
    assert batch_counts(emulator) == [6, 1]
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)


def test_a_deleted_anthropic_batch_is_held_for_a_day_then_resubmitted(project, emulator):
    setup(project, "anthropic")
    run(project)
    emulator.complete_all()
    batch_id = sorted_batches(emulator)[0]["id"]
    claude = anthropic.Anthropic(base_url=emulator.base_url, api_key=os.environ["ANTHROPIC_API_KEY"], max_retries=0)
    claude.messages.batches.delete(batch_id)
    run(project)  # a day-old batch cannot have vanished by retention: a key mismatch is likelier
    assert "does not exist; it was created less than a day ago, so it is left pending" in log_text(project)
    # Nothing was resubmitted: the emulator's list (which keeps deleted batches for tests) has just that one.
    assert statuses(project) == [("queued", 6)] and batch_counts(emulator) == [6]
    project.release_database()
    project.query("update main.llm_batch_jobs set created_at = created_at - interval 26 hour")
    run(project)
    assert project.query("select count(*), min(error) from main.llm_batch_requests where status = 'voided'") == [
        (6, RETENTION)
    ]
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)


# -- 4. throttling and outages inside the per-run budget; cut-off downloads -----------------------


def test_a_provider_failing_past_the_budget_leaves_work_pending(project, emulator, provider):
    setup(project, provider, "llm_retry_budget_seconds=1,")
    run(project)
    emulator.complete_all()
    emulator.add_fault(
        endpoint=POLL_ENDPOINT[provider], status_code=503 if provider == "openai" else 529, retry_after=0.3, times=None
    )
    project.write(
        "models/things.sql",
        "select * from (values " + ", ".join(f"({i}, 'row {i}')" for i in range(8)) + ") t(a, prompt)",
    )  # 2 new rows
    project.dbt("run", "-s", "things")
    polls_before = emulator.stats()["calls"].get(POLL_ENDPOINT[provider], 0)
    run(project)  # succeeds, with a warning; nothing voided, nothing new submitted
    # Bounded by the budget, not by the machine's speed: retry-after 0.3 s within a 1 s budget leaves
    # room for at most 1 + floor(1 / 0.3) = 4 calls, and a spent budget makes later calls fail fast.
    assert 1 <= emulator.stats()["calls"][POLL_ENDPOINT[provider]] - polls_before <= 4
    assert "the provider kept failing for llm_retry_budget_seconds=1" in log_text(project)
    assert statuses(project) == [("queued", 6)]
    assert project.query("select count(*) from main.m") == [(0,)]
    assert batch_counts(emulator) == [6]
    emulator.clear_faults()
    run(project)
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project, rows=8)


def test_throttling_within_the_budget_is_retried_honouring_retry_after(project, emulator, provider):
    setup(project, provider)
    run(project)
    emulator.complete_all()
    emulator.add_fault(endpoint=POLL_ENDPOINT[provider], status_code=429, retry_after=1, times=2)
    started = time.monotonic()
    run(project)
    assert time.monotonic() - started >= 2, "retry-after was honoured twice"
    assert emulator.faults() == []
    assert_all_succeeded(project)


def test_a_cut_off_download_stores_nothing_then_stores_once(project, emulator, provider):
    setup(project, provider, "llm_retry_budget_seconds=1,")
    run(project)
    emulator.complete_all()
    emulator.add_fault(kind="truncate", endpoint=RESULTS_ENDPOINT[provider], times=None)
    run(project)
    assert project.query("select count(*) from main.llm_batch_results") == [(0,)], "nothing half-stored"
    assert statuses(project) == [("queued", 6)]
    emulator.clear_faults()
    emulator.add_fault(kind="truncate", endpoint=RESULTS_ENDPOINT[provider], times=1)  # once: retried in-run
    run(project)
    assert emulator.faults() == []
    assert project.query("select count(*), count(distinct custom_id) from main.llm_batch_results") == [(6, 6)]
    assert_all_succeeded(project)
    run(project)
    assert project.query("select count(*) from main.llm_batch_results") == [(6,)]


def test_retry_budget_is_validated():
    with pytest.raises(ConfigError, match=r"llm_retry_budget_seconds must be >= 0, got -1"):
        parse_config({"unique_key": "a", "llm_model": "m", "llm_retry_budget_seconds": -1})
    assert parse_config({"unique_key": "a", "llm_model": "m"}).retry_budget_seconds == 300


# -- 5. held Anthropic submissions -----------------------------------------------------------------


def test_an_anthropic_create_that_failed_with_no_batch_to_show_is_resubmitted(project, emulator):
    """A 5xx on create proves nothing, but the provider's batch list does: with no batch created since
    the intent that could be this submission, the next run sends its requests again (not a day later)."""
    setup(project, "anthropic")
    emulator.add_fault(endpoint="POST /v1/messages/batches", status_code=500, times=1)
    run(project)  # the create failed with a 5xx: it may have reached the provider; the run goes on
    assert "creating a batch failed (HTTP 500" in log_text(project)
    assert project.query("select status, batch_id from main.llm_batch_jobs") == [("submitting", None)]
    run(project)  # no batch of 6 requests was created since: nothing to wait for
    assert batch_counts(emulator) == [6]
    assert "held, not resent" not in log_text(project)
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)


def test_an_anthropic_create_whose_answer_was_lost_is_adopted(project, emulator):
    setup(project, "anthropic")
    emulator.add_fault(kind="truncate", endpoint="POST /v1/messages/batches", times=1)  # created, answer cut
    run(project)
    assert batch_counts(emulator) == [6]
    run(project)  # the candidate has not ended: held
    assert project.query("select status from main.llm_batch_jobs") == [("submitting",)]
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)
    assert batch_counts(emulator) == [6]


def test_a_create_refused_with_429_is_resubmitted_next_run(project, emulator, provider):
    endpoint = "POST /v1/batches" if provider == "openai" else "POST /v1/messages/batches"
    setup(project, provider)
    emulator.add_fault(endpoint=endpoint, status_code=429, retry_after=30, times=1)
    run(project)
    assert project.query("select status from main.llm_batch_jobs") == [("voided",)]
    assert statuses(project) == [("voided", 6)]
    run(project)
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)


# -- odd result files ------------------------------------------------------------------------------


def test_unknown_and_duplicate_result_lines_never_merge_twice_or_wrongly(project, emulator, provider):
    setup(project, provider)
    run(project)
    emulator.complete_all()
    batch = sorted_batches(emulator)[0]
    existing = result_lines(emulator, batch)
    stranger = line_for_an_unknown_custom_id(existing[0])
    append_result_lines(emulator, batch, [existing[1], stranger])
    run(project)
    assert_all_succeeded(project)
    assert "1 result line(s) for custom_ids their batch never sent were ignored" in log_text(project)
    assert project.query("select count(*) from main.llm_batch_requests where status = 'succeeded'") == [(6,)]


def test_completed_with_every_request_failed_has_no_output_file(project, emulator):
    setup(project, "openai", "llm_max_attempts=1,")
    emulator.add_fault(prompt_contains="row", status_code=500, message="Upstream failure.", times=None)
    run(project)
    emulator.complete_all()
    batch = sorted_batches(emulator)[0]
    assert batch["status"] == "completed" and batch["output_file_id"] is None
    run(project)
    assert table(project) == {i: ("failed", "Upstream failure.", None) for i in range(6)}


# -- the retry budget itself (fake clock: exact waits) ------------------------------------------------


class FakeStatusError(Exception):
    def __init__(self, status, headers=None):
        super().__init__(f"status {status}")
        self.status_code = status
        self.response = type("R", (), {"headers": headers or {}})()


def test_call_budget_honours_retry_after_backs_off_and_gives_up_at_the_budget():
    from dbt_llm_batch.providers.calls import CallBudget, ProviderUnavailable

    now, slept = [0.0], []

    def sleep(s):
        slept.append(s)
        now[0] += s

    budget = CallBudget(10, sleep=sleep, clock=lambda: now[0])
    failures = iter([FakeStatusError(429, {"retry-after": "3"}), FakeStatusError(503), FakeStatusError(500)])

    def flaky():
        failure = next(failures, None)
        if failure:
            raise failure
        return "ok"

    assert budget.call("poll", flaky) == "ok"
    assert slept == [3.0, 1.0, 2.0]  # the provider's retry-after, then exponential back-off

    with pytest.raises(FakeStatusError):  # a 400 is not retried
        budget.call("poll", lambda: (_ for _ in ()).throw(FakeStatusError(400)))

    def always_503():
        raise FakeStatusError(503, {"retry-after-ms": "2500"})

    with pytest.raises(ProviderUnavailable, match="poll: HTTP 503"):
        budget.call("poll", always_503)
    assert now[0] <= 10  # never waits past the budget, counted from the first failure
    with pytest.raises(ProviderUnavailable, match="skipped, the retry budget is spent"):
        budget.call("download", lambda: "never called")
