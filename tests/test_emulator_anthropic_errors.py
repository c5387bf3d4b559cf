"""Anthropic face errors: synchronous create validation, 413, auth, endpoint and per-request faults,
all in the Anthropic envelope. Real `anthropic` SDK, max_retries=0 except the retry test."""

from __future__ import annotations

import json
import time

import anthropic
import pytest
from helpers import SANDBOX_KEY as KEY
from helpers import raw, req, results_of

from dbt_llm_batch.sandbox import Emulator, expected_answer

# -- create validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "custom_id, message",
    [
        ("has space", "requests.1.custom_id: String should match pattern '^[a-zA-Z0-9_-]{1,64}$'"),
        ("x" * 65, "requests.1.custom_id: String should have at most 64 characters"),
        ("", "requests.1.custom_id: String should have at least 1 character"),
        ("ok", "requests.1.custom_id: Duplicate custom_id"),
    ],
)
def test_bad_custom_id_is_a_synchronous_400(emu, claude, custom_id, message):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.batches.create(requests=[req("ok", "a"), req(custom_id, "b")])
    assert info.value.status_code == 400 and info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.body["error"]["message"].startswith(message)
    assert info.value.body["type"] == "error" and info.value.body["request_id"].startswith("req_")
    assert emu.batches() == []


def test_request_count_limits():
    with Emulator(KEY, max_message_batch_requests=3) as emu:
        claude = anthropic.Anthropic(base_url=emu.base_url, api_key=KEY, max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="at least 1 item"):
            claude.messages.batches.create(requests=[])
        with pytest.raises(anthropic.BadRequestError, match="at most 3 items"):
            claude.messages.batches.create(requests=[req(f"r{i}", "x") for i in range(4)])
        assert (
            claude.messages.batches.create(requests=[req(f"r{i}", "x") for i in range(3)]).request_counts.processing
            == 3
        )


def test_too_large_body_is_413_before_auth():
    with Emulator(KEY, max_batch_bytes=2000) as emu:
        claude = anthropic.Anthropic(base_url=emu.base_url, api_key=KEY, max_retries=0)
        with pytest.raises(anthropic.RequestTooLargeError) as info:
            claude.messages.batches.create(requests=[req(f"r{i}", "x" * 100) for i in range(20)])
        assert info.value.status_code == 413 and info.value.body["error"]["type"] == "request_too_large"
        status, _, _ = raw(
            emu,
            "POST",
            "/v1/messages/batches",
            {"x-api-key": "wrong"},
            {"requests": [req(f"r{i}", "x" * 100) for i in range(20)]},
        )
        assert status == 413
        assert claude.messages.batches.create(requests=[req("small", "x")]).processing_status == "in_progress"


# -- faults -------------------------------------------------------------------------------


def test_request_faults_become_errored_or_altered_lines(emu, claude):
    emu.add_fault(prompt_contains="BAD", kind="http_error", status_code=500, message="Internal server error")
    emu.add_fault(prompt_contains="ODD", kind="content", content="not json")
    batch = claude.messages.batches.create(
        requests=[req("good", "fine"), req("bad", "a BAD one"), req("odd", "ODD", tool=True)]
    )
    emu.advance(batch.id, "ended")
    results = results_of(claude, batch.id)
    assert results["bad"].type == "errored"
    assert (results["bad"].error.error.type, results["bad"].error.error.message) == (
        "api_error",
        "Internal server error",
    )
    assert results["odd"].message.content[0].text == "not json"  # not a JSON object: no tool call came back
    assert results["good"].message.content[0].text == expected_answer(None, "fine", None)


def test_529_endpoint_fault_is_retried_by_the_sdk_after_retry_after(emu):
    emu.add_fault(endpoint="POST /v1/messages/batches", status_code=529, times=1, retry_after=0.3)
    retrying = anthropic.Anthropic(base_url=emu.base_url, api_key=KEY, max_retries=2)
    started = time.monotonic()
    batch = retrying.messages.batches.create(requests=[req("a", "x")])
    assert time.monotonic() - started >= 0.3 and batch.processing_status == "in_progress"
    assert emu.stats()["calls"]["POST /v1/messages/batches"] == 2 and emu.stats()["batches_created"] == 1


@pytest.mark.parametrize(
    "status, error_class, error_type",
    [
        (529, anthropic.OverloadedError, "overloaded_error"),
        (429, anthropic.RateLimitError, "rate_limit_error"),
        (500, anthropic.InternalServerError, "api_error"),
    ],
)
def test_endpoint_faults_use_the_anthropic_envelope(emu, claude, status, error_class, error_type):
    emu.add_fault(endpoint="GET /v1/messages/batches", status_code=status, retry_after=1)
    with pytest.raises(error_class) as info:
        claude.messages.batches.list()
    assert info.value.status_code == status and info.value.body["error"]["type"] == error_type
    assert info.value.response.headers["retry-after"] == "1"
    assert claude.messages.batches.list().data == []


# -- auth -----------------------------------------------------------------------------------


def test_auth_accepts_x_api_key_and_bearer_and_rejects_others(emu, claude):
    assert claude.messages.batches.list().data == []  # the SDK sends Authorization: Bearer
    status, headers, body = raw(
        emu, "GET", "/v1/messages/batches", {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    )
    assert status == 200 and json.loads(body) == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    assert headers["request-id"].startswith("req_")
    bad = anthropic.Anthropic(base_url=emu.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.batches.list()
    assert info.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid x-api-key"},
        "request_id": info.value.body["request_id"],
    }
    assert info.value.request_id == info.value.body["request_id"]
    status, _, body = raw(emu, "GET", "/v1/messages/batches", {"x-api-key": "sk-wrong"})
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, _, body = raw(emu, "GET", "/v1/messages/batches")
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, _, body = raw(emu, "GET", "/v1/messages/nothing", {"x-api-key": KEY})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
