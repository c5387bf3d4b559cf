"""llm_provider = 'bedrock' through real dbt against the sandbox's Bedrock face (boto3 over HTTP, S3 in
moto's server mode): a run submits and a later run merges every row; a run SIGKILLed right after the
create pays nothing twice (the job is adopted by its clientRequestToken); an expired, stopped or
failed job keeps what it finished and sends the rest again; the table's cost is the billed usage at
Bedrock's batch price; fewer than 100 requests wait for more rows, or go realtime through Converse."""

from __future__ import annotations

import json
from collections import Counter
from decimal import Decimal

import boto3
import pytest
from conftest import failure_messages
from helpers import TRIAGE_OUTPUT, TRIAGE_SCHEMA, end_backoff, kill_then_run_on, log_text

from dbt_llm_batch.sandbox import expected_answer

MODEL = "anthropic.claude-haiku-4-5-20251001-v1:0"
PRICE = (Decimal("1.00"), Decimal("5.00"))  # the shipped price of anthropic.claude-haiku-4-5, per million
SYSTEM = "Triage the ticket."


def write(project, bucket: str, rows: int, extra: str = "") -> None:
    project.write("models/tickets.sql", f"select i as ticket_id, 'ticket ' || i as prompt from range({rows}) t(i)")
    project.write(
        "models/triage.sql",
        f"""
{{{{ config(
    materialized = 'llm_batch',
    llm_provider = 'bedrock',
    llm_model = '{MODEL}',
    unique_key = 'ticket_id',
    llm_system = {json.dumps(SYSTEM)},
    llm_output = {json.dumps(TRIAGE_OUTPUT)},
    llm_max_tokens = 200,
    llm_bedrock_s3_input = 's3://{bucket}/requests',
    llm_bedrock_s3_output = 's3://{bucket}/results',
    llm_bedrock_role_arn = 'arn:aws:iam::123456789012:role/bedrock-batch',
    {extra}
) }}}}
select ticket_id, prompt from {{{{ ref('tickets') }}}}
""",
    )
    project.dbt("run", "-s", "tickets")


def run(project):
    return project.dbt("run", "-s", "triage")


def jobs(emulator) -> list[dict]:
    return [b for b in emulator.batches() if "jobArn" in b]


def assert_all_answered(project, rows: int) -> None:
    got = project.query("select prompt, category, urgent, summary, llm_status from main.triage")
    assert len(got) == rows
    for prompt, category, urgent, summary, status in got:
        answer = json.loads(expected_answer(SYSTEM, prompt, TRIAGE_SCHEMA))
        assert (status, category, urgent, summary) == (
            "succeeded",
            answer["category"],
            answer["urgent"],
            answer["summary"],
        )


def assert_billed_once_each(emulator, rows: int) -> None:
    billed = Counter(b["prompt"] for b in emulator.billed() if b["face"] == "bedrock")
    assert len(billed) == rows and set(billed.values()) == {1}, billed.most_common(3)


def test_a_run_submits_a_later_run_merges_every_row_at_the_billed_batch_cost(project, emulator, bedrock):
    write(project, bedrock, rows=120)
    run(project)
    (job,) = jobs(emulator)
    assert (job["status"], job["modelId"], job["jobName"]) == ("Submitted", MODEL, job["jobName"])
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1") == [("queued", 120)]
    emulator.complete(job["jobArn"])
    run(project)
    assert_all_answered(project, 120)
    assert_billed_once_each(emulator, 120)

    usage = emulator.stats()["usage_by_face"]["bedrock"]
    billed = (usage["input_tokens"] * PRICE[0] + usage["output_tokens"] * PRICE[1]) / Decimal(1_000_000) / 2
    ((cost, tokens_in, tokens_out),) = project.query(
        "select sum(llm_cost_usd), sum(llm_input_tokens), sum(llm_output_tokens) from main.triage"
    )
    assert (tokens_in, tokens_out) == (usage["input_tokens"], usage["output_tokens"])
    assert cost == billed.quantize(Decimal("1e-9"))
    # llm_delete_provider_files (on by default): the request file and the job's output are gone from S3.
    assert boto3.session.Session().client("s3").list_objects_v2(Bucket=bedrock).get("Contents", []) == []
    run(project)  # nothing new: nothing asked again
    assert len(jobs(emulator)) == 1


@pytest.mark.parametrize("end", ["Expired", "Stopped"])
def test_an_ended_job_keeps_what_it_finished_and_sends_the_rest_again(project, emulator, bedrock, end):
    write(project, bedrock, rows=200)
    run(project)
    (job,) = jobs(emulator)
    emulator.advance(job["jobArn"], "InProgress", 0.5)
    emulator.advance(job["jobArn"], end, 0.5)
    run(project)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(100,)]
    second = jobs(emulator)[0]  # the 100 records it never processed, sent again at once
    assert second["jobArn"] != job["jobArn"]
    emulator.complete(second["jobArn"])
    run(project)
    assert_all_answered(project, 200)
    assert_billed_once_each(emulator, 200)


def test_a_failed_job_keeps_what_it_finished_and_sends_the_rest_again_after_a_back_off(project, emulator, bedrock):
    """`Failed` is a job-level failure that names no record (a role S3 refuses fails every job the same
    way): as for an OpenAI batch or a Gemini job that failed as a whole, its unprocessed records are
    sent again after a growing back-off (given up after 3 such failures in a row), not by every run
    while Bedrock keeps failing them."""
    write(project, bedrock, rows=200)
    run(project)
    (job,) = jobs(emulator)
    emulator.advance(job["jobArn"], "InProgress", 0.5)
    emulator.advance(job["jobArn"], "Failed", 0.5)
    run(project)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(100,)]
    assert len(jobs(emulator)) == 1, "the failed job's records were sent again at once"
    waiting = project.query(
        "select count(*) from main.llm_batch_requests where status = 'voided' and not_before > now()"
    )
    assert waiting == [(100,)]
    end_backoff(project)
    run(project)
    second = jobs(emulator)[0]
    assert second["jobArn"] != job["jobArn"]
    emulator.complete(second["jobArn"])
    run(project)
    assert_all_answered(project, 200)
    assert_billed_once_each(emulator, 200)


def test_a_run_killed_right_after_the_create_pays_nothing_twice(project, emulator, bedrock, tmp_path):
    write(project, bedrock, rows=100)
    kill_then_run_on(project, emulator, tmp_path / "marker", "after_create")
    assert len(jobs(emulator)) == 1  # adopted by its clientRequestToken, never created again
    assert_all_answered(project, 100)
    assert_billed_once_each(emulator, 100)


def test_fewer_than_100_requests_wait_for_more_rows(project, emulator, bedrock):
    write(project, bedrock, rows=40)
    run(project)
    assert jobs(emulator) == [] and emulator.stats()["calls"] == {}
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1") == [("deferred", 40)]
    log = log_text(project)
    assert "40 request(s) wait for more rows: a bedrock batch needs at least 100 requests" in log
    # Nothing is in flight: the in-flight caps are not why they wait, and the run line says so.
    assert "in-flight caps are reached" not in log
    assert "deferred 40 (too few for a batch: waiting for more rows)" in log
    write(project, bedrock, rows=130)
    run(project)
    (job,) = jobs(emulator)
    emulator.complete(job["jobArn"])
    run(project)
    assert_all_answered(project, 130)
    assert_billed_once_each(emulator, 130)


def test_fewer_than_100_requests_go_realtime_through_converse_when_asked(project, emulator, bedrock):
    write(project, bedrock, rows=30, extra="llm_bedrock_under_minimum = 'realtime',")
    run(project)
    assert jobs(emulator) == []
    assert emulator.stats()["realtime_requests"]["bedrock"] == 30
    assert project.query("select distinct llm_route from main.triage") == [("realtime",)]
    assert_all_answered(project, 30)
    usage = emulator.stats()["usage_by_face"]["bedrock"]
    listed = (usage["input_tokens"] * PRICE[0] + usage["output_tokens"] * PRICE[1]) / Decimal(1_000_000)
    assert project.query("select sum(llm_cost_usd) from main.triage") == [(listed.quantize(Decimal("1e-9")),)]


def test_a_create_answered_with_a_5xx_after_the_job_was_made_is_retried_into_the_same_job(project, emulator, bedrock):
    write(project, bedrock, rows=100)
    emulator.add_fault(endpoint="POST /model-invocation-job", when="after", status_code=500)
    run(project)
    (job,) = jobs(emulator)  # the retry carried the same clientRequestToken: the same job
    assert emulator.stats()["calls"]["POST /model-invocation-job"] == 2
    assert project.query("select count(*) from main.llm_batch_jobs where batch_id = ?", [job["jobArn"]]) == [(1,)]
    emulator.complete(job["jobArn"])
    run(project)
    assert_all_answered(project, 100)
    assert_billed_once_each(emulator, 100)


def test_an_s3_location_that_is_not_one_is_called_invalid_not_missing(project):
    """A value given in the wrong form is not a missing one: the message says what form it needs."""
    write(project, "my-bucket", rows=3)
    model = project.root / "models" / "triage.sql"
    model.write_text(model.read_text().replace("'s3://my-bucket/requests'", "'my-bucket/requests'"))
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert (
        "llm_bedrock_s3_input must be an S3 location 's3://<bucket>/<prefix>/' (a bucket name of 3 to 63 "
        "lowercase letters, digits, dots and hyphens), such as 's3://my-bucket/llm/', got 'my-bucket/requests'"
    ) in message
    assert "needs llm_bedrock_s3_input" not in message and "llm_bedrock_s3_output" not in message
