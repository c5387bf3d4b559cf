"""llm_finish_reason is the same word for the same outcome whatever the provider (an Anthropic
structured answer ends with the forced tool call, `tool_use`, an OpenAI one with `stop`: both show
`stop`); the ledger keeps the provider's own word."""

from __future__ import annotations

import pytest
from helpers import PROVIDER_MODELS, run, setup, triage_model

RAW = {  # the provider's own word, as the ledger keeps it
    "openai": {"structured": "stop", "text": "stop", "cut": "length"},
    "anthropic": {"structured": "tool_use", "text": "end_turn", "cut": "max_tokens"},
}


def test_same_outcome_same_word_for_both_providers(project, emulator, provider):
    project.dbt("seed")
    project.write("models/triage.sql", triage_model(provider=provider))
    setup(project, provider)  # the free-text model m over six rows
    project.write(
        "models/short.sql",
        f"""
{{{{ config(materialized='llm_batch', unique_key='a', llm_provider='{provider}', llm_model='{PROVIDER_MODELS[provider]}',
            llm_max_tokens=2, llm_max_attempts=1) }}}}
select * from {{{{ ref('things') }}}} where a = 1""",
    )
    project.dbt("run", "-s", "triage", "m", "short")
    emulator.complete_all()
    project.dbt("run", "-s", "triage", "m", "short")
    shown = {
        name: project.query(f"select distinct llm_finish_reason from main.{table}")
        for name, table in (("structured", "triage"), ("text", "m"), ("cut", "short"))
    }
    assert shown == {"structured": [("stop",)], "text": [("stop",)], "cut": [("length",)]}
    for name, model in (("structured", "main.triage"), ("text", "main.m"), ("cut", "main.short")):
        kept = project.query("select distinct finish_reason from main.llm_batch_requests where model = ?", [model])
        assert kept == [(RAW[provider][name],)], f"the ledger keeps {provider}'s own word"
    run(project)  # merging again changes nothing
    assert project.query("select distinct llm_finish_reason from main.m") == [("stop",)]


@pytest.mark.parametrize(
    ("provider", "raw", "word"),
    [
        ("openai", "stop", "stop"),
        ("anthropic", "end_turn", "stop"),
        ("anthropic", "tool_use", "stop"),
        ("anthropic", "stop_sequence", "stop"),
        ("openai", "length", "length"),
        ("anthropic", "max_tokens", "length"),
        ("openai", "content_filter", "content_filter"),
        ("anthropic", "refusal", "content_filter"),
        ("openai", "tool_calls", "tool_call"),
        ("openai_compatible", "length", "length"),
        ("openai", "something_new", "something_new"),  # a word not in the table is shown as written
    ],
)
def test_the_mapping_table(memory_con, provider, raw, word):
    from dbt_llm_batch.pipeline.merge import finish_reason_sql

    got = memory_con.execute(
        f"select {finish_reason_sql()} from (select ? as provider) j, (select ? as finish_reason) w", [provider, raw]
    ).fetchall()
    assert got == [(word,)]
