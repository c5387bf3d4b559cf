"""The sandbox emulator, driven over HTTP by the real `openai` SDK.

Clients use max_retries=0 so call counts and errors are exact; only the retry
test lets the SDK retry.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from helpers import SANDBOX_KEY as KEY
from helpers import SCHEMA, control, download, line, submit

from dbt_llm_batch.sandbox import Emulator, expected_answer


def content_of(result):
    return result["response"]["body"]["choices"][0]["message"]["content"]


# -- happy path -------------------------------------------------------------------------


def test_full_lifecycle_and_answers_match_expected_answer(emu, client):
    lines = [line(f"t{i}", f"text prompt {i}", system="Be brief.") for i in range(6)]
    lines += [line(f"j{i}", f"json prompt {i}", schema=SCHEMA) for i in range(6)]
    batch = submit(client, lines, metadata={"run": "nightly"})
    assert batch.status == "validating" and batch.expires_at == batch.created_at + 86400
    assert batch.request_counts.total == 0 and batch.output_file_id is None and batch.usage is None

    emu.advance(batch.id, "in_progress", done_fraction=0.5)
    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.model == "gpt-x"
    assert (running.request_counts.total, running.request_counts.completed) == (12, 6)  # counts grow
    assert client.batches.retrieve(batch.id).output_file_id is None

    emu.advance(batch.id, "finalizing")
    assert client.batches.retrieve(batch.id).request_counts.completed == 12
    emu.advance(batch.id, "completed")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.error_file_id is None and done.errors is None
    assert done.metadata == {"run": "nightly"}
    assert None not in (done.in_progress_at, done.finalizing_at, done.completed_at)
    assert (done.failed_at, done.expired_at, done.cancelled_at) == (None, None, None)

    results = {r["custom_id"]: r for r in download(client, done.output_file_id)}
    assert set(results) == {x["custom_id"] for x in lines}
    for x in lines:
        r = results[x["custom_id"]]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        schema = SCHEMA if x["custom_id"].startswith("j") else None
        system = "Be brief." if schema is None else None
        assert content_of(r) == expected_answer(system, x["body"]["messages"][-1]["content"], schema)
        assert r["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    parsed = json.loads(content_of(results["j0"]))
    assert parsed["label"] in ("pos", "neg", "neutral") and isinstance(parsed["count"], int)
    assert isinstance(parsed["score"], float) and isinstance(parsed["flag"], bool)
    assert parsed["note"].startswith("sandbox-") and parsed["note"].endswith("-note")

    usage = [r["response"]["body"]["usage"] for r in results.values()]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usage)
    assert usage[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    out_file = client.files.retrieve(done.output_file_id)
    assert out_file.purpose == "batch_output" and out_file.bytes > 0
    stats = emu.stats()
    assert stats["files_uploaded"] == 1 and stats["batches_created"] == 1 and stats["request_lines"] == 12
    assert stats["usage"]["completion_tokens"] == done.usage.output_tokens
    assert stats["calls"]["GET /v1/batches/{id}"] == 4


def test_message_parts_developer_role_and_token_counts(emu, client):
    body_line = {
        "custom_id": "p",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "gpt-x",
            "messages": [
                {"role": "developer", "content": "Rule one."},
                {"role": "system", "content": [{"type": "text", "text": "Rule two."}]},
                {"role": "user", "content": "old question"},
                {"role": "assistant", "content": "old answer"},
                {"role": "user", "content": [{"type": "text", "text": "part a"}, {"type": "text", "text": "part b"}]},
            ],
        },
    }
    batch = submit(client, [body_line])
    emu.advance(batch.id, "completed")
    (r,) = download(client, client.batches.retrieve(batch.id).output_file_id)
    assert content_of(r) == expected_answer("Rule one.\nRule two.", "part a\npart b", None)
    chars = len("Rule one.") + len("Rule two.") + len("old question") + len("old answer") + len("part a\npart b")
    assert r["response"]["body"]["usage"]["prompt_tokens"] == -(-chars // 4)


def test_max_tokens_truncates_with_finish_reason_length(emu, client):
    batch = submit(client, [line("short", "q", schema=SCHEMA, max_tokens=3), line("ok", "q", max_tokens=500)])
    emu.advance(batch.id, "completed")
    results = {r["custom_id"]: r for r in download(client, client.batches.retrieve(batch.id).output_file_id)}
    cut = results["short"]["response"]["body"]
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 3
    assert cut["choices"][0]["message"]["content"] == expected_answer(None, "q", SCHEMA)[:12]
    assert results["ok"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"


def test_results_are_shuffled():
    lines = [line(f"r{i:02d}", f"prompt {i}") for i in range(50)]
    orders = []
    for seed in (1, 2):
        with Emulator(KEY, seed=seed) as emu:
            client = openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=0)
            batch = submit(client, lines)
            emu.advance(batch.id, "completed")
            orders.append([r["custom_id"] for r in download(client, client.batches.retrieve(batch.id).output_file_id)])
    input_order = [x["custom_id"] for x in lines]
    assert sorted(orders[0]) == input_order
    assert orders[0] != input_order and orders[1] != input_order and orders[0] != orders[1]


# -- validation failures ----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, code, line_no",
    [
        ([line("a", "x"), line("a", "y")], "duplicate_custom_id", 2),
        ([line("a", "x"), "{not json"], "invalid_json_line", 2),
        ([line("a", "x"), line("b", "y", model="other-model")], "mismatched_model", 2),
        ([{**line("a", "x"), "url": "/v1/embeddings"}], "invalid_url", 1),
        ([{**line("a", "x"), "method": "GET"}], "invalid_method", 1),
        ([line("a", "x"), line("b", "x"), line("c", "x"), line("d", "x")], "too_many_requests_in_batch", None),
    ],
)
def test_bad_input_file_fails_validation(raw, code, line_no):
    with Emulator(KEY, max_requests_per_batch=3) as emu:
        client = openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=0)
        data = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in raw).encode()
        batch = submit(client, None, raw=data)
        assert batch.status == "validating"  # create itself never rejects the file's contents
        emu.advance(batch.id, "completed")  # asks for completion; validation says no
        failed = client.batches.retrieve(batch.id)
        assert failed.status == "failed" and failed.failed_at is not None and failed.in_progress_at is None
        assert (failed.output_file_id, failed.error_file_id, failed.usage) == (None, None, None)
        assert failed.request_counts.total == 0
        assert [(e.code, e.line) for e in failed.errors.data] == [(code, line_no)]
        assert failed.errors.data[0].message


def test_token_limit_fault_fails_next_validation_exactly(emu, client):
    emu.add_fault(kind="token_limit")
    first, second = submit(client, [line("a", "x")]), submit(client, [line("a", "x")])
    emu.complete_all()
    failed, ok = client.batches.retrieve(first.id), client.batches.retrieve(second.id)
    assert ok.status == "completed"
    assert failed.status == "failed" and failed.request_counts.model_dump() == {"total": 0, "completed": 0, "failed": 0}
    (err,) = failed.errors.data
    assert (err.code, err.line, err.param) == ("token_limit_exceeded", None, None)
    assert err.message.startswith("Enqueued token limit reached for gpt-x in organization ")
    assert err.message.endswith(
        "Limit: 2,000,000 enqueued tokens. Please try again once some in_progress batches have been completed."
    )


# -- per-request failures, expiry, cancel ------------------------------------------------


def test_request_fault_goes_to_error_file_others_succeed(emu, client):
    emu.add_fault(
        prompt_contains="BAD",
        kind="http_error",
        status_code=400,
        type="invalid_request_error",
        message="Invalid prompt.",
        param="messages",
    )
    emu.add_fault(prompt_contains="ODD", kind="content", content="not json")
    batch = submit(client, [line("good", "fine"), line("bad", "a BAD one"), line("odd", "ODD", schema=SCHEMA)])
    emu.advance(batch.id, "completed")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.model_dump() == {"total": 3, "completed": 2, "failed": 1}
    (err,) = download(client, done.error_file_id)
    assert err["custom_id"] == "bad" and err["error"] is None
    assert err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"] == {
        "message": "Invalid prompt.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }
    outputs = {r["custom_id"]: content_of(r) for r in download(client, done.output_file_id)}
    assert outputs == {"good": expected_answer(None, "fine", None), "odd": "not json"}


def test_all_requests_failed_has_no_output_file(emu, client):
    emu.add_fault(prompt_contains="", kind="http_error", status_code=500, times=None)
    batch = submit(client, [line("a", "x"), line("b", "y")])
    emu.advance(batch.id, "completed")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id is None and done.error_file_id
    assert {e["response"]["status_code"] for e in download(client, done.error_file_id)} == {500}


def test_expiry_keeps_partial_output_and_reports_the_rest(emu, client):
    lines = [line(f"e{i}", f"p{i}") for i in range(10)]
    batch = submit(client, lines)
    emu.advance(batch.id, "in_progress")
    emu.advance(batch.id, "expired", done_fraction=0.4)
    expired = client.batches.retrieve(batch.id)
    assert expired.status == "expired" and expired.expired_at is not None and expired.completed_at is None
    outputs, errors = download(client, expired.output_file_id), download(client, expired.error_file_id)
    assert len(outputs) == 4 and len(errors) == 6
    assert {r["custom_id"] for r in outputs + errors} == {x["custom_id"] for x in lines}
    assert all(
        e["response"] is None
        and e["error"]
        == {
            "code": "batch_expired",
            "message": "This request could not be executed before the completion window expired.",
        }
        for e in errors
    )
    assert expired.usage.output_tokens == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in outputs)


def test_cancel_goes_through_cancelling_and_keeps_partial_output(emu, client):
    batch = submit(client, [line(f"c{i}", f"p{i}") for i in range(10)])
    emu.advance(batch.id, "in_progress", done_fraction=0.3)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    assert client.batches.retrieve(batch.id).status == "cancelling"  # stays until advanced
    emu.advance(batch.id, "cancelled")
    cancelled = client.batches.retrieve(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.request_counts.completed == 3 and cancelled.error_file_id is None
    assert len(download(client, cancelled.output_file_id)) == 3
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_invalid_transition_is_refused(emu, client):
    batch = submit(client, [line("a", "x")])
    emu.advance(batch.id, "completed")
    with pytest.raises(ValueError):
        emu.advance(batch.id, "in_progress")


# -- HTTP errors ------------------------------------------------------------------------


def test_wrong_key_is_401_without_echoing_the_key(emu):
    bad = openai.OpenAI(base_url=emu.openai_base_url, api_key="sk-wrong-key-123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.batches.list()
    assert info.value.code == "invalid_api_key" and "sk-wrong-key-123456789" not in str(info.value)


def test_not_found_and_bad_create_parameters(emu, client):
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-missing")
    f = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="48h")
    assert info.value.param == "completion_window"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={f"k{i}": "v" for i in range(17)},
        )
    client.files.delete(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    raw = urllib.request.Request(emu.base_url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as http_info:
        urllib.request.urlopen(raw)
    assert http_info.value.code == 404 and "error" in json.loads(http_info.value.read())


def test_file_too_large():
    with Emulator(KEY, max_file_bytes=100) as emu:
        client = openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            client.files.create(file=("big.jsonl", b"x" * 101), purpose="batch")
        assert info.value.body["message"] == "File is too large."


def test_429_fault_is_retried_by_the_sdk_after_retry_after(emu):
    control(
        emu,
        "POST",
        "/_emulator/faults",
        {"endpoint": "POST /v1/batches", "status_code": 429, "times": 1, "retry_after": 0.3},
    )
    retrying = openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=2)
    f = retrying.files.create(file=("in.jsonl", json.dumps(line("a", "x")).encode()), purpose="batch")
    started = time.monotonic()
    batch = retrying.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert time.monotonic() - started >= 0.3 and batch.status == "validating"
    stats = control(emu, "GET", "/_emulator/stats")
    assert stats["calls"]["POST /v1/batches"] == 2 and stats["batches_created"] == 1


def test_500_fault_surfaces_without_retries(emu, client):
    emu.add_fault(endpoint="GET /v1/batches/{id}", status_code=500, times=1)
    batch = submit(client, [line("a", "x")])
    with pytest.raises(openai.InternalServerError):
        client.batches.retrieve(batch.id)
    assert client.batches.retrieve(batch.id).id == batch.id


# -- listing, control endpoints, auto-advance -----------------------------------------


def test_list_pagination_iterates_all_batches_newest_first(emu, client):
    f = client.files.create(file=("in.jsonl", json.dumps(line("a", "x")).encode()), purpose="batch")
    created = [
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(25)
    ]
    listed = [b.id for b in client.batches.list()]
    assert listed == created[::-1]
    assert emu.stats()["calls"]["GET /v1/batches"] == 2  # default page of 20, then after=<last id>
    page = client.batches.list(limit=10)
    assert len(page.data) == 10 and page.has_more
    assert len(emu.batches()) == 25


def test_control_endpoints_over_http(emu, client):
    batch = submit(client, [line("a", "x"), line("b", "y")])
    moved = control(emu, "POST", f"/_emulator/batches/{batch.id}/advance", {"to": "in_progress"})
    assert moved["status"] == "in_progress" and moved["request_counts"]["total"] == 2
    finished = control(emu, "POST", "/_emulator/complete_all")
    assert [b["status"] for b in finished["batches"]] == ["completed"]
    with pytest.raises(urllib.error.HTTPError) as info:
        control(emu, "POST", "/_emulator/batches/batch_nope/advance", {"to": "completed"})
    assert info.value.code == 404
    control(emu, "POST", "/_emulator/reset")
    assert emu.batches() == [] and control(emu, "GET", "/_emulator/stats")["batches_created"] == 0


def test_auto_advance_moves_batches_on_their_own():
    # The emulator's clock is stepped by the test (no sleeps, no deadline): each stage lasts 60 s of it.
    with Emulator(KEY, auto_advance_seconds=60) as emu:
        start = time.time()
        emu.now = lambda: start
        client = openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=0)
        batch = submit(client, [line("a", "x"), line("b", "y")])
        seen = [batch.status]
        for stage in range(1, 5):
            emu.now = lambda stage=stage: start + 60 * stage + 1
            batch = client.batches.retrieve(batch.id)
            seen.append(batch.status)
        assert seen == ["validating", "in_progress", "finalizing", "completed", "completed"]
        assert batch.request_counts.completed == 2
        assert batch.created_at < batch.in_progress_at < batch.finalizing_at < batch.completed_at
