"""Failures a retry cannot fix are not paid for again; failures it can fix are retried. Real dbt runs
against the sandbox; what the sandbox billed (its stats) shows that nothing is paid twice.

- A per-request outcome that the same request would get again (an answer cut off at llm_max_tokens,
  a request the provider rejects as invalid, a refusal) is final at once, with a reason and a fix.
- A line that fails its batch's validation fails alone; the good rows go again after one extra batch.
- A batch that fails naming no line backs off, and gives up after a bound, saying what to do.
- A batch whose output file is stored but whose error file cannot be fetched settles nothing.
"""

from __future__ import annotations

import json

from helpers import (
    assert_all_succeeded,
    batch_counts,
    end_backoff,
    log_text,
    run,
    setup,
    sorted_batches,
    table,
)
from helpers import request_statuses as statuses

from dbt_llm_batch.ops import operator

BILLED_OUTPUT = {"openai": "completion_tokens", "anthropic": "output_tokens"}


def billed_output_tokens(emulator, provider: str) -> int:
    return emulator.stats()["usage_by_face"][provider][BILLED_OUTPUT[provider]]


# -- A. deterministic per-request failures are final at once ---------------------------------------


def test_an_answer_cut_off_at_max_tokens_is_final_at_once_and_paid_once(project, emulator, provider):
    # The sandbox's text answer is 26 characters (7 tokens): llm_max_tokens=3 cuts every answer off.
    setup(project, provider)
    project.write(
        "models/m.sql",
        project.root.joinpath("models/m.sql").read_text().replace("llm_max_tokens=100", "llm_max_tokens=3"),
    )
    run(project)
    emulator.complete_all()
    run(project)
    rows = table(project)
    assert sorted(rows) == list(range(6))
    cut = "length" if provider == "openai" else "max_tokens"
    for status, error, output in rows.values():
        assert (status, output) == ("failed", None)
        assert error == (
            f"answer was cut off at llm_max_tokens=3 (finish reason {cut}); not retried: the same "
            "request would be cut off again. Raise llm_max_tokens (that asks again)"
        )
    assert project.query("select count(*) from main.llm_batch_requests where status = 'failed' and is_final") == [(6,)]
    billed = billed_output_tokens(emulator, provider)
    assert billed == 6 * 3
    for _ in range(2):  # later runs send nothing: the same request would be cut off again
        run(project)
        emulator.complete_all()
    assert batch_counts(emulator) == [6]
    assert billed_output_tokens(emulator, provider) == billed

    # Raising the limit changes the fingerprint: every row is asked again, once, and succeeds.
    project.write(
        "models/m.sql",
        project.root.joinpath("models/m.sql").read_text().replace("llm_max_tokens=3", "llm_max_tokens=100"),
    )
    run(project)
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)
    assert batch_counts(emulator) == [6, 6]


def test_a_request_rejected_as_invalid_is_final_at_once_a_server_error_is_retried(project, emulator, provider):
    setup(project, provider, "llm_max_attempts=2,")
    emulator.add_fault(
        prompt_contains="row 2", status_code=400, message="Invalid 'messages': rejected by the test.", times=None
    )
    emulator.add_fault(prompt_contains="row 3", status_code=500, message="Upstream failure.", times=None)
    run(project)
    emulator.complete_all()
    run(project)  # row 2 is final at once; row 3 (a server error) goes again
    assert batch_counts(emulator) == [6, 1]
    rows = table(project)
    assert rows[2] == (
        "failed",
        "Invalid 'messages': rejected by the test. (not retried: the provider rejected "
        "the request itself, which would be rejected again; fix the prompt or the "
        "model's config)",
        None,
    )
    assert 3 not in rows
    emulator.complete_all()
    run(project)
    assert table(project)[3] == ("failed", "Upstream failure.", None)  # llm_max_attempts=2 used up
    run(project)
    assert batch_counts(emulator) == [6, 1]
    assert emulator.stats()["request_lines"] == 7


def test_a_refusal_is_final_at_once(project, emulator):
    setup(project, "openai")
    run(project)
    emulator.complete_all()
    # The sandbox answers every request; make one answer a refusal (content null, refusal text).
    batch = sorted_batches(emulator)[0]
    face = {f.name: f for f in emulator.faces}["openai"]
    lines = [json.loads(x) for x in face.contents[batch["output_file_id"]].splitlines()]
    for line in lines:
        if (
            line["custom_id"]
            == project.query(
                "select custom_id from main.llm_batch_requests where json_extract_string(row_json, '$.a') = '4'"
            )[0][0]
        ):
            message = line["response"]["body"]["choices"][0]["message"]
            message["content"], message["refusal"] = None, "I can't help with that."
    face.contents[batch["output_file_id"]] = "".join(json.dumps(x) + "\n" for x in lines).encode()
    run(project)
    run(project)
    assert batch_counts(emulator) == [6]
    assert table(project)[4] == (
        "failed",
        "model refused: I can't help with that. (not retried: the same "
        "request would be refused again; change the prompt)",
        None,
    )


# -- B. a line that fails validation fails alone, after one failed batch -------------------------------


def test_a_line_failing_validation_costs_the_good_rows_one_extra_batch(project, emulator):
    setup(project, "openai")  # llm_max_attempts defaults to 3
    emulator.add_fault(
        kind="invalid_line",
        prompt_contains="row 2",
        times=None,
        code="invalid_value",
        message="Invalid value for 'messages[1].content'.",
    )
    run(project)
    emulator.complete_all()
    run(project)  # the named line fails alone and final; the five others go again without it
    assert batch_counts(emulator) == [6, 5]
    assert table(project) == {
        2: (
            "failed",
            "invalid_value: Invalid value for 'messages[1].content'. (not retried: "
            "the provider rejected this request line itself, which would be "
            "rejected again; fix the prompt or the model's config)",
            None,
        )
    }
    emulator.complete_all()
    run(project)
    final = table(project)
    assert [a for a, v in sorted(final.items()) if v[0] == "succeeded"] == [0, 1, 3, 4, 5]
    run(project)
    emulator.complete_all()
    run(project)
    assert batch_counts(emulator) == [6, 5], "the bad line is never sent again"
    assert emulator.stats()["request_lines"] == 11


# -- C. a batch failure that names no line backs off, then gives up ------------------------------------


def test_a_batch_failure_naming_no_line_backs_off_then_gives_up(project, emulator):
    setup(project, "openai")
    emulator.add_fault(
        kind="batch_failed", times=None, code="invalid_file", message="The input file could not be processed."
    )
    run(project)
    emulator.complete_all()
    run(project)  # harvest: voided with a back-off; nothing resubmitted in this run
    assert sorted_batches(emulator)[0]["status"] == "failed"
    assert batch_counts(emulator) == [6]
    waits = project.query(
        "select distinct round(epoch(not_before) - epoch(completed_at)), error "
        "from main.llm_batch_requests where status = 'voided'"
    )
    assert waits == [
        (
            600.0,
            "invalid_file: The input file could not be processed. (the batch failed without "
            "naming a request, 1 time(s) in a row; resubmitted after a 10-minute back-off, "
            "given up after 3)",
        )
    ]
    run(project)
    assert batch_counts(emulator) == [6], "nothing resubmitted during the back-off"
    assert (
        "6 request(s) wait for a back-off (token limit, or a failed batch) and will be resubmitted after"
        in log_text(project)
    )

    end_backoff(project)
    run(project)
    emulator.complete_all()
    run(project)  # the second failure in a row: a longer wait
    assert [
        r[0]
        for r in project.query(
            "select distinct round(epoch(not_before) - epoch(completed_at)) "
            "from main.llm_batch_requests where status = 'voided' "
            "and not_before > now()"
        )
    ] == [1200.0]
    end_backoff(project)
    run(project)
    emulator.complete_all()
    run(project)  # the third: given up; the rows fail, final, saying what the provider said and what to do
    rows = table(project)
    assert sorted(rows) == list(range(6))
    assert {v for v in rows.values()} == {
        (
            "failed",
            "the batch failed at the provider 3 times in a row without naming a request (last: invalid_file: "
            "The input file could not be processed.); not resubmitted. Fix the cause, then run `dbt-llm-batch requeue "
            "--model main.m` to send these rows again",
            None,
        )
    }
    end_backoff(project)
    run(project)
    assert batch_counts(emulator) == [6, 6, 6]
    assert emulator.stats()["usage"]["total_tokens"] == 0, "failed batches bill nothing"
    assert project.query("select sum(cost_usd) from main.llm_batch_requests") == [(0,)]

    # Once the cause is fixed, requeue sends them again.
    emulator.clear_faults()
    project.release_database()
    import duckdb

    with duckdb.connect(str(project.db_path)) as con:
        assert operator.requeue_model(con, "main", "main.m") == (6, 0)
    run(project)
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)
    assert batch_counts(emulator) == [6, 6, 6, 6]


# -- D. an error file that cannot be fetched holds the whole batch --------------------------------------


def test_an_error_file_that_cannot_be_fetched_settles_nothing_of_its_batch(project, emulator):
    setup(project, "openai", "llm_retry_budget_seconds=1,")
    emulator.add_fault(prompt_contains="row 3", status_code=500, message="Upstream failure.", times=1)
    run(project)
    emulator.complete_all()
    batch = sorted_batches(emulator)[0]
    assert batch["output_file_id"] and batch["error_file_id"]
    emulator.add_fault(
        endpoint="GET /v1/files/{id}/content", path_contains=batch["error_file_id"], status_code=503, times=None
    )
    for _ in range(2):
        run(project)  # the output file downloads; the error file keeps failing past the budget
        assert "the provider kept failing for llm_retry_budget_seconds=1" in log_text(project)
        assert statuses(project) == [("queued", 6)], "nothing settled, nothing voided"
        assert project.query("select count(*) from main.m") == [(0,)]
        assert project.query("select harvested_at from main.llm_batch_jobs") == [(None,)]
    emulator.clear_faults()
    run(project)  # both files now: five answers merged, row 3 (a server error) goes again
    assert sorted(table(project)) == [0, 1, 2, 4, 5]
    assert project.query("select count(*), count(distinct custom_id) from main.llm_batch_results") == [(6, 6)]
    assert batch_counts(emulator) == [6, 1]
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)
    assert emulator.stats()["request_lines"] == 7


def test_validation_naming_only_lines_the_batch_never_had_counts_as_naming_none(project, emulator):
    setup(project, "openai")
    emulator.add_fault(kind="invalid_line", prompt_contains="row 2", times=1, message="Line is bad.")
    run(project)
    emulator.complete_all()
    batch = sorted_batches(emulator)[0]
    face = {f.name: f for f in emulator.faces}["openai"]
    face.runs[batch["id"]].obj["errors"]["data"][0]["line"] = 99  # a provider naming a line out of range
    run(project)  # no request is at fault by name: backed off like any failed batch, not resubmitted at once
    assert batch_counts(emulator) == [6]
    assert project.query(
        "select count(*), min(failure_kind) from main.llm_batch_requests where status = 'voided' and not_before > now()"
    ) == [(6, "batch_failed")]
    end_backoff(project)
    run(project)
    emulator.complete_all()
    run(project)
    assert_all_succeeded(project)
    assert batch_counts(emulator) == [6, 6]
