"""The emulator's newer faults, driven by the real SDKs: validation errors naming lines, ended
retention (404 in each provider's shape), and transport faults (a dropped connection, a body cut off)."""

from __future__ import annotations

import anthropic
import openai
import pytest
from helpers import control, download, line, submit


def test_invalid_line_fault_fails_validation_naming_1_based_lines(emu, client):
    emu.add_fault(
        kind="invalid_line",
        prompt_contains="BAD",
        times=None,
        code="invalid_value",
        message="Invalid value for 'messages'.",
        param="body.messages",
    )
    batch = submit(client, [line("a", "fine"), line("b", "a BAD one"), line("c", "ok"), line("d", "BAD too")])
    emu.advance(batch.id, "completed")
    failed = client.batches.retrieve(batch.id)
    assert failed.status == "failed" and failed.output_file_id is None and failed.request_counts.total == 0
    assert [(e.code, e.line, e.param, e.message) for e in failed.errors.data] == [
        ("invalid_value", 2, "body.messages", "Invalid value for 'messages'."),
        ("invalid_value", 4, "body.messages", "Invalid value for 'messages'."),
    ]


def test_expired_results_answer_404_like_a_missing_file(emu, client):
    batch = submit(client, [line("a", "x")])
    emu.advance(batch.id, "completed")
    done = client.batches.retrieve(batch.id)
    assert [r["custom_id"] for r in download(client, done.output_file_id)] == ["a"]
    control(emu, "POST", f"/_emulator/batches/{batch.id}/expire_results")
    with pytest.raises(openai.NotFoundError) as err:
        client.files.content(done.output_file_id).read()
    assert err.value.body == {
        "message": f"No such File object: {done.output_file_id}",
        "type": "invalid_request_error",
        "param": "id",
        "code": None,
    }
    assert client.batches.retrieve(batch.id).output_file_id == done.output_file_id  # the batch still names it


def test_expired_anthropic_results_are_archived_and_404(emu, claude):
    batch = claude.messages.batches.create(
        requests=[
            {
                "custom_id": "a",
                "params": {"model": "claude-x", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]},
            }
        ]
    )
    with pytest.raises(ValueError, match="has not ended"):
        emu.expire_results(batch.id)
    emu.complete_all()
    emu.expire_results(batch.id)
    assert claude.messages.batches.retrieve(batch.id).archived_at is not None
    with pytest.raises(anthropic.NotFoundError) as err:
        list(claude.messages.batches.results(batch.id))
    assert err.value.body["error"]["type"] == "not_found_error"


def test_disconnect_and_truncate_faults(emu, client):
    emu.add_fault(kind="disconnect", endpoint="GET /v1/batches")
    with pytest.raises(openai.APIConnectionError):
        client.batches.list()
    client.batches.list()  # once only
    batch = submit(client, [line(str(i), "x" * 50) for i in range(20)])
    emu.advance(batch.id, "completed")
    file_id = client.batches.retrieve(batch.id).output_file_id
    emu.add_fault(kind="truncate", endpoint="GET /v1/files/{id}/content")
    with pytest.raises(openai.APIConnectionError):
        client.files.content(file_id).read()
    assert len(download(client, file_id)) == 20
    with pytest.raises(ValueError, match="needs an 'endpoint'"):
        emu.add_fault(kind="truncate")


# A nested schema in OpenAI's strict form: an object with a nullable field, a list of objects, a date.
NESTED = {
    "type": "object",
    "properties": {
        "person": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": ["string", "null"]}},
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "jobs": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"title": {"type": "string"}, "years": {"type": "integer"}},
                "required": ["title", "years"],
                "additionalProperties": False,
            },
        },
        "since": {"type": "string", "format": "date"},
    },
    "required": ["person", "jobs", "since"],
    "additionalProperties": False,
}


def nested_chat(client, prompt: str) -> dict:
    import json

    reply = client.chat.completions.create(
        model="gpt-x",
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": NESTED}},
    )
    return json.loads(reply.choices[0].message.content)


def test_nested_schemas_are_answered_deterministically_and_off_schema_faults_break_them(emu, client, claude):
    import datetime
    import json

    import jsonschema

    from dbt_llm_batch.sandbox import expected_answer

    answers = [nested_chat(client, f"resume {i}") for i in range(6)]
    assert answers == [json.loads(expected_answer(None, f"resume {i}", NESTED)) for i in range(6)]
    for answer in answers:
        jsonschema.validate(answer, NESTED)
        assert len(answer["jobs"]) in (2, 3)
        datetime.date.fromisoformat(answer["since"])
    emails = [a["person"]["email"] for a in answers]
    assert None in emails and any(emails), "a nullable field is null in some answers, set in others"

    control(
        emu, "POST", "/_emulator/faults", {"kind": "off_schema", "code": "missing_required", "prompt_contains": "bad"}
    )
    emu.add_fault(kind="off_schema", code="wrong_item_type", prompt_contains="bad")
    missing, wrong = nested_chat(client, "bad 1"), nested_chat(client, "bad 2")
    assert (
        "name" not in missing["person"]
        and missing["jobs"] == json.loads(expected_answer(None, "bad 1", NESTED))["jobs"]
    )
    assert (
        wrong["jobs"][0] == 12345
        and wrong["jobs"][1:] == json.loads(expected_answer(None, "bad 2", NESTED))["jobs"][1:]
    )
    with pytest.raises(ValueError, match="an 'off_schema' fault needs a 'code'"):
        emu.add_fault(kind="off_schema")

    # Anthropic: the forced tool's input is broken the same way.
    emu.add_fault(kind="off_schema", code="missing_required", prompt_contains="bad")
    message = claude.messages.create(
        model="claude-x",
        max_tokens=500,
        messages=[{"role": "user", "content": "bad 3"}],
        tools=[{"name": "out", "description": "Record.", "input_schema": NESTED}],
        tool_choice={"type": "tool", "name": "out"},
    )
    (tool_use,) = [b for b in message.content if b.type == "tool_use"]
    assert "name" not in tool_use.input["person"]
