"""llm_variants, llm_default_variant and llm_variant_sample parsed on their own: every problem of every
variant at once, each named, before anything is recorded or sent."""

from __future__ import annotations

import hashlib
import json

import duckdb
import pytest

from dbt_llm_batch.config import parse_config, settle_snapshot
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.pipeline import variants

BASE = {
    "unique_key": "id",
    "llm_model": "gpt-4o-mini",
    "llm_system": "Classify the ticket.",
    "llm_output": {"category": ["billing", "bug", "other"]},
}
VARIANTS = {
    "terse": {"llm_system": "Category only."},
    "claude": {"llm_provider": "anthropic", "llm_model": "claude-3-5-haiku-latest", "llm_max_tokens": 200},
}


def test_the_model_s_own_keys_are_the_default_variant_and_each_variant_overrides_them():
    config = parse_config({**BASE, "llm_variants": VARIANTS})
    assert config.variant == "" and config.variant_name == "default"
    assert [(v.variant, v.variant_name) for v in config.all_variants()] == [
        ("", "default"),
        ("claude", "claude"),  # sorted by name: dbt's parse does not keep a dict's order
        ("terse", "terse"),
    ]
    claude, terse = config.variants
    assert (claude.provider, claude.model, claude.system) == (
        "anthropic",
        "claude-3-5-haiku-latest",
        BASE["llm_system"],
    )
    assert (terse.provider, terse.model, terse.system) == ("openai", "gpt-4o-mini", "Category only.")
    assert terse.table_outputs() == config.table_outputs() == claude.table_outputs()
    # Each variant has its own fingerprint: editing one re-asks only its rows.
    prefixes = {c.fingerprint_prefix() for c in config.all_variants()}
    assert len(prefixes) == 3
    # The variants do not change the default's fingerprint: adding them to a model re-asks nothing.
    assert config.fingerprint_prefix() == parse_config(BASE).fingerprint_prefix()
    assert parse_config(BASE).variant_name is None and parse_config(BASE).variants == ()


def test_a_named_default_variant_and_samples():
    config = parse_config(
        {**BASE, "llm_variants": VARIANTS, "llm_default_variant": "champion", "llm_variant_sample": {"terse": 0.25}}
    )
    assert config.variant_name == "champion"
    assert {v.variant: v.variant_sample for v in config.variants} == {"claude": None, "terse": 0.25}


def test_every_problem_of_every_variant_is_reported_at_once_naming_the_variant_and_key():
    with pytest.raises(ConfigError) as error:
        parse_config(
            {
                **BASE,
                "llm_variants": {
                    "wide": {"llm_output": {"category": "text"}, "llm_max_cost_usd": 1},
                    "hot": {"llm_temperature": 9},
                    "default": {"llm_model": "x"},
                    "bad name!": {},
                    "flat": "gpt-4o",
                },
                "llm_variant_sample": {"hot": 1.5, "ghost": 0.1, "default": 0.5},
            }
        )
    message = str(error.value)
    assert "llm_variants['wide']: 'llm_max_cost_usd' cannot differ per variant" in message
    assert "llm_variants['wide']: 'llm_output' cannot differ per variant" in message
    assert "llm_variants['hot']: llm_temperature must be >= 0 and <= 2, got 9" in message
    assert "llm_variants['default']: 'default' is the default variant" in message
    assert "llm_variants['bad name!']: a variant name is letters" in message
    assert "llm_variants['flat'] must be a dict" in message
    assert "llm_variant_sample['hot'] must be a fraction above 0 and at most 1, got 1.5" in message
    assert "llm_variant_sample['ghost']: no such variant in llm_variants" in message
    assert "llm_variant_sample['default']: the default variant answers every row" in message


def test_a_variant_s_provider_checks_its_own_keys():
    with pytest.raises(ConfigError) as error:
        parse_config({**BASE, "llm_variants": {"claude": {"llm_provider": "nope"}}})
    assert "llm_variants['claude']: llm_provider must be one of" in str(error.value)


def test_the_settle_snapshot_keeps_no_variant_prompt():
    snapshot = settle_snapshot({**BASE, "llm_variants": VARIANTS})
    assert "Category only." not in snapshot and "Classify the ticket." not in snapshot
    assert "claude-3-5-haiku-latest" in snapshot  # what the poller needs to reach the variant's batches
    # The poller rebuilds the config from it (without the prompts).
    rebuilt = parse_config(json.loads(snapshot)["config"])
    assert [v.variant for v in rebuilt.all_variants()] == ["", "claude", "terse"]


def test_the_sample_is_a_deterministic_hash_of_the_key_and_nested_by_fraction():
    con = duckdb.connect()
    con.execute("create table k as select to_json([cast(i as varchar)]) as key from range(4000) t(i)")
    quarter = {r[0] for r in con.execute(f"select key from k where {variants.sample_condition(0.25)}").fetchall()}
    half = {r[0] for r in con.execute(f"select key from k where {variants.sample_condition(0.5)}").fetchall()}
    assert 850 < len(quarter) < 1150 and 1800 < len(half) < 2200  # about the fraction (md5 is uniform)
    assert quarter < half  # a larger sample answers a superset of a smaller one's keys
    # The same keys on every run: a fixed function of the key text, not of the connection or the order.
    other = duckdb.connect()
    other.execute("create table k as select to_json([cast(i as varchar)]) as key from range(3999, -1, -1) t(i)")
    again = {r[0] for r in other.execute(f"select key from k where {variants.sample_condition(0.25)}").fetchall()}
    assert again == quarter
    # The documented rule, computed apart in Python: the first 32 bits of md5(key) over 2**32.
    expected = {
        f'["{i}"]' for i in range(4000) if int(hashlib.md5(f'["{i}"]'.encode()).hexdigest()[:8], 16) / 2**32 < 0.25
    }
    assert quarter == expected
