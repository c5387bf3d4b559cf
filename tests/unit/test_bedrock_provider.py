"""The Bedrock provider on its own: its keys validated by itself, its request lines in Bedrock's
batch format (Claude's InvokeModel body), its result lines (batch output and Converse replies) read
into outcomes, and what it says without AWS credentials."""

from __future__ import annotations

import json

import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers import BatchProvider, get_provider

MODEL = "anthropic.claude-haiku-4-5-20251001-v1:0"
AWS_CHAIN = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
RAW = {
    "unique_key": "id",
    "llm_provider": "bedrock",
    "llm_model": MODEL,
    "llm_system": "Triage.",
    "llm_output": {"urgent": "boolean"},
    "llm_max_tokens": 50,
    "llm_bedrock_s3_input": "s3://bucket/in/",
    "llm_bedrock_s3_output": "s3://bucket/out",
    "llm_bedrock_role_arn": "arn:aws:iam::123456789012:role/batch",
}


def provider(**overrides):
    return get_provider("bedrock")(parse_config({**RAW, **overrides}))


def test_capabilities_and_the_100_record_minimum():
    cls = get_provider("bedrock")
    assert issubclass(cls, BatchProvider) and cls.has_realtime and not cls.self_hosted
    assert (cls.min_requests_per_batch, cls.max_requests_per_batch) == (100, 50_000)
    assert provider().under_minimum() == "wait"
    assert provider(llm_bedrock_under_minimum="realtime").under_minimum() == "realtime"


def test_its_keys_are_validated_by_itself_every_problem_at_once():
    with pytest.raises(ConfigError) as error:
        parse_config(
            {
                **RAW,
                "llm_bedrock_s3_input": "bucket/in",
                "llm_bedrock_role_arn": "my-role",
                "llm_bedrock_region": "mars",
                "llm_bedrock_under_minimum": "never",
            }
        )
    message = str(error.value)
    assert "llm_bedrock_s3_input must be an S3 location 's3://<bucket>/<prefix>/'" in message
    assert "got 'bucket/in'" in message
    assert "llm_bedrock_role_arn must be the ARN of the IAM service role" in message and "got 'my-role'" in message
    with pytest.raises(ConfigError, match="llm_provider 'bedrock' needs llm_bedrock_s3_output: an S3 location"):
        parse_config({**RAW, "llm_bedrock_s3_output": None})
    assert "llm_bedrock_region must be an AWS region such as 'us-east-1', got 'mars'" in message
    assert "llm_bedrock_under_minimum must be 'wait' or 'realtime', got 'never'" in message
    with pytest.raises(ConfigError, match="llm_bedrock_s3_input is only for llm_provider 'bedrock'"):
        parse_config(
            {"unique_key": "id", "llm_provider": "openai", "llm_model": "m", "llm_bedrock_s3_input": "s3://b/x"}
        )
    with pytest.raises(ConfigError, match="supports Anthropic Claude models"):
        provider(llm_model="meta.llama3-70b-instruct-v1:0")


def test_a_request_line_is_a_record_with_claudes_invoke_model_body(memory_con):
    p = provider(llm_cache_prefix="5m")
    line = memory_con.execute(
        f"select {p.request_line_sql()} from (select 'r_0a1b' as custom_id, 'the ticket' as prompt)"
    ).fetchall()[0][0]
    record = json.loads(line)
    assert record["recordId"] == "r0a1b"  # alphanumeric, as Bedrock documents record ids
    body = record["modelInput"]
    assert body["anthropic_version"] == "bedrock-2023-05-31" and "model" not in body
    assert body["messages"] == [{"role": "user", "content": "the ticket"}]
    assert body["tool_choice"] == {"type": "tool", "name": "llm_output"}
    assert "cache_control" not in line  # not offered in batch jobs


def outcomes(memory_con, p, lines: list[str]) -> list[tuple]:
    structure = json.dumps(p.result_structure)
    memory_con.execute("create or replace table lines (line varchar)")
    memory_con.executemany("insert into lines values (?)", [[x] for x in lines])
    return memory_con.execute(
        f"select {p.outcomes_sql('r')} from (select json_transform(line, '{structure}') as r from lines) order by 1"
    ).fetchall()


def test_output_lines_read_into_outcomes(memory_con):
    p = provider()
    ok = {
        "recordId": "r0a",
        "modelInput": {},
        "modelOutput": {
            "content": [{"type": "tool_use", "name": "llm_output", "input": {"urgent": True}}],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 12, "output_tokens": 3},
        },
    }
    failed = {"recordId": "r0b", "modelInput": {}, "error": {"errorCode": 400, "errorMessage": "bad request"}}
    rows = outcomes(memory_con, p, [json.dumps(ok), json.dumps(failed)])
    assert [r[:8] for r in rows] == [
        ("r_0a", "ok", '{"urgent":true}', "tool_use", False, None, 12, 3),
        ("r_0b", "error", None, None, False, "bad request", None, None),
    ]
    assert rows[1][10].startswith("not retried") and rows[0][10] is None


def test_a_converse_reply_becomes_an_output_line(memory_con):
    p = provider()
    reply = {
        "output": {
            "message": {
                "role": "assistant",
                "content": [{"toolUse": {"toolUseId": "t", "name": "llm_output", "input": {"urgent": False}}}],
            }
        },
        "stopReason": "tool_use",
        "usage": {"inputTokens": 20, "outputTokens": 4, "totalTokens": 24},
    }
    lines = [
        p.realtime_result_line("r_0c", 200, json.dumps(reply)),
        p.realtime_result_line("r_0d", 429, json.dumps({"message": "Too many requests"})),
    ]
    rows = outcomes(memory_con, p, lines)
    assert [r[:8] for r in rows] == [
        ("r_0c", "ok", '{"urgent":false}', "tool_use", False, None, 20, 4),
        ("r_0d", "error", None, None, False, "Too many requests", None, None),
    ]
    assert rows[1][10] is None  # a throttle is retried
    body = p.realtime_body()
    assert body["toolConfig"]["toolChoice"] == {"tool": {"name": "llm_output"}}
    assert body["inferenceConfig"] == {"maxTokens": 50} and body["system"] == [{"text": "Triage."}]


def test_without_aws_credentials_nothing_is_sent_and_the_chain_is_named(monkeypatch, tmp_path):
    for name in (*AWS_CHAIN, "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ConfigError, match="no AWS credentials found for llm_provider 'bedrock'"):
        provider(llm_bedrock_region="us-east-1").check_credentials()
