"""llm_task = 'embed': the config says the vectors' size before anything is sent, or why it cannot."""

from __future__ import annotations

import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError

EMBED = {"unique_key": "id", "llm_task": "embed", "llm_model": "text-embedding-3-small"}


def refusal(raw: dict) -> str:
    with pytest.raises(ConfigError) as refused:
        parse_config(raw)
    return str(refused.value)


def test_the_column_takes_the_model_s_native_size_or_the_dimensions_asked():
    assert parse_config(EMBED).table_outputs() == [("llm_embedding", "FLOAT[1536]")]
    assert parse_config({**EMBED, "llm_dimensions": 256}).table_outputs() == [("llm_embedding", "FLOAT[256]")]
    large = parse_config({**EMBED, "llm_model": "text-embedding-3-large"})
    assert large.embedding_size == 3072


def test_the_real_models_dimension_rules_are_checked_before_sending():
    assert "does not take llm_dimensions" in refusal(
        {**EMBED, "llm_model": "text-embedding-ada-002", "llm_dimensions": 8}
    )
    assert "at most 1536" in refusal({**EMBED, "llm_dimensions": 2000})
    # An engine's model is unknown: its size must be said.
    engine = {**EMBED, "llm_provider": "openai_compatible", "llm_base_url": "http://127.0.0.1:1/v1"}
    assert "llm_dimensions is required" in refusal(engine)
    assert parse_config({**engine, "llm_dimensions": 640}).embedding_size == 640


def test_chat_only_keys_are_refused_all_at_once():
    message = refusal({**EMBED, "llm_system": "s", "llm_output": {"a": "text"}, "llm_temperature": 0.2})
    for key in ("llm_system", "llm_output", "llm_temperature"):
        assert f"{key} does not apply to llm_task='embed'" in message
    assert "it needs llm_task='embed'" in refusal({"unique_key": "id", "llm_model": "m", "llm_dimensions": 8})


def test_dimensions_change_the_fingerprint_and_a_chat_model_s_fingerprint_is_unchanged():
    assert (
        parse_config(EMBED).fingerprint_prefix() != parse_config({**EMBED, "llm_dimensions": 256}).fingerprint_prefix()
    )
    assert "task" not in parse_config({"unique_key": "id", "llm_model": "m"}).answer_defining_fields()
