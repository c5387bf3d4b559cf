"""Bad input fails alone, before anything is sent, with a message saying how to fix it; the other
rows go. (NULL/empty prompts, bad answers and config errors are covered in test_config/test_models.)"""

from __future__ import annotations

import json
import math

import pytest
from helpers import PROVIDER_MODELS, TRIAGE_OUTPUT, TRIAGE_SYSTEM, batch_counts, batch_input_lines, expected_triage

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]
LONG = 1_000_000  # characters: about 250,000 tokens, over every listed model's context window


def model_sql(provider: str, prompt_sql: str, extra: str = "") -> str:
    return f"""
{{{{ config(materialized='llm_batch', llm_provider='{provider}', llm_model='{PROVIDER_MODELS[provider]}',
            unique_key='ticket_id', llm_system={json.dumps(TRIAGE_SYSTEM)}, llm_output={json.dumps(TRIAGE_OUTPUT)},
            llm_max_tokens=200, {extra}) }}}}
select ticket_id, {prompt_sql} as prompt from {{{{ ref('support_tickets') }}}}
"""


def sent_prompts(emulator, provider: str) -> list[str]:
    """The user message of every request the emulator received, over all batches."""
    prompts = []
    for batch in emulator.batches():
        if provider == "openai":
            prompts += [line["body"]["messages"][-1]["content"] for line in batch_input_lines(emulator, batch)]
        else:
            face = [f for f in emulator.faces if f.name == "anthropic"][0]
            job = face.jobs.get(batch["id"]) or face.deleted[batch["id"]]
            prompts += [r["params"]["messages"][-1]["content"] for r in job.requests]
    return prompts


def test_a_prompt_over_the_context_window_fails_alone_before_sending(project, emulator, provider):
    prompt = "case when ticket_id = 3 then repeat('x', {n}) else 'Subject: ' || subject end"
    project.write(MODEL, model_sql(provider, prompt.format(n=LONG)))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [5]  # the rest go
    emulator.complete_all()
    project.dbt("run", *SELECT)

    estimate = math.ceil((len(TRIAGE_SYSTEM) + LONG) / 4) + 16  # 4 characters a token; 2 messages of overhead
    window = {
        "openai": "128000 tokens (the context window of gpt-4o-mini)",
        "anthropic": "200000 tokens (the context window of claude-sonnet-4-5)",
    }[provider]
    assert project.query(
        "select ticket_id, llm_status, llm_error, llm_batch_id from main.triage where ticket_id = 3"
    ) == [
        (
            3,
            "failed",
            f"prompt is too long: estimated {estimate} input tokens + 200 output tokens (llm_max_tokens) "
            f"= {estimate + 200}, over {window}; nothing was sent. Shorten the prompt, or set "
            f"llm_max_context_tokens if the model accepts more",
            None,
        )
    ]
    rows = project.query(
        "select t.ticket_id, s.subject, t.llm_status, t.category, t.urgent, t.summary from main.triage t "
        "join main.support_tickets s using (ticket_id) where ticket_id <> 3 order by 1"
    )
    assert len(rows) == 5
    for _, subject, status, *answer in rows:
        assert status == "succeeded" and tuple(answer) == expected_triage(TRIAGE_SYSTEM, f"Subject: {subject}")
    assert all(len(p) < 1000 for p in sent_prompts(emulator, provider))

    project.dbt("run", *SELECT)  # not sent later either, and failed once, not once per run
    assert batch_counts(emulator) == [5]
    assert project.query("select count(*) from main.llm_batch_requests where status = 'failed'") == [(1,)]

    # A model that accepts more: the override lets the same row go, without a prompt change.
    project.write(MODEL, model_sql(provider, prompt.format(n=LONG), "llm_max_context_tokens=2000000"))
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [5, 1]


def test_llm_max_context_tokens_overrides_the_known_window(project, emulator):
    project.write(MODEL, model_sql("openai", "'Subject: ' || subject || ' ' || body", "llm_max_context_tokens=265"))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    lengths = project.query("select ticket_id, length('Subject: ' || subject || ' ' || body) from main.support_tickets")
    over = sorted(t for t, n in lengths if math.ceil((len(TRIAGE_SYSTEM) + n) / 4) + 16 + 200 > 265)
    assert over and len(over) < 6  # the seed has prompts on both sides of the limit
    assert batch_counts(emulator) == [6 - len(over)]
    errors = project.query("select error from main.llm_batch_requests where status = 'failed'")
    assert len(errors) == len(over)
    assert all(
        e.endswith(
            ", over 265 tokens (llm_max_context_tokens); nothing was sent. Shorten the prompt, or "
            "set llm_max_context_tokens if the model accepts more"
        )
        for (e,) in errors
    )


def test_a_blob_prompt_is_sent_as_text_and_bytes_that_are_not_utf8_fail_alone(project, emulator, provider):
    prompt = "case when ticket_id = 4 then '\\xFF\\xFEnot text'::blob else encode('Café ' || subject) end"
    project.write(MODEL, model_sql(provider, prompt))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [5]
    subjects = dict(project.query("select ticket_id, subject from main.support_tickets"))
    assert sorted(sent_prompts(emulator, provider)) == sorted(f"Café {s}" for t, s in subjects.items() if t != 4)
    emulator.complete_all()
    project.dbt("run", *SELECT)

    assert project.query(
        "select data_type from information_schema.columns where table_name = 'triage' and column_name = 'prompt'"
    ) == [("BLOB",)]
    assert project.query("select prompt, llm_status, llm_error from main.triage where ticket_id = 4") == [
        (
            b"\xff\xfenot text",
            "failed",
            "prompt column prompt (a BLOB) holds bytes that are not valid UTF-8 text; "
            "nothing was sent. Decode or convert it to text in the model's SQL (for "
            "example from Latin-1), or filter such rows out",
        )
    ]
    rows = project.query(
        "select ticket_id, prompt, llm_status, category, urgent, summary from main.triage "
        "where ticket_id <> 4 order by 1"
    )
    assert len(rows) == 5
    for ticket_id, blob, status, *answer in rows:  # each row keeps its bytes and gets its own answer
        assert blob == f"Café {subjects[ticket_id]}".encode()
        assert status == "succeeded" and tuple(answer) == expected_triage(TRIAGE_SYSTEM, f"Café {subjects[ticket_id]}")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [5]


def test_a_dry_run_keeps_unsendable_rows_out_of_the_plan_and_records_nothing(project, emulator):
    prompt = "case when ticket_id = 4 then '\\xFF\\xFEnot text'::blob else encode('Café ' || subject) end"
    project.write(MODEL, model_sql("openai", prompt, extra="llm_dry_run=true,"))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "DRY RUN: would submit 5 request(s) in 1 batch(es)" in log
    assert "; 1 would fail without being sent (prompt not sendable)" in log
    assert project.query("select count(*) from main.llm_batch_requests") == [(0,)]
    assert emulator.stats()["calls"] == {}


@pytest.mark.parametrize(
    "value, message",
    [
        (-1, "llm_max_context_tokens must be >= 1, got -1"),
        ("yes", "llm_delete_provider_files must be true or false, got 'yes'"),
    ],
)
def test_new_config_keys_are_validated(value, message):
    from dbt_llm_batch.config import parse_config
    from dbt_llm_batch.errors import ConfigError

    key = "llm_max_context_tokens" if value == -1 else "llm_delete_provider_files"
    with pytest.raises(ConfigError) as err:
        parse_config({"unique_key": "id", "llm_model": "gpt-4o-mini", key: value})
    assert str(err.value) == f"invalid llm_batch config:\n  - {message}"


def test_a_deferred_blob_prompt_is_sent_as_text_by_a_later_run(project, emulator, monkeypatch):
    """Over an in-flight cap, rows wait in the ledger with their row as JSON; a later run that no longer
    selects them sends the prompt decoded from the stored bytes, not DuckDB's escaped form."""
    from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider

    monkeypatch.setattr(OpenAIBatchProvider, "max_requests_per_batch", 2)
    project.write(MODEL, model_sql("openai", "encode('Café ' || subject)", "llm_max_batches_in_flight=1"))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [2]
    project.write(
        MODEL,
        model_sql("openai", "encode('Café ' || subject)", "llm_max_batches_in_flight=1").replace(
            "from {{ ref('support_tickets') }}", "from {{ ref('support_tickets') }} where ticket_id <= 2"
        ),
    )
    for _ in range(2):
        emulator.complete_all()
        project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [2, 2, 2]
    subjects = [s for (s,) in project.query("select subject from main.support_tickets")]
    assert sorted(sent_prompts(emulator, "openai")) == sorted(f"Café {s}" for s in subjects)
