"""Azure OpenAI Global Batch (llm_provider = 'azure_openai'): what differs from OpenAI, through the
AzureOpenAI client against the sandbox's strict Azure face. The shared guarantees (lifecycle, crash,
lost create, unfinished batch, cost) are the conformance suite's (tests/conformance)."""

from __future__ import annotations

import collections
import io
import json

import openai
import pytest
from conftest import failure_messages
from helpers import SANDBOX_KEY, end_backoff

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.sandbox import expected_answer

SYSTEM = "Summarise."
DEPLOYMENT = "batch-4o-mini"
VERSION = "2024-10-21"


def azure(emu, **kw) -> openai.AzureOpenAI:
    args = {"azure_endpoint": emu.base_url, "api_key": SANDBOX_KEY, "api_version": VERSION, "max_retries": 0, **kw}
    return openai.AzureOpenAI(**args)


def upload(client, lines: list[dict]):
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")


def chat_line(custom_id: str, url: str = "/chat/completions", model: str = DEPLOYMENT) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"row {custom_id}"}]}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_the_face_wants_an_api_version_and_an_azure_key(emu):
    with pytest.raises(openai.NotFoundError):  # no api-version: Azure's front door answers 404
        openai.OpenAI(base_url=emu.base_url + "/openai", api_key=SANDBOX_KEY, max_retries=0).batches.list()
    with pytest.raises(openai.BadRequestError, match="not supported"):
        azure(emu, api_version="1999-01-01").batches.list()
    with pytest.raises(openai.AuthenticationError, match="Access denied"):
        azure(emu, api_key="wrong-key-0000").batches.list()
    assert azure(emu, api_key=None, azure_ad_token=SANDBOX_KEY).batches.list().data == []  # an Entra token


def test_lines_go_to_chat_completions_without_v1_and_a_job_never_expires(emu, monkeypatch):
    client = azure(emu)
    wrong = client.batches.create(
        input_file_id=upload(client, [chat_line("a", url="/v1/chat/completions")]).id,
        endpoint="/chat/completions",
        completion_window="24h",
    )
    emu.advance(wrong.id, "in_progress")
    assert client.batches.retrieve(wrong.id).errors.data[0].code == "invalid_url"

    batch = client.batches.create(
        input_file_id=upload(client, [chat_line("a"), chat_line("b")]).id,
        endpoint="/chat/completions",
        completion_window="24h",
    )
    assert batch.expires_at is None
    emu.advance(batch.id, "in_progress", done_fraction=0.5)
    with pytest.raises(ValueError, match="cannot advance"):
        emu.advance(batch.id, "expired")
    later = emu.now() + 30 * 86400
    monkeypatch.setattr(emu, "now", lambda: later)  # a month on, the job is still running
    assert client.batches.retrieve(batch.id).status == "in_progress"
    cancelled = emu.advance(batch.id, "cancelled")  # a cancel returns the finished work
    assert (cancelled["status"], cancelled["request_counts"]["completed"]) == ("cancelled", 1)


def test_the_enqueued_token_quota_is_per_deployment(emu):
    client = azure(emu)
    emu.openai_enqueued_token_limit = 1

    def batch(deployment):
        made = client.batches.create(
            input_file_id=upload(client, [chat_line("a", model=deployment)]).id,
            endpoint="/chat/completions",
            completion_window="24h",
        )
        return emu.advance(made.id, "in_progress")

    emu.openai_enqueued_token_limit = None
    first = batch(DEPLOYMENT)
    face = next(f for f in emu.faces if f.name == "azure_openai")
    emu.openai_enqueued_token_limit = face.runs[first["id"]].enqueued_tokens
    over = batch(DEPLOYMENT)
    assert over["status"] == "failed" and over["errors"]["data"][0]["code"] == "token_limit_exceeded"
    assert f"deployment {DEPLOYMENT}" in over["errors"]["data"][0]["message"]
    assert batch("another-deployment")["status"] == "in_progress"


def provider(**keys):
    raw = {"unique_key": "a", "llm_provider": "azure_openai", "llm_model": DEPLOYMENT, **keys}
    return get_provider("azure_openai")(parse_config(raw))


def test_credentials_and_endpoint_are_asked_for_by_name(monkeypatch):
    for name in ("AZURE_OPENAI_ENDPOINT", "AZURE_OPENAI_API_KEY", "AZURE_OPENAI_AD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="llm_azure_endpoint or export AZURE_OPENAI_ENDPOINT"):
        provider().check_credentials()
    with pytest.raises(ConfigError, match="AZURE_OPENAI_API_KEY is not set"):
        provider(llm_azure_endpoint="https://x.openai.azure.com").check_credentials()
    monkeypatch.setenv("AZURE_OPENAI_AD_TOKEN", "an-entra-token")
    provider(llm_azure_endpoint="https://x.openai.azure.com").check_credentials()
    with pytest.raises(ConfigError, match="llm_azure_endpoint must be"):
        provider(llm_azure_endpoint="x.openai.azure.com")


def test_an_entra_token_alone_submits_and_polls(emu, monkeypatch, tmp_path):
    monkeypatch.delenv("AZURE_OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("AZURE_OPENAI_AD_TOKEN", SANDBOX_KEY)
    p = provider(llm_azure_endpoint=emu.base_url)
    p.check_credentials()
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(chat_line("r_1")) + "\n")
    submitted = p.submit(str(path), "job-1", "main.m")
    assert p.find_submission("job-1", emu.now() - 60, {"r_1"}).batch_id == submitted.batch_id
    emu.complete_all()
    assert p.poll(submitted.batch_id).status == "completed"


def model(rows: int) -> tuple[str, str]:
    things = "select * from (values " + ", ".join(f"({i}, 'row {i}')" for i in range(rows)) + ") t(a, prompt)"
    m = f"""
{{{{ config(materialized='llm_batch', unique_key='a', llm_provider='azure_openai', llm_model='{DEPLOYMENT}',
            llm_azure_model='gpt-4o-mini', llm_system={SYSTEM!r}, llm_max_tokens=100,
            llm_realtime_when='a = 0') }}}}
select * from {{{{ ref('things') }}}}
"""
    return things, m


def test_over_the_deployment_quota_waits_and_resubmits_never_paying_twice(project, emulator):
    """A second batch past the deployment's enqueued-token quota fails with token_limit_exceeded: its
    requests wait out a back-off and are resubmitted, none failed, none paid twice. Row 0 is urgent and
    goes to the deployment's realtime endpoint."""
    things, m = model(7)
    project.write("models/things.sql", things)
    project.write("models/m.sql", m)
    project.dbt("run", "-s", "things", "m")  # row 0 answered in realtime; rows 1-6 in a batch
    assert emulator.stats()["calls"]["POST /openai/deployments/{deployment}/chat/completions"] == 1
    (first,) = [b for b in emulator.batches()]
    emulator.advance(first["id"], "in_progress")
    face = next(f for f in emulator.faces if f.name == "azure_openai")
    emulator.openai_enqueued_token_limit = face.runs[first["id"]].enqueued_tokens  # the deployment is full

    project.write("models/things.sql", model(10)[0])
    project.dbt("run", "-s", "things", "m")  # rows 7-9 in a second batch, past the quota
    second = emulator.batches()[0]
    assert emulator.advance(second["id"], "in_progress")["errors"]["data"][0]["code"] == "token_limit_exceeded"
    emulator.complete_all()
    project.dbt("run", "-s", "m")  # the first batch merges; the second's requests wait (back-off)
    assert project.query("select count(*) from main.m where llm_status = 'succeeded'") == [(7,)]
    assert len(emulator.batches()) == 2
    end_backoff(project)
    project.dbt("run", "-s", "m")  # resubmitted
    emulator.complete_all()
    project.dbt("run", "-s", "m")

    got = project.query("select prompt, llm_status, llm_output from main.m order by a")
    assert [(s, o) for _, s, o in got] == [("succeeded", expected_answer(SYSTEM, p, None)) for p, _, _ in got]
    assert len(got) == 10 and len(emulator.batches()) == 3
    assert project.query("select count(*) from main.llm_batch_requests where status = 'failed'") == [(0,)]
    billed = collections.Counter(b["prompt"] for b in emulator.billed())
    assert sorted(billed.values()) == [1] * 10, billed


def test_a_config_key_azure_refuses_fails_the_model_before_anything_is_sent(project, emulator):
    """llm_azure_endpoint is the provider's own key, checked by itself when dbt parses the model's config."""
    things, m = model(2)
    project.write("models/things.sql", things)
    project.write(
        "models/m.sql", m.replace("llm_azure_model=", "llm_azure_endpoint='x.openai.azure.com', llm_azure_model=")
    )
    message = failure_messages(project.dbt("run", "-s", "things", "m", expect_ok=False))
    assert "llm_azure_endpoint must be the resource's https:// URL, got 'x.openai.azure.com'" in message
    assert emulator.stats()["calls"] == {}
