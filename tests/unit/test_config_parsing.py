"""Config parsing on its own: every problem in one message, before anything runs."""

from __future__ import annotations

import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError


def test_unknown_provider_and_bad_output_types_are_reported_together():
    with pytest.raises(ConfigError) as error:
        parse_config(
            {
                "unique_key": "id",
                "llm_model": "m",
                "llm_provider": "vertex",
                "llm_output": {"score": "float", "label": []},
                "llm_cache_prefix": "2h",
            }
        )
    message = str(error.value)
    listed = message.split("llm_provider must be one of [", 1)[1].split("], got 'vertex'", 1)[0]
    assert {
        "'openai'",
        "'anthropic'",
        "'azure_openai'",
        "'bedrock'",
        "'gemini'",
        "'openai_compatible'",
        "'ray'",
    } <= set(listed.split(", "))
    assert "llm_output['score'] has unknown type 'float'" in message
    assert "llm_output['label'] enum must be a non-empty list of distinct strings" in message
    assert "llm_cache_prefix must be true, false, '5m' or '1h', got '2h'" in message


def test_fingerprint_ignores_how_and_when_but_not_what():
    base = {"unique_key": "id", "llm_model": "m", "llm_system": "s"}
    prefix = parse_config(base).fingerprint_prefix()
    for how in (
        {"llm_max_attempts": 7},
        {"llm_wait_seconds": 30},
        {"llm_cache_prefix": True},
        {"llm_max_cost_usd": 1.0},
        {"llm_dry_run": True},
        {"llm_max_batches_in_flight": 2},
    ):
        assert parse_config({**base, **how}).fingerprint_prefix() == prefix, how
    for what in (
        {"llm_model": "n"},
        {"llm_system": "t"},
        {"llm_provider": "anthropic"},
        {"llm_max_tokens": 9},
        {"llm_temperature": 0.5},
        {"llm_params": {"top_p": 0.9}},
        {"llm_output": {"x": "text"}},
        {"llm_examples": [{"input": "a", "output": "b"}]},
    ):
        assert parse_config({**base, **what}).fingerprint_prefix() != prefix, what
