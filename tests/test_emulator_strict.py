"""The sandbox is as strict as the providers, driven by the real SDKs (max_retries=0): faults that
follow the provider's own commit, non-JSON proxy pages, sandbox bugs that fail the test, request-body
and schema validation, provider size limits, expiry and retention, queue limits, cache TTLs and
per-model minimums, nullable usage details, archived batches."""

from __future__ import annotations

import json
import re

import anthropic
import openai
import pytest
from helpers import CLAUDE_MODEL as MODEL
from helpers import line, req, results_of, submit


def chat(prompt="hi", **extra):
    return {"model": "gpt-x", "messages": [{"role": "user", "content": prompt}], **extra}


# -- 1. faults after the handler ran ----------------------------------------------------------


def test_after_fault_on_batch_create_leaves_the_created_batch_listed(emu, client):
    """OpenAI Batch API: `create` is not idempotent; a 5xx or a dropped connection can follow a batch the
    provider created. The client sees the failure, and the batch is in the list all the same."""
    f = client.files.create(file=("in.jsonl", (json.dumps(line("a", "x")) + "\n").encode()), purpose="batch")
    emu.add_fault(endpoint="POST /v1/batches", status_code=500, when="after")
    with pytest.raises(openai.InternalServerError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [b.input_file_id for b in client.batches.list()] == [f.id]

    emu.add_fault(endpoint="POST /v1/batches", kind="disconnect", when="after")
    with pytest.raises(openai.APIConnectionError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert len(client.batches.list().data) == 2
    # The default stays "before": nothing is created.
    emu.add_fault(endpoint="POST /v1/batches", status_code=500)
    with pytest.raises(openai.InternalServerError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert len(client.batches.list().data) == 2


def test_after_fault_on_a_message_batch_create_leaves_it_listed(emu, claude):
    """Anthropic Message Batches: a batch exists as soon as the create was processed, whatever reached
    the client."""
    emu.add_fault(endpoint="POST /v1/messages/batches", status_code=529, when="after")
    with pytest.raises(anthropic.InternalServerError):
        claude.messages.batches.create(requests=[req("a", "x")])
    assert [b.request_counts.processing for b in claude.messages.batches.list()] == [1]


def test_after_fault_on_a_realtime_call_is_billed(emu, client, claude):
    """OpenAI and Anthropic bill a request the model answered, even if a gateway timeout or a reset then
    kept the answer from the client."""
    emu.add_fault(endpoint="POST /v1/chat/completions", status_code=504, when="after")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(**chat("billed anyway"))
    emu.add_fault(endpoint="POST /v1/messages", kind="disconnect", when="after")
    with pytest.raises(anthropic.APIConnectionError):
        claude.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "also billed"}])
    emu.add_fault(endpoint="POST /v1/chat/completions", status_code=500)  # before: never answered
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(**chat("not billed"))
    stats = emu.stats()
    assert {f: n for f, n in stats["realtime_requests"].items() if n} == {"openai": 1, "anthropic": 1}
    assert stats["usage_by_face"]["openai"]["prompt_tokens"] > 0
    assert stats["usage_by_face"]["anthropic"]["input_tokens"] > 0
    assert [(b["face"], b["via"], b["prompt"]) for b in emu.billed()] == [
        ("openai", "realtime", "billed anyway"),
        ("anthropic", "realtime", "also billed"),
    ]


def test_a_billed_line_names_its_request_by_digest_whichever_way_it_was_sent(emu, client, claude):
    """The same request body, asked in realtime and in a batch, is billed twice under one digest (how a
    test counts a request paid twice); a different body has another digest; each line has its tokens."""
    answer = client.chat.completions.create(**chat("same question"))
    client.chat.completions.create(**chat("another question"))
    batch = submit(client, [{**line("a", "x"), "body": chat("same question")}])
    emu.complete(batch.id)
    message = claude.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "q"}])
    claude_batch = claude.messages.batches.create(
        requests=[
            {
                "custom_id": "b",
                "params": {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "q"}]},
            }
        ]
    )
    emu.complete(claude_batch.id)

    billed = emu.billed()
    digests = [b["request"] for b in billed]
    assert digests[0] == digests[2] != digests[1] and digests[3] == digests[4] != digests[0]
    assert [b["via"] for b in billed] == ["realtime", "realtime", "batch", "realtime", "batch"]
    assert billed[0]["usage"]["prompt_tokens"] == answer.usage.prompt_tokens > 0
    assert billed[0]["usage"]["completion_tokens"] == answer.usage.completion_tokens > 0
    assert billed[3]["usage"]["output_tokens"] == message.usage.output_tokens > 0


def test_when_is_checked(emu):
    with pytest.raises(ValueError, match="'when'"):
        emu.add_fault(endpoint="POST /v1/batches", when="later")
    with pytest.raises(ValueError, match="endpoint"):
        emu.add_fault(kind="http_error", prompt_contains="x", when="after")


# -- 5. a proxy's non-JSON 413 ---------------------------------------------------------------


def test_proxy_error_fault_answers_an_html_413(emu, claude):
    """Anthropic errors docs: a 413 request_too_large is returned by Cloudflare before the API, so its
    body may not be the JSON error envelope."""
    emu.add_fault(endpoint="POST /v1/messages/batches", kind="proxy_error")
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.batches.create(requests=[req("a", "x")])
    assert caught.value.status_code == 413
    assert caught.value.response.headers["content-type"] == "text/html"
    with pytest.raises(ValueError):
        json.loads(caught.value.response.text)
    assert "413 Request Entity Too Large" in caught.value.response.text
    assert claude.messages.batches.list().data == []  # "before" by default: nothing was created


# -- 6. a sandbox bug fails the test -----------------------------------------------------------


def _break(emu, route_key):
    def boom(req):
        raise RuntimeError("a bug in the sandbox")

    emu._routes = [(f, m, r, k, boom if k == route_key else h) for f, m, r, k, h in emu._routes]


def test_a_sandbox_bug_is_recorded_and_answered_in_the_face_envelope(emu, client, claude):
    _break(emu, "GET /v1/messages/batches/{id}")
    _break(emu, "GET /v1/batches/{id}")
    with pytest.raises(anthropic.InternalServerError) as ant:
        claude.messages.batches.retrieve("msgbatch_x")
    assert ant.value.body["type"] == "error" and ant.value.body["error"]["type"] == "api_error"
    with pytest.raises(openai.InternalServerError) as oai:
        client.batches.retrieve("batch_x")
    assert oai.value.body["type"] == "server_error"
    assert len(emu.internal_errors) == 2
    with pytest.raises(AssertionError, match="RuntimeError: a bug in the sandbox"):
        emu.raise_internal_errors()
    emu.internal_errors.clear()  # the fixture would fail this test at teardown otherwise


# -- 2. request bodies and schemas ---------------------------------------------------------------

STRICT_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["a", "b"]}, "n": {"type": "integer"}},
    "required": ["label", "n"],
    "additionalProperties": False,
}


def strict_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "llm_output", "strict": strict, "schema": schema}}


def test_openai_refuses_unknown_parameters_realtime_and_in_a_batch(emu, client):
    """OpenAI Chat Completions API: an argument it does not know (`top_k` is Anthropic's) is a 400
    "Unrecognized request argument supplied"; in a batch, that line lands in the error file."""
    for extra in ({"top_k": 5}, {"bogus": True}):
        with pytest.raises(
            openai.BadRequestError, match=f"Unrecognized request argument supplied: {next(iter(extra))}"
        ):
            client.chat.completions.create(**chat(), extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="'temperature'"):
        client.chat.completions.create(**chat(temperature=2.5))
    batch = submit(client, [line("good", "x", temperature=0.2), line("bad", "y", top_k=3)])
    emu.advance(batch.id, "completed")
    done = client.batches.retrieve(batch.id)
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    [err] = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["message"] == "Unrecognized request argument supplied: top_k"


@pytest.mark.parametrize(
    "schema,message",
    [
        (
            {**STRICT_SCHEMA, "required": ["label"]},
            "'required' is required to be supplied and to be an array including every key in properties. Missing 'n'",
        ),
        (
            {k: v for k, v in STRICT_SCHEMA.items() if k != "additionalProperties"},
            "'additionalProperties' is required to be supplied and to be false",
        ),
        (
            {
                **STRICT_SCHEMA,
                "properties": {
                    **STRICT_SCHEMA["properties"],
                    "tags": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
                },
                "required": ["label", "n", "tags"],
            },
            "'uniqueItems' is not permitted",
        ),
        ({"type": "array", "items": {"type": "string"}}, "schema must be a JSON Schema of 'type: \"object\"'"),
        ({**STRICT_SCHEMA, "properties": {"label": {"type": "strin"}, "n": {"type": "integer"}}}, "is not valid under"),
    ],
)
def test_openai_strict_json_schema_rules(client, schema, message):
    """OpenAI structured outputs guide: with `strict: true` every object lists all its properties in
    `required` and sets `additionalProperties: false`, the root is an object, some keywords are not
    supported; and any schema must be valid JSON Schema."""
    with pytest.raises(openai.BadRequestError, match=re.escape(message)) as caught:
        client.chat.completions.create(**chat(response_format=strict_format(schema)))
    assert caught.value.param == "response_format"


def test_openai_accepts_the_plugins_strict_schema_and_a_loose_one_without_strict(client):
    """What the plugin sends (every property required, no extras) passes; without `strict` OpenAI does
    not apply the strict-mode rules."""
    answer = client.chat.completions.create(**chat(response_format=strict_format(STRICT_SCHEMA)))
    assert json.loads(answer.choices[0].message.content).keys() == {"label", "n"}
    loose = {"type": "object", "properties": {"label": {"type": "string"}}}
    assert client.chat.completions.create(**chat(response_format=strict_format(loose, strict=False))).choices
    with pytest.raises(openai.BadRequestError, match="additionalProperties"):
        client.chat.completions.create(**chat(response_format=strict_format(loose)))


def test_anthropic_refuses_unknown_params_and_bad_tool_schemas(emu, claude):
    """Anthropic Messages API: an unknown field is a 400 "Extra inputs are not permitted"; a tool's
    `input_schema` must be a JSON Schema (draft 2020-12) of type object. Realtime that is a 400; in a
    batch, params are checked asynchronously and the request ends `errored`."""
    with pytest.raises(anthropic.BadRequestError, match="bogus: Extra inputs are not permitted"):
        claude.messages.create(
            model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}], extra_body={"bogus": 1}
        )
    bad_type = {"name": "t", "input_schema": {"type": "array", "items": {"type": "string"}}}
    invalid = {"name": "t", "input_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}
    choice = {"type": "tool", "name": "t"}
    batch = claude.messages.batches.create(
        requests=[
            req("ok", "x", temperature=0.5, top_k=5),
            req("bogus", "x", bogus=True),
            req("hot", "x", temperature=1.5),
            req("array", "x", tools=[bad_type], tool_choice=choice),
            req("invalid", "x", tools=[invalid], tool_choice=choice),
        ]
    )
    emu.advance(batch.id, "ended")
    results = results_of(claude, batch.id)
    assert results["ok"].type == "succeeded"
    errors = {cid: r.error.error.message for cid, r in results.items() if r.type == "errored"}
    assert errors["bogus"] == "bogus: Extra inputs are not permitted"
    assert errors["hot"].startswith("temperature: Input should be less than or equal to 1")
    assert errors["array"] == "tools.0.custom.input_schema.type: Input should be 'object'"
    assert errors["invalid"].startswith("tools.0.custom.input_schema: JSON schema is invalid")
    assert [b["custom_id"] for b in emu.billed()] == ["ok"]  # errored requests are not billed


# -- 3. size limits in decimal megabytes -----------------------------------------------------------


def test_size_limits_are_the_providers_decimal_megabytes(emu, client):
    """OpenAI Batch API: an input file "up to 200 MB"; Anthropic Message Batches: "256 MB" per batch.
    Both are decimal megabytes (the lower reading), so a client that passes the sandbox passes the
    provider. At the limit a file is accepted, one byte over it is refused with "File is too large."."""
    from dbt_llm_batch.providers.anthropic_batch import AnthropicBatchProvider
    from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider
    from dbt_llm_batch.sandbox import Emulator

    fresh = Emulator("k")
    assert (fresh.max_file_bytes, fresh.max_batch_bytes) == (200_000_000, 256_000_000)
    assert OpenAIBatchProvider.max_bytes_per_batch <= fresh.max_file_bytes
    assert AnthropicBatchProvider.max_bytes_per_batch < fresh.max_batch_bytes  # room for the JSON wrapper
    data = (json.dumps(line("a", "x")) + "\n").encode()
    emu.max_file_bytes = len(data)
    assert client.files.create(file=("in.jsonl", data), purpose="batch").bytes == len(data)
    with pytest.raises(openai.BadRequestError, match="File is too large."):
        client.files.create(file=("in.jsonl", data + b"\n"), purpose="batch")


# -- 4. expiry, retention, queue limits --------------------------------------------------------


def test_openai_batch_expires_24h_after_creation(emu, client):
    """OpenAI Batch API: `expires_at` is 24 h after creation; a batch not done by then is `expired`,
    its completed requests stay in the output file and the unfinished ones are batch_expired lines."""
    start = emu.now()
    running = submit(client, [line(f"r{i}", f"q{i}") for i in range(4)])
    waiting = submit(client, [line("w", "never validated")])
    assert running.expires_at == running.created_at + 86400
    emu.advance(running.id, "in_progress", done_fraction=0.5)
    emu.now = lambda: start + 86400 + 5
    expired = client.batches.retrieve(running.id)
    assert expired.status == "expired" and expired.expired_at == expired.expires_at
    assert (expired.request_counts.completed, expired.request_counts.failed) == (2, 2)
    errors = [json.loads(x) for x in client.files.content(expired.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(client.files.content(expired.output_file_id).text.splitlines()) == 2
    never = client.batches.retrieve(waiting.id)
    assert never.status == "expired" and never.request_counts.failed == 1 and never.output_file_id is None
    assert len(emu.billed()) == 2  # only the completed requests are billed


def test_openai_files_are_deleted_when_their_retention_ends(emu, client):
    """OpenAI Files API: a purpose=batch file expires 30 days after upload by default;
    `output_expires_after` sets the result files' expiry, anchored at their creation. Then they 404."""
    start = emu.now()
    batch = submit(client, [line("a", "x")], output_expires_after={"anchor": "created_at", "seconds": 3600})
    emu.advance(batch.id, "completed")
    done = client.batches.retrieve(batch.id)
    assert client.files.content(done.output_file_id).text
    emu.now = lambda: start + 3601
    with pytest.raises(openai.NotFoundError):
        client.files.content(done.output_file_id)
    assert client.files.retrieve(done.input_file_id).id == done.input_file_id
    emu.now = lambda: start + 30 * 86400 + 1
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(done.input_file_id)
    assert emu.file_bytes(done.output_file_id)  # the test oracle keeps it


def test_openai_enqueued_token_limit_per_model_fails_the_batch(emu, client):
    """OpenAI Batch API: prompt tokens enqueued per model are limited organisation-wide; a batch over
    the limit fails validation with token_limit_exceeded (create itself succeeds); other models and
    batches created after the queue drained are not affected."""
    emu.openai_enqueued_token_limit = 10
    first = submit(client, [line("a", "x" * 28)])  # 7 tokens
    emu.advance(first.id, "in_progress")
    over = submit(client, [line("b", "y" * 16)])  # 4 more: 11 > 10
    emu.advance(over.id, "completed")
    failed = client.batches.retrieve(over.id)
    assert failed.status == "failed" and failed.errors.data[0].code == "token_limit_exceeded"
    assert "Limit: 10 enqueued tokens" in failed.errors.data[0].message
    other_model = submit(client, [line("c", "y" * 16, model="gpt-other")])
    assert emu.advance(other_model.id, "completed")["status"] == "completed"
    emu.advance(first.id, "completed")
    again = submit(client, [line("b", "y" * 16)])
    assert emu.advance(again.id, "completed")["status"] == "completed"


def test_anthropic_queued_request_cap_refuses_a_create_with_429(emu, claude):
    """Anthropic rate limits: a workspace has a cap on batch requests in the processing queue, over all
    models; a create that would pass it is refused (429)."""
    emu.anthropic_max_queued_requests = 3
    first = claude.messages.batches.create(requests=[req("a", "x"), req("b", "y")])
    with pytest.raises(anthropic.RateLimitError, match="processing queue"):
        claude.messages.batches.create(requests=[req("c", "x"), req("d", "y")])
    assert claude.messages.batches.create(requests=[req("c", "x")]).processing_status == "in_progress"
    emu.complete_all()
    assert claude.messages.batches.create(requests=[req("e", "x"), req("f", "y")]).id != first.id


# -- 5. shapes: null usage details, cache TTLs and minimums -----------------------------------------


def test_null_usage_details_like_a_vllm_server(emu, client, claude):
    """vLLM's OpenAI-compatible server leaves `prompt_tokens_details` null unless started with
    --enable-prompt-tokens-details; Anthropic's SDK types the `cache_*` usage fields optional."""
    emu.null_usage_details = True
    usage = client.chat.completions.create(**chat()).usage
    assert usage.prompt_tokens > 0 and usage.prompt_tokens_details is None and usage.completion_tokens_details is None
    u = claude.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}]).usage
    assert u.input_tokens > 0 and (u.cache_read_input_tokens, u.cache_creation_input_tokens, u.cache_creation) == (
        None,
        None,
        None,
    )


def test_openai_cache_expires_after_inactivity_on_the_emulator_clock(emu, client):
    """OpenAI prompt caching guide: a cached prefix stays active for 5 to 10 minutes of inactivity;
    each hit refreshes it. The sandbox keeps an unused prefix `openai_cache_ttl_seconds` (300)."""
    start = emu.now()
    body = {"model": "gpt-x", "messages": [{"role": "system", "content": "S" * 8192}, {"role": "user", "content": "q"}]}
    cached = lambda: client.chat.completions.create(**body).usage.prompt_tokens_details.cached_tokens  # noqa: E731
    assert cached() == 0
    emu.now = lambda: start + 299
    assert cached() == 2048
    emu.now = lambda: start + 299 + 299  # refreshed by the last hit
    assert cached() == 2048
    emu.now = lambda: start + 299 + 299 + 301
    assert cached() == 0


def test_anthropic_cache_minimum_is_per_model(emu, claude):
    """Anthropic prompt caching docs: the minimum cacheable prompt is 1,024 tokens for Sonnet and Opus
    models and 2,048 for Haiku models; a shorter marked prefix is not cached."""
    system = [{"type": "text", "text": "S" * 6000, "cache_control": {"type": "ephemeral"}}]  # 1,500 tokens
    usage = {}
    for model in ("claude-sonnet-4-5", "claude-haiku-4-5"):
        for _ in range(2):
            usage[model] = claude.messages.create(
                model=model, max_tokens=20, system=system, messages=[{"role": "user", "content": "q"}]
            ).usage
    assert usage["claude-sonnet-4-5"].cache_read_input_tokens == 1500
    assert (
        usage["claude-haiku-4-5"].cache_read_input_tokens,
        usage["claude-haiku-4-5"].cache_creation_input_tokens,
    ) == (0, 0)
