"""Descriptions of the llm_* columns, written as DuckDB column comments on every llm_batch table.

dbt-duckdb's catalog query reads column comments, and `dbt docs` shows a column's catalog comment
when the model's YAML gives it no description; so every llm_batch model documents these columns in
`dbt docs` without a line of YAML. A description the user writes in YAML is shown instead (and, with
persist_docs, dbt writes it over ours after the run).
"""

from __future__ import annotations

from dbt_llm_batch import output_schema
from dbt_llm_batch.config import STATUS_COLUMNS, ModelConfig
from dbt_llm_batch.ledger import retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import RequestStatus
from dbt_llm_batch.sql import ident, literal

_SUCCEEDED, _FAILED = RequestStatus.SUCCEEDED, RequestStatus.FAILED

# One per column dbt-llm-batch adds (config.STATUS_COLUMNS), plus the free-text answer column.
COLUMN_DESCRIPTIONS = {
    "llm_output": f"The model's answer (free text; llm_output is not set). NULL when llm_status is '{_FAILED}'.",
    "llm_status": f"'{_SUCCEEDED}' or '{_FAILED}': the final outcome of this row's request (rows in flight are not in the table).",
    "llm_error": "Why the request failed: the provider's error, an answer that does not match llm_output or has a value its column cannot hold, or one that was cut off.",
    "llm_finish_reason": "Why the provider stopped generating this answer (its finish reason).",
    "llm_input_tokens": "Input tokens billed for this row, cache reads and writes included.",
    "llm_output_tokens": "Output tokens billed for this row.",
    "llm_model": "The provider's model that answered this row.",
    "llm_batch_id": "The provider batch that answered this row (NULL for a realtime row).",
    "llm_fingerprint": "Hash of everything that defines the request (prompt, model, system, output schema, ...): a change asks the row again.",
    "llm_completed_at": "When the answer was harvested into the ledger.",
    "llm_cache_read_tokens": "Of the input tokens, how many were read from the provider's prompt cache.",
    "llm_cache_write_tokens": "Of the input tokens, how many were written to the provider's prompt cache.",
    "llm_cost_usd": "What this row's request cost in USD (batch prices, or list prices for a realtime row); NULL without a price.",
    "llm_realtime_cost_usd": "What the same tokens would cost at realtime list prices, in USD (NULL for a self-hosted engine).",
    "llm_route": "'batch' or 'realtime': how the row was sent; 'reused': answered from a stored answer at no cost (llm_dedup); NULL for a row never sent (an empty prompt).",
    "llm_variant": "The evaluation variant (llm_variants) that answered this row; llm_default_variant names the model's own config.",
}


def output_description(name: str, schema: dict) -> str:
    """An output column's description: what it holds (output_schema.describe), and when it is NULL."""
    return f"{output_schema.describe(name, schema)}. NULL when llm_status is '{_FAILED}'."


def comment_columns(con, target: str, config: ModelConfig) -> None:
    """Comment the columns dbt-llm-batch adds to `target` (again after each run: a rebuild drops them)."""
    described = {name: COLUMN_DESCRIPTIONS.get(name) or "" for name, _ in STATUS_COLUMNS}
    if config.variant_name is not None:  # a model with evaluation variants
        described["llm_variant"] = COLUMN_DESCRIPTIONS["llm_variant"]
    # The table's output columns: one per field, or the whole answer as one column (llm_output_format).
    whole_answer = not config.structured or config.output_format == "json"
    schemas = {c.name: c.json_schema for c in config.output_columns}
    for name, _ in config.table_outputs():
        if not config.structured:
            described[name] = COLUMN_DESCRIPTIONS["llm_output"]
        elif whole_answer:
            described[name] = (
                f"The whole answer as JSON (llm_output_format = 'json'). NULL when llm_status is '{_FAILED}'."
            )
        else:
            described[name] = output_description(name, schemas[name])

    def write():
        with transaction(con):
            for name, text in described.items():
                if text:
                    con.execute(f"comment on column {target}.{ident(name)} is {literal(text)}")

    # A comment changes the catalog, which DuckDB lets one thread change at a time (dbt runs models
    # in threads): retried like the merge's own writes.
    retry_on_conflict(write)
