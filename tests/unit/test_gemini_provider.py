"""The Gemini provider on its own: its config key and key variables checked by itself, the output
schema translated to what responseJsonSchema takes (and refused where it would not), request lines in
the Batch API's file shape, and the usage it returns read into the ledger's outcome columns."""

from __future__ import annotations

import json
import sys

import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers import get_provider

BASE = {"unique_key": "id", "llm_provider": "gemini", "llm_model": "gemini-2.5-flash", "llm_system": "Be brief."}


def test_llm_gemini_input_is_validated_by_the_provider():
    with pytest.raises(ConfigError) as error:
        parse_config({**BASE, "llm_gemini_input": "bucket"})
    assert "llm_gemini_input must be one of ['auto', 'inline', 'file'], got 'bucket'" in str(error.value)
    assert parse_config({**BASE, "llm_gemini_input": "file"}).options == {"input": "file"}
    assert parse_config(BASE).options == {"input": "auto"}


def test_either_key_variable_the_sdk_reads_will_do(monkeypatch):
    provider = get_provider("gemini")(parse_config(BASE))
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="neither GEMINI_API_KEY nor GOOGLE_API_KEY is set"):
        provider.check_credentials()
    monkeypatch.setenv("GOOGLE_API_KEY", "k")
    provider.check_credentials()
    monkeypatch.delenv("GOOGLE_API_KEY")
    monkeypatch.setenv("GEMINI_API_KEY", "k")
    provider.check_credentials()


def test_without_the_gemini_extra_the_run_stops_before_sending_and_says_what_to_install(monkeypatch):
    provider = get_provider("gemini")(parse_config(BASE))
    monkeypatch.setenv("GEMINI_API_KEY", "k")
    monkeypatch.setitem(sys.modules, "google.genai", None)  # as if google-genai were not installed
    with pytest.raises(ConfigError) as error:
        provider.check_credentials()
    assert "pip install 'dbt-llm-batch[gemini]'" in str(error.value)


def test_a_schema_responsejsonschema_would_refuse_is_refused_when_the_config_is_parsed():
    with pytest.raises(ConfigError) as error:
        parse_config({**BASE, "llm_output": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}})
    assert "llm_output['code']: Gemini structured output (responseJsonSchema) does not support 'pattern'" in str(
        error.value
    )


def test_request_lines_are_the_batch_file_shape_with_a_nullable_enum_as_gemini_takes_it(memory_con):
    config = parse_config(
        {
            **BASE,
            "llm_output": {"label": {"type": ["string", "null"], "enum": ["a", "b"]}},
            "llm_max_tokens": 50,
            "llm_examples": [{"input": "in", "output": "out"}],
        }
    )
    provider = get_provider("gemini")(config)
    (raw,) = memory_con.execute(
        f"select {provider.request_line_sql()} from (select 'r_1' as custom_id, 'the prompt' as prompt)"
    ).fetchone()
    line = json.loads(raw)
    assert line["key"] == "r_1"
    request = line["request"]
    assert request["contents"] == [
        {"role": "user", "parts": [{"text": "in"}]},
        {"role": "model", "parts": [{"text": "out"}]},
        {"role": "user", "parts": [{"text": "the prompt"}]},
    ]
    assert request["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    generation = request["generationConfig"]
    assert (generation["maxOutputTokens"], generation["responseMimeType"]) == (50, "application/json")
    label = generation["responseJsonSchema"]["properties"]["label"]
    assert label["enum"] == ["a", "b"] and "null" in label["type"]


def test_usage_is_read_with_thinking_as_output_and_cached_tokens_inside_the_prompt(memory_con):
    provider = get_provider("gemini")(parse_config(BASE))
    lines = [
        {
            "key": "r_ok",
            "response": {
                "candidates": [
                    {
                        "content": {"parts": [{"text": "thinking", "thought": True}, {"text": "hello"}]},
                        "finishReason": "STOP",
                    }
                ],
                "usageMetadata": {
                    "promptTokenCount": 100,
                    "cachedContentTokenCount": 40,
                    "candidatesTokenCount": 7,
                    "thoughtsTokenCount": 20,
                },
            },
        },
        {"key": "r_bad", "error": {"code": 400, "message": "bad field", "status": "INVALID_ARGUMENT"}},
        {
            "key": "r_cut",
            "response": {"candidates": [{"finishReason": "SAFETY"}], "usageMetadata": {"promptTokenCount": 3}},
        },
    ]
    memory_con.execute("create table lines (raw varchar)")
    memory_con.executemany("insert into lines values (?)", [[json.dumps(x)] for x in lines])
    structure = json.dumps(provider.result_structure)
    rows = memory_con.execute(
        f"""select custom_id, outcome, answer, input_tokens, output_tokens, cached_tokens, not_retried is not null
            from (select {provider.outcomes_sql("r")} from (select json_transform(raw, '{structure}') as r from lines))
            order by custom_id"""
    ).fetchall()
    assert rows == [
        ("r_bad", "error", None, None, None, None, True),
        ("r_cut", "error", None, 3, 0, None, True),
        ("r_ok", "ok", "hello", 100, 27, 40, False),
    ]


def test_an_llm_params_field_the_sdk_refuses_fails_before_anything_is_sent(memory_con, tmp_path):
    provider = get_provider("gemini")(parse_config({**BASE, "llm_params": {"topQ": 1}}))
    (raw,) = memory_con.execute(
        f"select {provider.request_line_sql()} from (select 'r_1' as custom_id, 'p' as prompt)"
    ).fetchone()
    path = tmp_path / "requests.jsonl"
    path.write_text(raw + "\n")
    with pytest.raises(ConfigError, match="llm_params: the google-genai SDK refuses the Gemini request"):
        provider.upload(str(path), token="job-1")  # inline (auto, small): built before any call
