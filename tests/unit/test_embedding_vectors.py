"""An embedding result line's vectors: parsed once into floats (never through JSON text), put in input
order, checked against the column's size, and cast to FLOAT[n] (embeddings.py, openai_embeddings.py)."""

from __future__ import annotations

import json

import duckdb
import pytest

from dbt_llm_batch import embeddings
from dbt_llm_batch.providers import openai_embeddings
from dbt_llm_batch.providers.openai_batch import OpenAIBatchProvider


def line(data: list) -> str:
    body = {"object": "list", "data": data, "usage": {"prompt_tokens": 6, "total_tokens": 6}}
    return json.dumps({"custom_id": "r_0", "response": {"status_code": 200, "body": body}, "error": None})


def line_outcome(raw: str) -> tuple:
    """(outcome, answer, its SQL type) of one result line, through the provider's result structure."""
    structure = json.dumps(OpenAIBatchProvider.result_structure)
    return (
        duckdb.connect()
        .execute(
            f"""select outcome, answer, typeof(answer) from (
                select {openai_embeddings.outcomes_sql("r", "null::varchar")}
                from (select json_transform(?, '{structure}') as r))""",
            [raw],
        )
        .fetchall()[0]
    )


def test_a_line_s_vectors_are_floats_in_input_order_whatever_order_the_reply_lists_them_in():
    in_order = line([{"index": 0, "embedding": [0.5, -1]}, {"index": 1, "embedding": [2, 3.25]}])
    assert line_outcome(in_order) == ("ok", [[0.5, -1.0], [2.0, 3.25]], "FLOAT[][]")
    reversed_ = line([{"index": 1, "embedding": [2, 3.25]}, {"index": 0, "embedding": [0.5, -1]}])
    assert line_outcome(reversed_)[1] == [[0.5, -1.0], [2.0, 3.25]]


def scalar(sql: str):
    return duckdb.connect().execute(f"select {sql}").fetchall()[0][0]


def problem(vector_sql: str, size: int = 2):
    return scalar(embeddings.answer_problem_sql(size, vector_sql))


def test_a_vector_that_cannot_fill_the_column_is_a_failed_attempt_saying_why():
    base64 = line([{"index": 0, "embedding": "AACAPwAAAEA="}])  # encoding_format='base64' text
    (vector,) = line_outcome(base64)[1]
    assert vector is None
    assert problem("null::float[]") == "the provider answered no vector"
    assert problem("[1, null]::float[]") == "the provider answered no vector"
    assert problem("[1, 2, 3]::float[]").startswith("the vector has 3 numbers, the column FLOAT[2] takes 2")
    assert problem("[1, 2]::float[]") is None
    value = embeddings.value_sql(2, "[1, 2]::float[]")
    assert scalar(value) == pytest.approx([1.0, 2.0]) and scalar(f"typeof({value})") == "FLOAT[2]"
