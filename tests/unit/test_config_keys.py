"""The config table (config_keys.py) is the one declaration of each key: what it says is what parsing,
variants, the fingerprint, the settle snapshot and the reference page do."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dbt_llm_batch.config import ModelConfig, parse_config, settle_snapshot
from dbt_llm_batch.config_keys import CONFIG_KEYS, KEYS, VARIANT_CONFIG_KEYS
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.ops import check, config_reference

BASE = {"unique_key": "id", "llm_model": "m", "llm_system": "s", "llm_output": {"a": "text"}}
SOME_VARIANT = {"llm_variants": {"b": {"llm_model": "n"}}}
# For each key, a change from BASE (None removes a key): the table's every key must have one here.
CHANGES: dict[str, dict] = {
    "unique_key": {"unique_key": ["id", "other"]},
    "llm_provider": {"llm_provider": "anthropic"},
    "llm_model": {"llm_model": "n"},
    "llm_task": {"llm_task": "embed", "llm_model": "text-embedding-3-small", "llm_system": None, "llm_output": None},
    "llm_dimensions": {
        "llm_task": "embed",
        "llm_model": "text-embedding-3-small",
        "llm_system": None,
        "llm_output": None,
        "llm_dimensions": 256,
    },
    "llm_prompt_column": {"llm_prompt_column": "text"},
    "llm_system": {"llm_system": "t"},
    "llm_examples": {"llm_examples": [{"input": "a", "output": "b"}]},
    "llm_cache_prefix": {"llm_cache_prefix": True},
    "llm_max_tokens": {"llm_max_tokens": 9},
    "llm_temperature": {"llm_temperature": 0.5},
    "llm_params": {"llm_params": {"top_p": 0.9}},
    "llm_output": {"llm_output": {"x": "text"}},
    "llm_output_format": {"llm_output_format": "json"},
    "llm_output_from_columns": {
        "llm_output": None,
        "llm_output_from_columns": True,
        "columns": [{"name": "a", "data_type": "bigint"}],
    },
    "columns": {"llm_output": None, "llm_output_from_columns": True, "columns": [{"name": "z", "data_type": "text"}]},
    "llm_max_attempts": {"llm_max_attempts": 7},
    "llm_wait_seconds": {"llm_wait_seconds": 30},
    "llm_ledger_schema": {"llm_ledger_schema": "other"},
    "llm_ledger_identity": {"llm_ledger_identity": "main.old_name"},
    "llm_on_unselected": {"llm_on_unselected": "delete"},
    "llm_updated_at": {"llm_updated_at": "updated_at"},
    "on_schema_change": {"on_schema_change": "sync_all_columns"},
    "llm_dedup": {"llm_dedup": "ledger"},
    "llm_delete_provider_files": {"llm_delete_provider_files": False},
    "llm_max_batches_in_flight": {"llm_max_batches_in_flight": 2},
    "llm_max_tokens_in_flight": {"llm_max_tokens_in_flight": 1000},
    "llm_retry_budget_seconds": {"llm_retry_budget_seconds": 5},
    "llm_on_unavailable": {"llm_on_unavailable": "error"},
    "llm_max_context_tokens": {"llm_max_context_tokens": 1000},
    "llm_max_cost_usd": {"llm_max_cost_usd": 1.0},
    "llm_dry_run": {"llm_dry_run": True},
    "llm_price_table": {"llm_price_table": "main.prices"},
    "llm_budget_basis": {"llm_budget_basis": "expected"},
    "llm_realtime_when": {"llm_realtime_when": "true"},
    "llm_fallback": {"llm_fallback": "realtime"},
    "llm_concurrency": {"llm_concurrency": 4},
    "llm_max_concurrency": {"llm_max_concurrency": 8},
    "llm_realtime_budget_seconds": {"llm_realtime_budget_seconds": 10},
    "llm_variants": SOME_VARIANT,
    "llm_default_variant": {**SOME_VARIANT, "llm_default_variant": "champion"},
    "llm_variant_sample": {**SOME_VARIANT, "llm_variant_sample": {"b": 0.5}},
}
# ModelConfig fields no single key fills as written: derived from several keys, or set by the parse.
DERIVED_FIELDS = {
    "output",
    "output_columns",
    "options",
    "concurrency",
    "adaptive_concurrency",
    "dedup",
    "dedup_defaulted_off",
    "legacy_prefix",
    "variant",
    "variant_name",
    "variants",
    "variant_sample",
}


def changed(key: str) -> dict:
    raw = {**BASE, **CHANGES[key]}
    return {k: v for k, v in raw.items() if v is not None}


def test_every_key_has_a_change_here():
    assert sorted(CHANGES) == sorted(key.name for key in KEYS)


@pytest.mark.parametrize("key", KEYS, ids=lambda key: key.name)
def test_a_key_changes_the_fingerprint_exactly_when_the_table_says_it_changes_the_answer(key):
    before, after = parse_config(BASE), parse_config(changed(key.name))
    assert (after.fingerprint_prefix() != before.fingerprint_prefix()) == key.changes_answer


def test_the_fingerprint_is_made_of_the_keys_that_change_the_answer():
    fields = parse_config(BASE).answer_defining_fields()
    # Keys added after fingerprints were pinned are in it only when set (a chat model's stays as it was).
    assert sorted(fields) == sorted(
        {key.fingerprint for key in KEYS if key.fingerprint and not key.fingerprint_omits_default}
    )
    embedding = parse_config(changed("llm_dimensions")).answer_defining_fields()
    assert sorted(embedding) == sorted({key.fingerprint for key in KEYS if key.fingerprint})
    assert sorted(fields) == [
        "examples",
        "max_tokens",
        "model",
        "output_schema",
        "params",
        "provider",
        "system",
        "temperature",
    ]


@pytest.mark.parametrize(
    "key",
    [k for k in CONFIG_KEYS if k.name.startswith("llm_") and k.name not in VARIANT_CONFIG_KEYS],
    ids=lambda key: key.name,
)
def test_a_variant_may_set_exactly_the_keys_the_table_lets_it(key):
    overrides = {key.name: CHANGES[key.name][key.name]}
    raw = {**BASE, "llm_variants": {"v": overrides}}
    if key.variant:
        (variant,) = parse_config(raw).variants
        assert variant.fingerprint_prefix() == parse_config(changed(key.name)).fingerprint_prefix()
    else:
        with pytest.raises(ConfigError, match=f"'{key.name}' cannot differ per variant"):
            parse_config(raw)


def test_every_field_of_a_config_is_a_key_s_or_derived():
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    declared = {key.field for key in KEYS if key.field}
    assert declared <= fields
    assert fields - declared == DERIVED_FIELDS
    assert all(hasattr(parse_config(BASE), key.fingerprint) for key in KEYS if key.fingerprint)


YAML_COLUMNS = [
    {"name": "id", "data_type": "integer"},
    {"name": "who", "data_type": "STRUCT(name VARCHAR, email VARCHAR)", "description": "the person"},
    {"name": "skills", "data_type": "VARCHAR[]"},
    {"name": "since", "data_type": "date"},
    {"name": "notes", "data_type": None},
]
FORMS = {
    "compact dict": {**BASE, "llm_output": {"label": ["a", "b"], "n": "integer", "ok": "boolean"}},
    "schema fragments": {
        **BASE,
        "llm_output": {
            "tags": {"type": "array", "items": {"type": "string"}},
            "at": {"type": "string", "format": "date"},
        },
        "llm_output_format": "json",
    },
    "yaml columns": {**changed("llm_output_from_columns"), "columns": YAML_COLUMNS},
    "variants": {
        **BASE,
        "llm_examples": [{"input": "x", "output": "y"}],
        "llm_variants": {"claude": {"llm_provider": "anthropic", "llm_model": "c", "llm_system": "secret prompt"}},
    },
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_config_form_round_trips_through_the_settle_snapshot(form):
    raw = FORMS[form]
    original = parse_config(raw)
    snapshot = json.loads(settle_snapshot(raw, "model_name"))
    assert snapshot["dbt_name"] == "model_name"
    rebuilt = parse_config(snapshot["config"])
    for before, after in zip(original.all_variants(), rebuilt.all_variants(), strict=True):
        assert after.output_columns == before.output_columns
        assert after.output_json_schema() == before.output_json_schema()
        assert after.table_outputs() == before.table_outputs()
        assert (after.variant, after.provider, after.model, after.unique_key) == (
            before.variant,
            before.provider,
            before.model,
            before.unique_key,
        )
    # What the table marks as not kept (the prompts) is not in it, for the model nor any variant.
    dropped = [key.name for key in KEYS if not key.snapshot]
    assert not set(dropped) & set(snapshot["config"])
    for overrides in (snapshot["config"].get("llm_variants") or {}).values():
        assert not set(dropped) & set(overrides)
    assert "secret prompt" not in json.dumps(snapshot)


def test_the_reference_page_is_what_the_table_generates():
    page = config_reference.PAGE.read_text()
    assert page == config_reference.render(), f"run `{config_reference.COMMAND}`"
    for key in KEYS:
        assert f"| `{key.name}` |" in page
    assert "| `llm_base_url` | `openai_compatible` |" in page  # a provider's own keys, declared by the provider


def test_check_reads_the_yaml_columns_as_the_materialization_passes_them():
    def manifest(data_type: str) -> dict:
        node = {
            "unique_id": "model.p.m",
            "name": "m",
            "resource_type": "model",
            "original_file_path": "models/m.sql",
            "config": {
                "materialized": "llm_batch",
                "unique_key": "id",
                "llm_model": "m",
                "llm_output_from_columns": True,
            },
            "columns": {
                "id": {"name": "id", "data_type": "integer", "description": ""},
                "label": {"name": "label", "data_type": data_type, "description": "the label"},
            },
        }
        return {"nodes": {node["unique_id"]: node}}

    assert check.problems(manifest("varchar")) == (1, [])
    checked, found = check.problems(manifest("NOT_A_TYPE"))
    assert checked == 1 and len(found) == 1
    assert found[0].startswith("m (models/m.sql): invalid llm_batch config:") and "column 'label'" in found[0]
