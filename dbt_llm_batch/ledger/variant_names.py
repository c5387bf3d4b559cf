"""A variant as the model's table names it (llm_variant), for the views that report per variant:
the ledger stores the default variant as '' (so adding variants to a model keeps its answers); the
table, and so every view and export a person reads, calls it by the model's llm_default_variant."""

from __future__ import annotations


def shown_variant_sql(column: str) -> str:
    """SQL: a variant as the model's table names it in llm_variant: the stored '' is the default
    variant, shown under the model's llm_default_variant (kept in its config snapshot) when the model
    has variants; a job's comma-separated list of variants is named the same way, each in turn. Reads
    `n.has_variants` and `n.default_name` (VARIANT_NAMES joined as `n` on model)."""
    return (
        f"case when not coalesce(n.has_variants, false) then {column} "
        f"else array_to_string(list_transform(string_split({column}, ','), "
        f"lambda v: case when v = '' then n.default_name else v end), ',') end"
    )


# Per model: whether its last run had evaluation variants, its default variant's name, and the
# snapshot itself (configured.py reads the provider and llm_model from it).
VARIANT_NAMES = """(select model, config_snapshot as snapshot,
           json_extract(config_snapshot, '$.config.llm_variants') is not null as has_variants,
           coalesce(json_extract_string(config_snapshot, '$.config.llm_default_variant'), 'default') as default_name
    from {s}.llm_batch_models)"""
