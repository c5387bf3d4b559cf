"""The sandbox's Anthropic Message Batches face, driven by the real `anthropic` SDK: lifecycle, results,
listing, control (errors and auth: test_emulator_anthropic_errors.py; caching: test_emulator_caching.py).

Clients use max_retries=0 so call counts and errors are exact; only the retry test lets the SDK retry.
"""

from __future__ import annotations

import json
import time

import anthropic
import openai
import pytest
from helpers import CLAUDE_MODEL as MODEL
from helpers import SANDBOX_KEY as KEY
from helpers import SCHEMA, raw, req, results_of, tokens

from dbt_llm_batch.sandbox import Emulator, expected_answer

# -- happy path -------------------------------------------------------------------------


def test_lifecycle_counts_and_answers_match_expected_answer(emu, claude):
    requests = [req(f"t{i}", f"text prompt {i}", system="Be brief.") for i in range(5)]
    requests += [req(f"j{i}", f"json prompt {i}", tool=True) for i in range(5)]
    batch = claude.messages.batches.create(requests=requests)
    assert batch.type == "message_batch" and batch.processing_status == "in_progress"
    assert batch.request_counts.model_dump() == {
        "processing": 10,
        "succeeded": 0,
        "errored": 0,
        "canceled": 0,
        "expired": 0,
    }
    assert batch.ended_at is None and batch.results_url is None and batch.cancel_initiated_at is None
    assert (batch.expires_at - batch.created_at).total_seconds() == 86400 and batch.id.startswith("msgbatch_")

    emu.advance(batch.id, "in_progress", done_fraction=0.5)  # work happens, counts do not show it yet
    running = claude.messages.batches.with_raw_response.retrieve(batch.id)
    assert running.headers["request-id"].startswith("req_")
    assert running.parse().request_counts.processing == 10 and running.parse().request_counts.succeeded == 0
    with pytest.raises(anthropic.AnthropicError):  # no results_url yet: the SDK refuses by itself
        claude.messages.batches.results(batch.id)

    emu.advance(batch.id, "ended")
    done = claude.messages.batches.retrieve(batch.id)
    assert done.processing_status == "ended" and done.ended_at is not None
    assert done.request_counts.model_dump() == {
        "processing": 0,
        "succeeded": 10,
        "errored": 0,
        "canceled": 0,
        "expired": 0,
    }
    assert done.results_url == f"{emu.base_url}/v1/messages/batches/{batch.id}/results"
    via_localhost = json.loads(
        raw(emu, "GET", f"/v1/messages/batches/{batch.id}", {"x-api-key": KEY, "Host": f"localhost:{emu.port}"})[2]
    )
    assert via_localhost["results_url"] == f"http://localhost:{emu.port}/v1/messages/batches/{batch.id}/results"

    results = results_of(claude, batch.id)
    assert set(results) == {r["custom_id"] for r in requests}
    for i in range(5):
        text = results[f"t{i}"].message
        assert text.content[0].type == "text" and text.stop_reason == "end_turn" and text.model == MODEL
        assert text.content[0].text == expected_answer("Be brief.", f"text prompt {i}", None)
        assert text.usage.input_tokens == tokens(len("Be brief.") + len(f"text prompt {i}"))
        assert text.usage.output_tokens == tokens(len(text.content[0].text))
        assert (text.usage.cache_creation_input_tokens, text.usage.cache_read_input_tokens) == (0, 0)
        assert text.usage.service_tier == "batch" and text.stop_sequence is None
        call = results[f"j{i}"].message
        (block,) = call.content
        assert block.type == "tool_use" and block.name == "classify" and block.id.startswith("toolu_")
        assert call.stop_reason == "tool_use"
        answer = expected_answer(None, f"json prompt {i}", SCHEMA)
        assert block.input == json.loads(answer) and call.usage.output_tokens == tokens(len(answer))
    parsed = results["j0"].message.content[0].input
    assert parsed["label"] in ("pos", "neg", "neutral") and isinstance(parsed["count"], int)
    assert isinstance(parsed["score"], float) and isinstance(parsed["flag"], bool)
    assert parsed["note"].startswith("sandbox-") and parsed["note"].endswith("-note")

    stats = emu.stats()
    assert (
        stats["calls"]["POST /v1/messages/batches"] == 1
        and stats["calls"]["GET /v1/messages/batches/{id}/results"] == 1
    )
    assert stats["batches_created"] == 1 and {f: n for f, n in stats["batches_by_face"].items() if n} == {
        "anthropic": 1
    }
    ant = stats["usage_by_face"]["anthropic"]
    assert ant["output_tokens"] == sum(r.message.usage.output_tokens for r in results.values())
    assert ant["input_tokens"] == sum(r.message.usage.input_tokens for r in results.values())
    assert stats["usage"]["prompt_tokens"] == 0  # `usage` keeps the OpenAI totals


def test_results_stream_is_shuffled_jsonl_without_blank_lines(emu, claude):
    requests = [req(f"r{i:02d}", f"prompt {i}") for i in range(40)]
    batch = claude.messages.batches.create(requests=requests)
    emu.advance(batch.id, "ended")
    status, headers, body = raw(emu, "GET", f"/v1/messages/batches/{batch.id}/results", {"x-api-key": KEY})
    assert status == 200 and headers["request-id"]
    assert body.endswith(b"\n") and b"\n\n" not in body and not body.startswith(b"\n")
    order = [json.loads(x)["custom_id"] for x in body.decode().split("\n")[:-1]]
    assert sorted(order) == [r["custom_id"] for r in requests] and order != sorted(order)
    assert [r.custom_id for r in claude.messages.batches.results(batch.id)] == order


def test_content_blocks_last_user_message_and_max_tokens(emu, claude):
    multi = {
        "custom_id": "multi",
        "params": {
            "model": MODEL,
            "max_tokens": 300,
            "system": [{"type": "text", "text": "Rule one."}, {"type": "text", "text": "Rule two."}],
            "messages": [
                {"role": "user", "content": "old question"},
                {"role": "assistant", "content": [{"type": "text", "text": "old answer"}]},
                {"role": "user", "content": [{"type": "text", "text": "part a"}, {"type": "text", "text": "part b"}]},
            ],
        },
    }
    batch = claude.messages.batches.create(
        requests=[multi, req("cut", "q", max_tokens=3), req("cut_tool", "q", tool=True, max_tokens=3)]
    )
    emu.advance(batch.id, "ended")
    results = results_of(claude, batch.id)
    m = results["multi"].message
    assert m.content[0].text == expected_answer("Rule one.\nRule two.", "part a\npart b", None)
    chars = len("Rule one.\nRule two.") + len("old question") + len("old answer") + len("part a\npart b")
    assert m.usage.input_tokens == tokens(chars)
    cut = results["cut"].message
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert cut.content[0].text == expected_answer(None, "q", None)[:12]
    cut_tool = results["cut_tool"].message
    assert cut_tool.stop_reason == "max_tokens" and cut_tool.usage.output_tokens == 3
    assert cut_tool.content[0].type == "tool_use" and cut_tool.content[0].input == {}


def test_bad_params_become_errored_lines_after_the_batch_ends(emu, claude):
    good = req("good", "fine")
    no_max = {"custom_id": "no_max", "params": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}}
    zero = req("zero", "x", max_tokens=0)
    no_model = {"custom_id": "no_model", "params": {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}}
    no_messages = {"custom_id": "no_messages", "params": {"model": MODEL, "max_tokens": 5, "messages": []}}
    streaming = req("streaming", "x", stream=True)
    batch = claude.messages.batches.create(requests=[good, no_max, zero, no_model, no_messages, streaming])
    assert batch.processing_status == "in_progress"  # create accepted them all
    emu.advance(batch.id, "ended")
    done = claude.messages.batches.retrieve(batch.id)
    assert (done.request_counts.succeeded, done.request_counts.errored) == (1, 5)
    results = results_of(claude, batch.id)
    assert results["good"].type == "succeeded"
    messages = {cid: r.error.error.message for cid, r in results.items() if r.type == "errored"}
    assert messages == {
        "no_max": "max_tokens: Field required",
        "zero": "max_tokens: Input should be greater than or equal to 1",
        "no_model": "model: Field required",
        "no_messages": "messages: List should have at least 1 item after validation, not 0",
        "streaming": "stream: Streaming is not supported in the Message Batches API",
    }
    err = results["no_max"].error
    assert err.type == "error" and err.error.type == "invalid_request_error" and err.request_id.startswith("req_")
    assert emu.stats()["usage_by_face"]["anthropic"]["output_tokens"] == results["good"].message.usage.output_tokens


# -- cancel, expiry, delete ------------------------------------------------------------


def test_cancel_with_done_fraction_gives_partial_results_and_canceled_items(emu, claude):
    batch = claude.messages.batches.create(requests=[req(f"c{i}", f"p{i}") for i in range(10)])
    canceling = claude.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    assert canceling.request_counts.processing == 10 and canceling.results_url is None
    assert claude.messages.batches.cancel(batch.id).processing_status == "canceling"  # twice is harmless
    emu.advance(batch.id, "canceled", done_fraction=0.3)
    ended = claude.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended"
    assert ended.request_counts.model_dump() == {
        "processing": 0,
        "succeeded": 3,
        "errored": 0,
        "canceled": 7,
        "expired": 0,
    }
    results = results_of(claude, batch.id)
    assert sorted(cid for cid, r in results.items() if r.type == "succeeded") == ["c0", "c1", "c2"]  # input order
    assert all(r.type == "canceled" for cid, r in results.items() if cid not in ("c0", "c1", "c2"))
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.batches.cancel(batch.id)


def test_expiry_ends_with_expired_items(emu, claude):
    batch = claude.messages.batches.create(requests=[req(f"e{i}", f"p{i}") for i in range(10)])
    emu.advance(batch.id, "expired", done_fraction=0.4)
    ended = claude.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.cancel_initiated_at is None
    assert (ended.request_counts.succeeded, ended.request_counts.expired) == (4, 6)
    kinds = [r.type for r in results_of(claude, batch.id).values()]
    assert sorted(kinds) == ["expired"] * 6 + ["succeeded"] * 4


def test_clock_expires_open_batches_after_24h_and_archives_results_after_29_days(emu, claude):
    start = time.time()
    batch = claude.messages.batches.create(requests=[req("a", "x"), req("b", "y")])
    emu.now = lambda: start + 86400 + 1
    expired = claude.messages.batches.retrieve(batch.id)
    assert expired.processing_status == "ended" and expired.request_counts.expired == 2
    assert expired.ended_at == expired.expires_at
    emu.now = lambda: start + 29 * 86400 + 1
    archived = claude.messages.batches.retrieve(batch.id)
    assert archived.archived_at is not None and archived.results_url is not None
    with pytest.raises(anthropic.NotFoundError):
        list(claude.messages.batches.results(batch.id))


def test_delete_only_once_ended(emu, claude):
    batch = claude.messages.batches.create(requests=[req("a", "x")])
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.batches.delete(batch.id)
    assert "cancel" in info.value.body["error"]["message"]
    emu.advance(batch.id, "ended")
    deleted = claude.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.batches.retrieve(batch.id)
    assert missing.value.body["error"]["type"] == "not_found_error"


# -- listing, control --------------------------------------------------------------------


def test_list_pagination_newest_first(emu, claude):
    created = [claude.messages.batches.create(requests=[req("a", "x")]).id for _ in range(25)]
    assert [b.id for b in claude.messages.batches.list()] == created[::-1]
    assert emu.stats()["calls"]["GET /v1/messages/batches"] == 2  # 20, then after_id=<last id>
    page = claude.messages.batches.list(limit=10)
    assert [b.id for b in page.data] == created[::-1][:10] and page.has_more
    assert (page.first_id, page.last_id) == (created[-1], created[-10])
    after = claude.messages.batches.list(limit=10, after_id=page.last_id)
    assert [b.id for b in after.data] == created[::-1][10:20]
    before = claude.messages.batches.list(limit=3, before_id=after.first_id)
    assert [b.id for b in before.data] == created[::-1][7:10] and before.has_more
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.batches.list(limit=1001)


def test_control_surface_covers_both_faces(emu, claude):
    oai = openai.OpenAI(base_url=emu.openai_base_url, api_key=KEY, max_retries=0)
    f = oai.files.create(
        file=(
            "in.jsonl",
            json.dumps(
                {
                    "custom_id": "a",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "x"}]},
                }
            ).encode(),
        ),
        purpose="batch",
    )
    first = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    second = claude.messages.batches.create(requests=[req("a", "x")])
    third = claude.messages.batches.create(requests=[req("a", "x"), req("b", "y")])
    claude.messages.batches.cancel(third.id)
    assert [b["id"] for b in emu.batches()] == [third.id, second.id, first.id]  # newest first, both faces
    moved = json.loads(raw(emu, "POST", f"/_emulator/batches/{second.id}/advance", body={"to": "ended"})[2])
    assert moved["processing_status"] == "ended" and moved["results_url"].endswith(f"/{second.id}/results")
    finished = emu.complete_all()
    assert {(b.get("object"), b.get("type"), b.get("status") or b.get("processing_status")) for b in finished} == {
        ("batch", None, "completed"),
        (None, "message_batch", "ended"),
    }
    assert claude.messages.batches.retrieve(third.id).request_counts.canceled == 2
    with pytest.raises(ValueError):
        emu.advance(second.id, "canceling")


def test_auto_advance_ends_anthropic_batches():
    # The emulator's clock is stepped by the test (no sleeps, no deadline): the stage lasts 60 s of it.
    with Emulator(KEY, auto_advance_seconds=60) as emu:
        start = time.time()
        emu.now = lambda: start
        claude = anthropic.Anthropic(base_url=emu.base_url, api_key=KEY, max_retries=0)
        batch = claude.messages.batches.create(requests=[req("a", "x"), req("b", "y")])
        emu.now = lambda: start + 30
        halfway = claude.messages.batches.retrieve(batch.id)
        assert halfway.processing_status == "in_progress" and halfway.request_counts.processing == 2
        emu.now = lambda: start + 61
        batch = claude.messages.batches.retrieve(batch.id)
        assert batch.processing_status == "ended" and batch.request_counts.succeeded == 2
        assert len(list(claude.messages.batches.results(batch.id))) == 2
