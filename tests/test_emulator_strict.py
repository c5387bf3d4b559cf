"""The sandbox is as strict as the providers, driven by the real SDKs (max_retries=0): faults that
follow the provider's own commit, non-JSON proxy pages, sandbox bugs that fail the test, request-body
and schema validation, provider size limits, expiry and retention, queue limits, cache TTLs and
per-model minimums, nullable usage details, archived batches."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest
from test_emulator import line, submit
from test_emulator_anthropic import MODEL, req, results_of

from helpers import SANDBOX_KEY as KEY


@pytest.fixture
def client(emu):
    return openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=0)


@pytest.fixture
def claude(emu):
    return anthropic.Anthropic(base_url=emu.base_url, api_key=KEY, max_retries=0)


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
    assert stats["realtime_requests"] == {"openai": 1, "anthropic": 1}
    assert stats["usage_by_face"]["openai"]["prompt_tokens"] > 0
    assert stats["usage_by_face"]["anthropic"]["input_tokens"] > 0
    assert [(b["face"], b["via"], b["prompt"]) for b in emu.billed()] == [
        ("openai", "realtime", "billed anyway"), ("anthropic", "realtime", "also billed")]


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
