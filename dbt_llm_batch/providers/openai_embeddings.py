"""OpenAI's embeddings format (`/v1/embeddings`), shared by the OpenAI Batch API provider and
self-hosted OpenAI-compatible engines (vLLM serves the same endpoint for pooling models).

A request embeds the row's prompt (`input`); a packed batch line (pipeline/request_files.py) carries an
array of inputs, and its result line a `data` list of `{index, embedding}`, one per input in order. The
answer a result line gives is the list of its vectors (FLOAT[][], parsed once from the line's JSON,
never through text), in input order: one vector for a line of one input; settling (pipeline/packing.py)
gives each packed request its own, stored typed (the ledger's `vector`).
"""

from __future__ import annotations

from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.embeddings import EmbeddingModel
from dbt_llm_batch.providers.base import PROMPT_MARK, REJECTED
from dbt_llm_batch.sql import literal

# OpenAI's embedding models (the embeddings guide): text-embedding-3-* shorten their vectors to the
# `dimensions` asked; ada-002 refuses the parameter.
OPENAI_MODELS = {
    "text-embedding-3-small": EmbeddingModel(size=1536, shortenable=True),
    "text-embedding-3-large": EmbeddingModel(size=3072, shortenable=True),
    "text-embedding-ada-002": EmbeddingModel(size=1536, shortenable=False),
}
# The embeddings API reference: `input` takes an array of at most 2,048 strings per request, each at most
# 8,192 tokens, and at most 300,000 tokens summed over the inputs of one request.
MAX_INPUTS_PER_REQUEST = 2048
MAX_TOKENS_PER_REQUEST = 300_000

# The part of a result line an embedding reply fills (merged into the chat line's structure): the numbers
# parsed straight into floats by the one json_transform of the line (a vector that is not a list of
# numbers, e.g. base64 text, parses to NULL: "no vector").
RESULT_STRUCTURE = {"data": [{"index": "INTEGER", "embedding": "FLOAT[]"}]}


def request_body(config: ModelConfig, dimensions: int | None) -> dict:
    """One embeddings request of the row's prompt (PROMPT_MARK), as floats (never base64)."""
    body: dict = {"model": config.model, "input": PROMPT_MARK, "encoding_format": "float"}
    if dimensions is not None:
        body["dimensions"] = dimensions
    body.update(config.params)
    return body


def outcomes_sql(r: str, error_sql: str) -> str:
    """The outcome columns (providers/base.py OUTCOME_COLUMNS) of one embeddings result line `r`, its
    `answer` the line's vectors (FLOAT[][], see the module's docstring); `error_sql` is the chat
    format's error text (the same envelopes)."""
    body = f"{r}.response.body"
    error_code = f"coalesce(json_extract_string({r}.error, '$.code'), {body}.error.code)"
    ok = f"{r}.response.status_code = 200 and len({body}.data) > 0"
    # Vectors in input order (`index`), whatever order the reply lists them in (sorted only when needed).
    in_order = f"list_transform({body}.data, lambda d: d.index) = range(len({body}.data))"
    vectors = (
        f"case when {in_order} then list_transform({body}.data, lambda d: d.embedding) else "
        f"list_transform(list_sort(list_transform({body}.data, lambda d: {{'i': d.index, 'e': d.embedding}})), "
        "lambda d: d.e) end"
    )
    return f"""
            {r}.custom_id as custom_id,
            case when {error_code} = 'batch_expired' then 'void' when {ok} then 'ok' else 'error' end as outcome,
            case when {ok} then {vectors} end as answer,
            null::varchar as finish_reason,
            false as truncated,
            {error_sql} as error,
            {body}.usage.prompt_tokens as input_tokens,
            case when {ok} then 0 end::bigint as output_tokens,
            null::bigint as cached_tokens,
            null::bigint as cache_write_tokens,
            case when {r}.response.status_code in (400, 404, 413, 422) then {literal(REJECTED)} end as not_retried,
            null::bigint as cache_write_1h_tokens"""
