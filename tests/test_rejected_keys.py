"""A wrong API key on the batch path (upload, create, poll): the run fails as a dbt error of the model that
names the variable holding the key and says it was rejected, never a Python traceback, never the key;
with the key fixed, the next run goes on and nothing is billed twice. The realtime path says the same
(tests/test_realtime.py, test_a_rejected_key_stops_the_run_without_failing_any_row)."""

from __future__ import annotations

import collections
import json

import pytest
from conftest import failure_messages
from helpers import TRIAGE_OUTPUT, gemini_triage_model, triage_model

WRONG = "sk-wrong-key-7f3a9c"


def assert_clean(project, message: str, var: str) -> None:
    assert "Traceback" not in message and "Python model failed" not in message, message[-1500:]
    assert "triage" in message and "the API key was rejected" in message and f"check {var}" in message, message
    assert_key_hidden(project, message)


def assert_key_hidden(project, text: str) -> None:
    assert WRONG not in text and WRONG[-4:] not in text, text
    for path in (project.root / "target").rglob("*"):
        if path.is_file():
            assert WRONG not in path.read_text(errors="replace"), path


def assert_billed_once(emulator) -> None:
    bodies = collections.Counter(json.dumps(b, sort_keys=True, default=str) for b in emulator.billed())
    assert all(n == 1 for n in bodies.values()), bodies


def azure_model() -> str:
    return (
        triage_model()
        .replace("llm_provider = 'openai'", "llm_provider = 'azure_openai', llm_azure_model = 'gpt-4o-mini'")
        .replace("llm_model = 'gpt-4o-mini'", "llm_model = 'batch-4o-mini'")
    )


MODELS = {
    "openai": (triage_model, "OPENAI_API_KEY"),
    "anthropic": (lambda: triage_model(provider="anthropic"), "ANTHROPIC_API_KEY"),
    "azure_openai": (azure_model, "AZURE_OPENAI_API_KEY"),
    "gemini": (gemini_triage_model, "GEMINI_API_KEY"),
}


@pytest.mark.parametrize("provider", sorted(MODELS))
def test_a_rejected_key_fails_the_model_with_the_variable_to_check(project, emulator, monkeypatch, api_key, provider):
    model, var = MODELS[provider]
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", model())
    monkeypatch.setenv(var, WRONG)
    r = project.dbt("run", "-s", "triage", expect_ok=False)
    assert not r.success
    message = failure_messages(r)
    print(message)
    assert_clean(project, message, var)
    assert f"llm_provider '{provider}'" in message
    assert emulator.batches() == [] and emulator.billed() == []
    monkeypatch.setenv(var, api_key)  # fixed: the next run sends, and the one after merges
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert len(emulator.billed()) == 6
    assert_billed_once(emulator)


def test_a_key_named_by_llm_api_key_env_is_named(project, emulator, monkeypatch):
    project.dbt("seed", "-s", "support_tickets")
    project.write(
        "models/triage.sql",
        triage_model(extra_config=f"llm_base_url = {emulator.openai_base_url!r}, llm_api_key_env = 'TEAM_KEY',"),
    )
    monkeypatch.setenv("TEAM_KEY", WRONG)
    r = project.dbt("run", "-s", "triage", expect_ok=False)
    message = failure_messages(r)
    assert_clean(project, message, "TEAM_KEY (named by llm_api_key_env)")


def test_a_rejected_aws_credential_on_bedrock(project, emulator, bedrock, monkeypatch):
    project.write("models/tickets.sql", "select i as ticket_id, 'ticket ' || i as prompt from range(100) t(i)")
    project.write(
        "models/triage.sql",
        f"""
{{{{ config(
    materialized = 'llm_batch', llm_provider = 'bedrock', llm_model = 'anthropic.claude-haiku-4-5-20251001-v1:0',
    unique_key = 'ticket_id', llm_system = 'Triage the ticket.', llm_output = {json.dumps(TRIAGE_OUTPUT)},
    llm_max_tokens = 200, llm_bedrock_s3_input = 's3://{bedrock}/requests',
    llm_bedrock_s3_output = 's3://{bedrock}/results', llm_bedrock_role_arn = 'arn:aws:iam::123456789012:role/b',
) }}}}
select ticket_id, prompt from {{{{ ref('tickets') }}}}
""",
    )
    project.dbt("run", "-s", "tickets")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", WRONG)
    r = project.dbt("run", "-s", "triage", expect_ok=False)
    message = failure_messages(r)
    print(message)
    assert "Traceback" not in message and "Python model failed" not in message, message[-1500:]
    assert "the API key was rejected" in message and "AWS_ACCESS_KEY_ID" in message, message
    assert_key_hidden(project, message)


def test_a_key_rejected_while_a_batch_is_in_flight_then_the_fixed_key_harvests_once(
    project, emulator, monkeypatch, api_key
):
    emulator.auto_advance_seconds = None
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    good = api_key
    monkeypatch.setenv("OPENAI_API_KEY", WRONG)
    r = project.dbt("run", "-s", "triage", expect_ok=False)
    assert not r.success
    assert_clean(project, failure_messages(r), "OPENAI_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", good)
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert len(emulator.batches()) == 1 and len(emulator.billed()) == 6
    assert_billed_once(emulator)


def test_a_key_rejected_for_a_batch_sent_before_the_model_switched_provider_names_that_provider(
    project, emulator, monkeypatch, api_key
):
    """The model moves from OpenAI to Anthropic with a batch in flight: the run polls that batch at
    OpenAI. When OpenAI rejects the key, the message names OpenAI and OPENAI_API_KEY (the key that
    was refused), not the model's provider now and its variable."""
    emulator.auto_advance_seconds = None
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")  # a batch in flight at OpenAI
    project.write("models/triage.sql", triage_model(provider="anthropic"))
    monkeypatch.setenv("OPENAI_API_KEY", WRONG)
    r = project.dbt("run", "-s", "triage", expect_ok=False)
    message = failure_messages(r)
    assert_clean(project, message, "OPENAI_API_KEY")
    assert "llm_provider 'openai'" in message and "ANTHROPIC_API_KEY" not in message, message
    monkeypatch.setenv("OPENAI_API_KEY", api_key)
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert_billed_once(emulator)


def test_the_poll_command_says_the_key_was_rejected(project, emulator, monkeypatch, capsys, api_key):
    from dbt_llm_batch.ops.cli import main as cli

    emulator.auto_advance_seconds = None
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.release_database()
    monkeypatch.setenv("OPENAI_API_KEY", WRONG)
    capsys.readouterr()
    rc = cli(["poll", "--database", str(project.db_path)])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 2, text
    assert "Traceback" not in text and "the API key was rejected" in text and "OPENAI_API_KEY" in text, text
    assert "main.triage: llm_provider 'openai'" in text, text  # the model whose batches it could not poll
    assert WRONG not in text and WRONG[-4:] not in text, text
    monkeypatch.setenv("OPENAI_API_KEY", api_key)
    assert cli(["poll", "--database", str(project.db_path)]) == 0
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert len(emulator.billed()) == 6
    assert_billed_once(emulator)


def test_an_error_that_is_no_provider_refusal_is_not_hidden():
    from dbt_llm_batch.providers import calls

    assert calls.refusal(ValueError("a bug"), "m", "OPENAI_API_KEY") is None
