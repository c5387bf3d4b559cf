"""Rows that cannot be sent fail alone, before planning, with a reason; the other rows go.

Like an empty prompt (planner.reject_empty_prompts), each such row gets one final 'failed' request
row with no job (nothing was sent, nothing billed), and is kept out of this run's plan. It is sent
once its input is fixed (a new fingerprint) or, for the context window, once the limit allows it.
"""

from __future__ import annotations

import json

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.pipeline import costs
from dbt_llm_batch.pipeline.plan import prompt_is_blob, row_json_sql
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.sql import ident

DESIRED, INPUT, UNSENDABLE = Scratch.desired, Scratch.input, Scratch.unsendable

# Context windows in tokens (input + output), by provider and model-name prefix (the longest listed
# prefix wins, as for prices); llm_max_context_tokens overrides. Sources: the providers' model pages.
CONTEXT_TOKENS = {
    ("openai", "gpt-4o"): 128_000,
    ("openai", "gpt-4o-mini"): 128_000,
    ("openai", "gpt-4.1"): 1_047_576,
    ("openai", "gpt-4.1-mini"): 1_047_576,
    ("openai", "gpt-4.1-nano"): 1_047_576,
    ("anthropic", "claude-"): 200_000,
}
# Output allowance when llm_max_tokens is not set: Anthropic's request default (anthropic_batch.py);
# OpenAI then reserves nothing in advance, so only the input is checked.
DEFAULT_OUTPUT_TOKENS = {"anthropic": 1024}


def context_limit(config: ModelConfig) -> int | None:
    if config.max_context_tokens:
        return config.max_context_tokens
    matches = [
        (len(prefix), n)
        for (provider, prefix), n in CONTEXT_TOKENS.items()
        if provider == config.provider and config.model.startswith(prefix)
    ]
    return max(matches)[1] if matches else None


def reject_unsendable(ledger: Ledger, config: ModelConfig, columns, record: bool = True) -> int:
    """Fail rows whose prompt bytes are not UTF-8 (a BLOB column) or whose estimated size is over the
    model's context window; returns how many failures were newly recorded. With `record` False (a dry
    run) nothing is written to the ledger: the rows are only kept out of the plan, and counted."""
    prompt = f"i.{ident(config.prompt_column)}"
    n = 0
    if prompt_is_blob(config, columns):
        n += _reject(
            ledger,
            columns,
            record,
            f"{prompt} is not null and try(decode({prompt})) is null",
            f"'prompt column {config.prompt_column} (a BLOB) holds bytes that are not valid UTF-8 text; "
            f"nothing was sent. Decode or convert it to text in the model''s SQL (for example from "
            f"Latin-1), or filter such rows out'",
        )
        text = f"try(decode({prompt}))"
    else:
        text = f"cast({prompt} as varchar)"
    limit = context_limit(config)
    if limit:
        output = config.max_tokens or DEFAULT_OUTPUT_TOKENS.get(config.provider, 0)
        output_name = "llm_max_tokens" if config.max_tokens else "the default max_tokens"
        estimate = costs.estimated_input_tokens_sql(config, text)
        source = "llm_max_context_tokens" if config.max_context_tokens else f"the context window of {config.model}"
        n += _reject(
            ledger,
            columns,
            record,
            f"{estimate} + {output} > {limit}",
            f"""'prompt is too long: estimated ' || {estimate} || ' input tokens + {output} output tokens '
                         || '({output_name}) = ' || ({estimate} + {output}) || ', over {limit} tokens ({source}); '
                         || 'nothing was sent. Shorten the prompt, or set llm_max_context_tokens if the model '
                         || 'accepts more'""",
        )
    return n


def _reject(ledger: Ledger, columns, record: bool, condition: str, error_sql: str) -> int:
    """Record a final failure for each sendable row matching `condition` (once per key and
    fingerprint; with `record` False, none: returns how many match), and take all matching rows out
    of this run's plan."""
    requests = ledger.table("llm_batch_requests")
    ledger.execute(f"""create or replace temp table {UNSENDABLE} as
                       select d.row_id, d.key, d.fingerprint, {error_sql} as error, {row_json_sql(columns, "i.")} as row_json
                       from {DESIRED} d join {INPUT} i on i.rowid = d.row_id
                       where d.has_prompt and ({condition})""")
    if not record:
        n = ledger.execute(f"select count(*) from {UNSENDABLE}").fetchall()[0][0]
        ledger.execute(f"update {DESIRED} set has_prompt = false where row_id in (select row_id from {UNSENDABLE})")
        ledger.execute(f"drop table {UNSENDABLE}")
        return n
    n = ledger.execute(
        f"""insert into {requests} (custom_id, model, key, fingerprint, seq, status, is_final, error, row_json,
              queued_at, completed_at)
            select 'x_' || substr(sha256(? || u.key || u.fingerprint), 1, 40), ?, u.key, u.fingerprint, 0, 'failed',
                   true, u.error, u.row_json, now(), now()
            from {UNSENDABLE} u
            where not exists (select 1 from {requests} r
                              where r.model = ? and r.key = u.key and r.fingerprint = u.fingerprint
                                and (r.job_id is null or r.status in ('succeeded', 'queued', 'submitted', 'held')))""",
        [ledger.model, ledger.model, ledger.model],
    ).fetchall()[0][0]
    ledger.execute(f"update {DESIRED} set has_prompt = false where row_id in (select row_id from {UNSENDABLE})")
    ledger.execute(f"drop table {UNSENDABLE}")
    return n


def reject_deferred_without_prompt(ledger: Ledger, config: ModelConfig) -> int:
    """A request waiting over an in-flight cap whose stored row lacks the prompt column (the model's
    prompt column changed since) cannot be sent: it fails alone, with the reason, instead of waiting
    forever. (The planner leaves such requests out; a dry run records nothing.)"""
    return ledger.execute(
        f"""update {ledger.table("llm_batch_requests")} set status = 'failed', is_final = true, completed_at = now(),
              error = 'waited over an in-flight cap, but its stored row has no prompt column ' || ? ||
                      ' (the model''s prompt column changed); nothing was sent'
            where model = ? and status = 'deferred' and key not in (select key from {DESIRED})
              and json_extract_string(row_json, ?) is null""",
        [config.prompt_column, ledger.model, "$." + json.dumps(config.prompt_column)],
    ).fetchall()[0][0]
