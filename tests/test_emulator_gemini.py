"""The sandbox's Gemini Batch Mode face, driven by the official google-genai SDK over HTTP: auth and
error envelopes, request shapes checked as the API checks them (a bad request is an error line, a bad
batch a refused create), limits, the job states with partial results, and faults before and after the
handler."""

from __future__ import annotations

import json

import pytest
from helpers import SANDBOX_KEY

from dbt_llm_batch.sandbox import expected_answer

MODEL = "gemini-2.5-flash"
CREATE = "POST /gemini/{version}/models/{model}:batchGenerateContent"


def client_for(emu, key=SANDBOX_KEY):
    from google import genai
    from google.genai import types

    return genai.Client(api_key=key, http_options=types.HttpOptions(base_url=emu.gemini_base_url))


@pytest.fixture
def gemini(emu):
    return client_for(emu)


def request(prompt: str, **generation) -> dict:
    body: dict = {"contents": [{"role": "user", "parts": [{"text": prompt}]}]}
    if generation:
        body["generationConfig"] = generation
    return body


def inline(gemini, requests: dict[str, dict], name="job"):
    from google.genai import types

    src = [
        types.InlinedRequest.model_validate(
            {"contents": r["contents"], "metadata": {"key": key}, "config": r.get("generationConfig")}
        )
        for key, r in requests.items()
    ]
    return gemini.batches.create(model=MODEL, src=src, config={"display_name": name})


def from_file(gemini, tmp_path, lines: list, name="job"):
    path = tmp_path / "requests.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    uploaded = gemini.files.upload(file=str(path), config={"display_name": name, "mime_type": "application/jsonl"})
    return gemini.batches.create(model=MODEL, src=uploaded.name, config={"display_name": name})


def error_of(call):
    from google.genai import errors

    with pytest.raises(errors.APIError) as caught:
        call()
    return caught.value.code, caught.value.status, caught.value.message


def test_a_missing_key_is_403_and_a_wrong_one_400_in_googles_envelope(emu):
    wrong = client_for(emu, "wrong")
    assert error_of(lambda: list(wrong.batches.list()))[:2] == (400, "INVALID_ARGUMENT")
    reply = emu.handle("GET", "/gemini/v1beta/batches", {}, b"")  # no key at all
    assert (reply.status, json.loads(reply.body)["error"]["status"]) == (403, "PERMISSION_DENIED")


def test_inline_results_come_back_in_order_with_their_keys_and_bad_requests_as_error_lines(emu, gemini):
    job = inline(
        gemini,
        {
            "good": request("hello", maxOutputTokens=50),
            "model_turn_last": {"contents": [{"role": "model", "parts": [{"text": "x"}]}]},
            "schema_keyword": request(
                "y", responseMimeType="application/json", responseJsonSchema={"type": "string", "pattern": "^a$"}
            ),
            "schema_without_mime": request("z", responseJsonSchema={"type": "object"}),
        },
    )
    assert job.state.name == "JOB_STATE_PENDING" and job.display_name == "job"
    emu.complete(job.name)
    done = gemini.batches.get(name=job.name)
    assert done.state.name == "JOB_STATE_SUCCEEDED"
    responses = done.dest.inlined_responses
    assert [r.metadata["key"] for r in responses] == [
        "good",
        "model_turn_last",
        "schema_keyword",
        "schema_without_mime",
    ]
    good = responses[0].response
    assert good.candidates[0].content.parts[0].text == expected_answer(None, "hello", None)
    assert good.usage_metadata.prompt_token_count == 2  # 5 characters, 4 a token, rounded up
    assert [r.error.code for r in responses[1:]] == [400, 400, 400]
    assert "last turn" in responses[1].error.message and "pattern" in responses[2].error.message
    assert [b["custom_id"] for b in emu.billed()] == ["good"]  # only the answered request is billed


def test_a_file_batch_answers_a_generated_file_of_keyed_lines(emu, gemini, tmp_path):
    lines = [{"key": f"k{i}", "request": request(f"prompt {i}", maxOutputTokens=3)} for i in range(3)]
    lines.append({"key": "unknown_field", "request": request("x", maxOutputTokens=5, topQ=1)})
    job = from_file(gemini, tmp_path, lines)
    emu.complete(job.name)
    done = gemini.batches.get(name=job.name)
    data = gemini.files.download(file=done.dest.file_name)
    results = {x["key"]: x for x in map(json.loads, data.decode().splitlines())}
    assert set(results) == {"k0", "k1", "k2", "unknown_field"}
    assert results["unknown_field"]["error"]["status"] == "INVALID_ARGUMENT"
    assert 'Unknown name "topQ"' in results["unknown_field"]["error"]["message"]
    first = results["k0"]["response"]["candidates"][0]
    assert first["finishReason"] == "MAX_TOKENS"  # the answer was cut at maxOutputTokens
    assert results["k0"]["response"]["usageMetadata"]["candidatesTokenCount"] == 3
    # An uploaded file cannot be downloaded; a deleted one is gone (the Files API answers 403).
    uploaded = [f for f in gemini.files.list() if f.source.name == "UPLOADED"][0]
    assert error_of(lambda: gemini.files.download(file=uploaded.name))[0] == 400
    gemini.files.delete(name=uploaded.name)
    assert error_of(lambda: gemini.files.get(name=uploaded.name))[0] == 403


def test_a_file_of_bad_lines_or_a_missing_file_refuses_the_create(emu, gemini, tmp_path):
    ok = {"key": "a", "request": request("p")}
    assert error_of(lambda: from_file(gemini, tmp_path, [ok, "not json"]))[:2] == (400, "INVALID_ARGUMENT")
    assert "duplicate key" in error_of(lambda: from_file(gemini, tmp_path, [ok, ok]))[2]
    assert (
        error_of(lambda: gemini.batches.create(model=MODEL, src="files/nope", config={"display_name": "j"}))[0] == 404
    )
    assert emu.stats()["batches_by_face"]["gemini"] == 0


def test_limits_inline_size_concurrent_jobs_and_enqueued_tokens(gemini):
    from dbt_llm_batch.sandbox import Emulator

    with Emulator(SANDBOX_KEY, gemini_max_inline_bytes=2_000, gemini_max_concurrent_batches=2) as small:
        client = client_for(small)
        too_big = {"big": request("x" * 3_000)}
        assert error_of(lambda: inline(client, too_big))[:2] == (400, "INVALID_ARGUMENT")
        inline(client, {"a": request("a")})
        inline(client, {"b": request("b")})
        assert error_of(lambda: inline(client, {"c": request("c")}))[:2] == (429, "RESOURCE_EXHAUSTED")
    with Emulator(SANDBOX_KEY, gemini_enqueued_token_limit=10) as queue:
        client = client_for(queue)
        inline(client, {"a": request("x" * 32)})  # 8 tokens enqueued
        assert error_of(lambda: inline(client, {"b": request("x" * 16)}))[0] == 429
        queue.complete_all()  # an ended job no longer counts
        inline(client, {"b": request("x" * 16)})


@pytest.mark.parametrize("end", ["cancelled", "expired", "failed"])
def test_a_job_that_ends_early_keeps_the_results_of_the_requests_that_ran(emu, gemini, end):
    job = inline(gemini, {f"k{i}": request(f"p{i}") for i in range(4)})
    emu.advance(job.name, "running", done_fraction=0.5)
    assert gemini.batches.get(name=job.name).state.name == "JOB_STATE_RUNNING"
    if end == "cancelled":
        gemini.batches.cancel(name=job.name)
    else:
        emu.advance(job.name, end)
    done = gemini.batches.get(name=job.name)
    assert done.state.name == f"JOB_STATE_{end.upper()}"
    assert [r.metadata["key"] for r in done.dest.inlined_responses] == ["k0", "k1"]
    assert len(emu.billed()) == 2


def test_a_job_expires_48_hours_after_creation_and_a_batch_failure_fails_it_as_it_starts(emu, gemini, monkeypatch):
    job = inline(gemini, {"a": request("a")})
    created = emu.now()
    monkeypatch.setattr(emu, "now", lambda: created + 48 * 3600 + 1)
    assert gemini.batches.get(name=job.name).state.name == "JOB_STATE_EXPIRED"
    monkeypatch.undo()
    emu.add_fault(kind="batch_failed", message="quota")
    failing = inline(gemini, {"b": request("b")})
    emu.advance(failing.name)  # PENDING -> RUNNING fails it
    assert gemini.batches.get(name=failing.name).state.name == "JOB_STATE_FAILED"
    assert emu.billed() == []


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_create_fault_before_the_handler_makes_no_job_and_after_it_one_the_client_never_saw(emu, gemini, when):
    emu.add_fault(endpoint=CREATE, when=when, status_code=503)
    assert error_of(lambda: inline(gemini, {"a": request("a")}, name="dbt_llm_batch-j1"))[:2] == (503, "UNAVAILABLE")
    listed = [(j.display_name, j.state.name) for j in gemini.batches.list()]
    assert listed == ([] if when == "before" else [("dbt_llm_batch-j1", "JOB_STATE_PENDING")])
