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
from dbt_llm_batch.providers import get_provider
from dbt_llm_batch.sql import ident

DESIRED, INPUT, UNSENDABLE = Scratch.desired, Scratch.input, Scratch.unsendable


def context_limit(config: ModelConfig) -> int | None:
    """llm_max_context_tokens, else the context window the provider knows for the model (if any)."""
    if config.max_context_tokens:
        return config.max_context_tokens
    return get_provider(config.provider).context_window(config.model)


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
    limit = context_limit(config)
    if limit:
        # Without llm_max_tokens: what the provider reserves for the output (nothing, for some).
        output = config.max_tokens or get_provider(config.provider).default_max_tokens(config.model) or 0
        output_name = "llm_max_tokens" if config.max_tokens else "the default max_tokens"
        # The prompt's length is in DESIRED already (plan.build_desired, the same text): no second scan.
        estimate = costs.estimated_input_tokens_sql(config, chars_sql="d.prompt_chars")
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
    ledger.execute(f"""create or replace temp table {Scratch.unsendable} as
                       select d.row_id, d.key, d.fingerprint, {error_sql} as error, {row_json_sql(columns, "i.")} as row_json
                       from {DESIRED} d join {INPUT} i on i.rowid = d.row_id
                       where d.has_prompt and ({condition})""")
    if not record:
        n = ledger.execute(f"select count(*) from {UNSENDABLE}").fetchall()[0][0]
        ledger.execute(f"update {DESIRED} set has_prompt = false where row_id in (select row_id from {UNSENDABLE})")
        ledger.execute(f"drop table {UNSENDABLE}")
        return n
    n = 0
    # Usually none: recording them looks every selected key up among the ledger's requests.
    if ledger.execute(f"select exists (select 1 from {UNSENDABLE})").fetchall()[0][0]:
        n = ledger.record_never_sent(Scratch.unsendable, only_without_live_request=True)
        ledger.execute(f"update {DESIRED} set has_prompt = false where row_id in (select row_id from {UNSENDABLE})")
    ledger.execute(f"drop table {UNSENDABLE}")
    return n


def reject_deferred_without_prompt(ledger: Ledger, config: ModelConfig) -> int:
    """A request waiting over an in-flight cap whose stored row lacks the prompt column (the model's
    prompt column changed since) cannot be sent: it fails alone, with the reason, instead of waiting
    forever. (The planner leaves such requests out; a dry run records nothing.)"""
    if not ledger.has_deferred():  # the usual case: no update reading every deferred row's JSON
        return 0
    return ledger.fail_deferred_without_field(DESIRED, "$." + json.dumps(config.prompt_column), config.prompt_column)
