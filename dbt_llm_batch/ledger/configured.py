"""A model's provider and llm_model as its last run's config snapshot says (llm_batch_models.config_snapshot,
config.settle_snapshot), for the views that show them per model and variant: a model with nothing sent
yet has no job to read them from, and a variant may name its own (llm_variants)."""

from __future__ import annotations

from dbt_llm_batch.config_keys import BY_NAME
from dbt_llm_batch.sql import literal


def configured_sql(key: str, variant: str) -> str:
    """SQL: config `key` ('llm_provider' or 'llm_model') of the variant in column `variant` ('' the
    default) of the model: the variant's own value, else the model's, else the key's default (NULL
    when it has none, or the model has no snapshot: a ledger written before snapshots). Reads
    `n.snapshot` (VARIANT_NAMES joined as `n` on model)."""
    default = BY_NAME[key].default
    return (
        f"case when n.snapshot is not null then coalesce("
        f"""case when {variant} <> '' then json_extract_string(n.snapshot, """
        f"""'$.config.llm_variants."' || {variant} || '".{key}') end, """
        f"json_extract_string(n.snapshot, '$.config.{key}'), {literal(default) if default is not None else 'null'}) end"
    )
