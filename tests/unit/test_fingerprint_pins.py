"""The fingerprints of existing configs never change: a changed fingerprint re-asks (and re-pays) every
row of the model. Each value here was computed by the code before the config table (config_keys.py)
existed; a change to how keys are declared, parsed or fingerprinted must keep every one of them."""

from __future__ import annotations

import pytest

from dbt_llm_batch.config import parse_config

CASES = {
    "plain": {"unique_key": "id", "llm_model": "gpt-4o-mini"},
    "everything": {
        "unique_key": ["a", "b"],
        "llm_provider": "anthropic",
        "llm_model": "claude-3-5-haiku",
        "llm_system": "Be brief.",
        "llm_examples": [{"input": "hi", "output": {"b": 1, "a": "x"}}],
        "llm_max_tokens": 50,
        "llm_temperature": 0.5,
        "llm_params": {"top_p": 0.9, "stop": ["\n"]},
        "llm_output": {
            "sentiment": ["pos", "neg"],
            "score": "integer",
            "tags": {"type": "array", "items": {"type": "string"}},
            "note": {"type": "string", "description": "why"},
        },
        "llm_max_attempts": 5,
        "llm_cache_prefix": "1h",
        "llm_dedup": "ledger",
    },
    "json_format": {
        "unique_key": "id",
        "llm_model": "gpt-4o-mini",
        "llm_output": {"z": "number", "a": "boolean"},
        "llm_output_format": "json",
    },
    "from_columns": {
        "unique_key": "id",
        "llm_model": "gpt-4o-mini",
        "llm_output_from_columns": True,
        "columns": [
            {"name": "id", "data_type": "integer"},
            {"name": "label", "data_type": "VARCHAR", "description": "the label"},
            {"name": "n", "data_type": "BIGINT"},
            {"name": "undocumented", "data_type": None},
        ],
    },
    "variants": {
        "unique_key": "id",
        "llm_model": "gpt-4o-mini",
        "llm_output": {"x": "text"},
        "llm_variants": {
            "big": {"llm_model": "gpt-4o", "llm_temperature": 0},
            "claude": {"llm_provider": "anthropic", "llm_model": "claude-3-5-haiku", "llm_max_tokens": 100},
        },
    },
}

# (variant, fingerprint_prefix, legacy_prefix) of each case's variants, the default first.
PINNED = {
    "plain": [("", "06b36a03dfa84db622450e3f559eeb35733e3ede1d0b4ebddd38e2ae596608f9", None)],
    "everything": [
        (
            "",
            "3ddfe79b485a4c81c73927941116e1c7f05b5848d2c02e483d293fcd661fec91",
            "534c84a0009c7802ce8107ecbad49f21f066f6844f6946871e08ff22649a064d",
        )
    ],
    "json_format": [
        (
            "",
            "99e7af59d705191a3a30cc9b2050df8b8006d022fecb73cc0ce6442909eae255",
            "e1a9056f9a5a53d1a6c79d4956648d23a6c4ebb17ab4cc27a0ce5578141da7b9",
        )
    ],
    "from_columns": [("", "0e082e314b2a20e3f93c55dcc4471896ad2f0fd5db73f3cdb6c5def7f0cf44d1", None)],
    "variants": [
        ("", "d626bc8cb7084874dbce2d4db48459fe5bdd0800f2014ed605910e0b977a1cdb", None),
        ("big", "bfd286634d5b48cfa31d6919ac3433e80c4a6036681a51f55dea2546539451f7", None),
        ("claude", "090f14e776a86a016a2a293223a10d3b3fbd458c0f051a14026c6cfb52199786", None),
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fingerprints_of_existing_configs_are_unchanged(name):
    config = parse_config(CASES[name])
    assert [(v.variant, v.fingerprint_prefix(), v.legacy_prefix) for v in config.all_variants()] == PINNED[name]
