"""`llm_task = 'embed'`: one owner for what an embedding model is in the core.

A model that embeds has one output column, `llm_embedding FLOAT[n]` (a fixed-size DuckDB array, so
array_cosine_similarity / array_distance work on it), whose size `n` is known when the config is
parsed: the provider says it from `llm_model` and `llm_dimensions` (Provider.embedding_size). A stored
answer is the vector, typed (the ledger's `vector`, FLOAT[] of any length until it is checked); the checks and the SQL reading it back are here, so settling and
merging ask this module, never a provider.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EMBED = "embed"
COLUMN = "llm_embedding"
# Keys that shape a chat answer: an embedding request has no system prompt, examples, output schema,
# token limit, temperature or cached prefix, so setting one is a mistake said before anything is sent.
CHAT_ONLY_KEYS = (
    "llm_output",
    "llm_output_from_columns",
    "llm_output_format",
    "llm_system",
    "llm_examples",
    "llm_max_tokens",
    "llm_temperature",
    "llm_cache_prefix",
)


@dataclass(frozen=True)
class EmbeddingModel:
    """What a provider knows of one embedding model (Provider.embedding_models, by name prefix)."""

    size: int  # the vectors' native size
    shortenable: bool  # takes a `dimensions` parameter and returns vectors of that size (at most `size`)


def column_type(size: int) -> str:
    return f"FLOAT[{int(size)}]"


def column_schema(size: int) -> dict:
    return {"type": "array", "items": {"type": "number"}, "minItems": size, "maxItems": size}


def check_keys(given: dict[str, Any], defaults: dict[str, Any], errors: list[str]) -> None:
    """Append one error per chat-only key an embedding model sets."""
    for name in CHAT_ONLY_KEYS:
        if given.get(name) is not None and given[name] != defaults.get(name):
            errors.append(
                f"{name} does not apply to llm_task='embed' (the prompt column is the text embedded, "
                "nothing else is sent): remove it"
            )


def refuse_provider(provider_name: str, able: list[str], errors: list[str]) -> None:
    """A provider without an embeddings API: refused before anything is recorded or sent."""
    errors.append(
        f"llm_provider {provider_name!r} has no embeddings API, so it cannot take llm_task='embed': use "
        + (" or ".join(repr(n) for n in able) if able else "a provider that declares embeddings")
    )


def answer_problem_sql(size: int, vector: str = "vector") -> str:
    """SQL: why a vector (FLOAT[]) cannot fill `FLOAT[size]` (NULL when it can). A reply whose numbers
    did not parse as floats has no vector, or NULLs in it (list_count counts the numbers)."""
    return f"""case when {vector} is null or list_count({vector}) <> len({vector})
                    then 'the provider answered no vector'
                    when len({vector}) <> {int(size)}
                    then 'the vector has ' || len({vector}) || ' numbers, the column FLOAT[{int(size)}] '
                         || 'takes {int(size)}: set llm_dimensions to the model''s size (a full refresh rebuilds the column)'
               end"""


def value_sql(size: int, vector: str) -> str:
    """SQL: the stored vector as the table's FLOAT[size] value."""
    return f"cast({vector} as {column_type(size)})"
