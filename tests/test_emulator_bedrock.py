"""The sandbox's Amazon Bedrock face, driven by boto3 over HTTP as the provider drives it: the batch
inference control plane (create, get, list, stop), records in S3 (moto's server mode), the
100-record minimum, clientRequestToken idempotency, states, partial output on a stop or expiry,
faults before and after the handler, and Converse."""

from __future__ import annotations

import json

import boto3
import botocore.exceptions
import pytest
from botocore.config import Config

from dbt_llm_batch.sandbox import expected_answer

MODEL = "anthropic.claude-haiku-4-5-20251001-v1:0"
ROLE = "arn:aws:iam::123456789012:role/bedrock-batch"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def control_plane(validate: bool = True):
    config = Config(retries={"total_max_attempts": 1}, parameter_validation=validate)
    return boto3.session.Session().client("bedrock", config=config)


def records(n: int, tool: bool = False) -> list[dict]:
    out = []
    for i in range(n):
        body = {
            "anthropic_version": "bedrock-2023-05-31",
            "max_tokens": 100,
            "system": [{"type": "text", "text": "Count."}],
            "messages": [{"role": "user", "content": f"row {i}"}],
        }
        if tool:
            body["tools"] = [{"name": "llm_output", "input_schema": SCHEMA}]
            body["tool_choice"] = {"type": "tool", "name": "llm_output"}
        out.append({"recordId": f"r{i:05d}", "modelInput": body})
    return out


def put_input(bucket: str, lines: list[dict], key: str = "in/job1.jsonl") -> str:
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    boto3.session.Session().client("s3").put_object(Bucket=bucket, Key=key, Body=body)
    return f"s3://{bucket}/{key}"


def create(client, bucket: str, uri: str, name: str = "job-1", token: str = "tok-1", **extra) -> str:
    return client.create_model_invocation_job(
        jobName=name,
        roleArn=ROLE,
        clientRequestToken=token,
        modelId=MODEL,
        inputDataConfig={"s3InputDataConfig": {"s3Uri": uri, "s3InputFormat": "JSONL"}},
        outputDataConfig={"s3OutputDataConfig": {"s3Uri": f"s3://{bucket}/out/"}},
        **extra,
    )["jobArn"]


def output(bucket: str, arn: str) -> tuple[list[dict], dict | None]:
    s3, job_id = boto3.session.Session().client("s3"), arn.rsplit("/", 1)[-1]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"out/{job_id}/").get("Contents", [])]
    lines, manifest = [], None
    for key in keys:
        data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        if key.endswith("manifest.json.out"):
            manifest = json.loads(data)
        else:
            assert key == f"out/{job_id}/job1.jsonl.out"
            lines += [json.loads(x) for x in data.splitlines()]
    return lines, manifest


def test_a_job_runs_its_records_and_writes_output_and_manifest(emulator, bedrock):
    client = control_plane()
    arn = create(client, bedrock, put_input(bedrock, records(100, tool=True)))
    job = client.get_model_invocation_job(jobIdentifier=arn)
    assert (job["status"], job["jobName"], job["clientRequestToken"]) == ("Submitted", "job-1", "tok-1")
    assert arn.startswith("arn:aws:bedrock:us-east-1:123456789012:model-invocation-job/")
    for stage in ("Validating", "Scheduled", "InProgress"):
        assert emulator.advance(arn)["status"] == stage
    emulator.complete(arn)
    job = client.get_model_invocation_job(jobIdentifier=arn)
    assert (job["status"], job["processedRecordCount"], job["successRecordCount"]) == ("Completed", 100, 100)
    lines, manifest = output(bedrock, arn)
    assert sorted(x["recordId"] for x in lines) == [f"r{i:05d}" for i in range(100)]
    assert [x["recordId"] for x in lines] != [f"r{i:05d}" for i in range(100)]  # order not guaranteed
    first = next(x for x in lines if x["recordId"] == "r00000")
    block = first["modelOutput"]["content"][0]
    assert block["type"] == "tool_use" and json.dumps(block["input"], separators=(",", ":")) == expected_answer(
        "Count.", "row 0", SCHEMA
    )
    assert manifest["processedRecordCount"] == 100
    assert manifest["inputTokenCount"] == sum(x["modelOutput"]["usage"]["input_tokens"] for x in lines)
    assert emulator.stats()["usage_by_face"]["bedrock"]["output_tokens"] == manifest["outputTokenCount"]


def test_the_same_client_request_token_is_the_same_job(emulator, bedrock):
    client = control_plane()
    uri = put_input(bedrock, records(100))
    arn = create(client, bedrock, uri)
    assert create(client, bedrock, uri) == arn
    assert len(client.list_model_invocation_jobs(nameContains="job-1")["invocationJobSummaries"]) == 1
    with pytest.raises(client.exceptions.ConflictException):
        create(client, bedrock, uri, token="another")
    # A fault after the handler: the job exists though the client saw a 500; the retry adopts it.
    emulator.add_fault(endpoint="POST /model-invocation-job", when="after", status_code=500)
    with pytest.raises(botocore.exceptions.ClientError) as failed:
        create(client, bedrock, uri, name="job-2", token="tok-2")
    assert failed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    second = create(client, bedrock, uri, name="job-2", token="tok-2")
    assert [b["id"] for b in emulator.batches()] == [second, arn]
    # A fault before the handler: nothing is created.
    emulator.add_fault(endpoint="POST /model-invocation-job", when="before", status_code=429)
    with pytest.raises(client.exceptions.ThrottlingException):
        create(client, bedrock, uri, name="job-3", token="tok-3")
    assert len(emulator.batches()) == 2


def test_under_100_records_the_job_fails_validation_and_writes_nothing(emulator, bedrock):
    client = control_plane()
    arn = create(client, bedrock, put_input(bedrock, records(99)))
    emulator.advance(arn)  # Validating
    assert emulator.advance(arn)["status"] == "Failed"
    job = client.get_model_invocation_job(jobIdentifier=arn)
    assert "less than the minimum number of records per batch inference job (100)" in job["message"]
    assert output(bedrock, arn) == ([], None)
    assert emulator.billed() == []


def test_a_stopped_or_expired_job_keeps_what_it_processed(emulator, bedrock):
    client = control_plane()
    uri = put_input(bedrock, records(120))
    stopped, expired = create(client, bedrock, uri), create(client, bedrock, uri, name="job-2", token="tok-2")
    for arn in (stopped, expired):
        emulator.advance(arn, "InProgress", 0.5)
    client.stop_model_invocation_job(jobIdentifier=stopped)
    assert client.get_model_invocation_job(jobIdentifier=stopped)["status"] == "Stopping"
    with pytest.raises(client.exceptions.ConflictException):
        client.stop_model_invocation_job(jobIdentifier=stopped)
    emulator.advance(stopped)
    emulator.advance(expired, "Expired", 0.5)
    for arn, status in ((stopped, "Stopped"), (expired, "Expired")):
        job = client.get_model_invocation_job(jobIdentifier=arn)
        assert (job["status"], job["processedRecordCount"], job["totalRecordCount"]) == (status, 60, 120)
        lines, manifest = output(bedrock, arn)
        assert sorted(x["recordId"] for x in lines) == [f"r{i:05d}" for i in range(60)]
        assert manifest["processedRecordCount"] == 60
    assert len(emulator.billed()) == 120


def test_requests_are_checked_as_the_service_model_says(emulator, bedrock):
    client = control_plane(validate=False)  # the service checks, not the SDK
    uri = put_input(bedrock, records(100))
    for bad in ({"name": "bad_name"}, {"token": "bad_token"}, {"timeoutDurationInHours": 12}):
        kwargs = dict(bad)
        with pytest.raises(client.exceptions.ValidationException):
            create(client, bedrock, uri, name=kwargs.pop("name", "job-9"), token=kwargs.pop("token", "tok-9"), **kwargs)
    with pytest.raises(client.exceptions.ValidationException):
        create(client, bedrock, f"s3://{bedrock}/in/missing.jsonl")
    with pytest.raises(client.exceptions.ResourceNotFoundException):
        client.get_model_invocation_job(
            jobIdentifier="arn:aws:bedrock:us-east-1:123456789012:model-invocation-job/abcdefabcdef"
        )
    # A record with a bad body is an error line; the others run (PartiallyCompleted).
    lines = records(100)
    lines[3]["modelInput"]["anthropic_version"] = "2023-06-01"
    arn = create(client, bedrock, put_input(bedrock, lines, "in/job1.jsonl"), name="job-8", token="tok-8")
    emulator.complete(arn)
    assert client.get_model_invocation_job(jobIdentifier=arn)["status"] == "PartiallyCompleted"
    errors = [x for x in output(bedrock, arn)[0] if "error" in x]
    assert [(x["recordId"], x["error"]["errorCode"]) for x in errors] == [("r00003", 400)]
    # The key is the access key id of the signature.
    stranger = boto3.session.Session().client("bedrock", aws_access_key_id="AKIASTRANGER", aws_secret_access_key="x")
    with pytest.raises(botocore.exceptions.ClientError) as denied:
        stranger.list_model_invocation_jobs()
    assert denied.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_converse_answers_with_the_forced_tool(emulator, bedrock):
    runtime = boto3.session.Session().client("bedrock-runtime", config=Config(retries={"total_max_attempts": 1}))
    reply = runtime.converse(
        modelId=MODEL,
        system=[{"text": "Count."}],
        messages=[{"role": "user", "content": [{"text": "row 1"}]}],
        inferenceConfig={"maxTokens": 100},
        toolConfig={
            "tools": [{"toolSpec": {"name": "llm_output", "inputSchema": {"json": SCHEMA}}}],
            "toolChoice": {"tool": {"name": "llm_output"}},
        },
    )
    use = reply["output"]["message"]["content"][0]["toolUse"]
    assert json.dumps(use["input"], separators=(",", ":")) == expected_answer("Count.", "row 1", SCHEMA)
    assert reply["stopReason"] == "tool_use"
    assert emulator.stats()["realtime_requests"]["bedrock"] == 1
