"""llm_output's schema forms: compact and JSON Schema fragments, their DuckDB types, the canonical
schema (and its fingerprint), OpenAI's strict translation and what it refuses, YAML data_types, and
the validator's messages."""

from __future__ import annotations

import jsonschema
import pytest

from dbt_llm_batch import output_schema
from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError
from dbt_llm_batch.output_schema import answer_problem as answer_schema_problem
from dbt_llm_batch.providers.openai_chat import strict_problems, strict_schema

RESUME = {
    "candidate": {
        "type": "object",
        "properties": {"name": {"type": "string", "description": "full name"}, "email": "text"},
        "required": ["name"],
    },
    "jobs": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"title": "text", "years": "integer"},
            "required": ["title", "years"],
        },
    },
    "skills": {"type": "array", "items": {"type": "string"}},
    "available_from": {"type": ["string", "null"], "format": "date"},
    "updated": {"type": "string", "format": "date-time"},
    "level": {"type": "string", "enum": ["junior", "senior"]},
    "score": {"type": "number"},
    "remote": {"type": "boolean"},
}


def config(output, provider="anthropic", **extra):
    return parse_config({"unique_key": "id", "llm_model": "m", "llm_provider": provider, "llm_output": output, **extra})


def test_each_form_maps_to_its_duckdb_type():
    types = {c.name: c.duckdb_type for c in config(RESUME).output_columns}
    assert types == {
        "available_from": "DATE",
        "candidate": 'STRUCT(email VARCHAR, "name" VARCHAR)',  # DuckDB's own spelling: fields in name order
        "jobs": 'STRUCT(title VARCHAR, "years" BIGINT)[]',
        "level": "VARCHAR",
        "remote": "BOOLEAN",
        "score": "DOUBLE",
        "skills": "VARCHAR[]",
        "updated": "TIMESTAMP WITH TIME ZONE",
    }


def test_compact_columns_keep_the_schema_and_fingerprint_they_always_had():
    cfg = config({"category": ["billing", "other"], "urgent": "boolean", "summary": "text", "n": "integer"})
    assert cfg.output_json_schema() == {
        "type": "object",
        "properties": {
            "category": {"type": "string", "enum": ["billing", "other"]},
            "n": {"type": "integer"},
            "summary": {"type": "string"},
            "urgent": {"type": "boolean"},
        },
        "required": ["category", "n", "summary", "urgent"],
        "additionalProperties": False,
    }
    assert all(output_schema.is_flat(c.json_schema) for c in cfg.output_columns)


def test_the_canonical_schema_does_not_depend_on_the_order_dbt_parses_dicts_in():
    reordered = {k: RESUME[k] for k in reversed(list(RESUME))}
    reordered["candidate"] = {
        "required": ["name"],
        "properties": {"email": "text", "name": {"description": "full name", "type": "string"}},
        "type": "object",
    }
    assert config(reordered).fingerprint_prefix() == config(RESUME).fingerprint_prefix()
    described = {**RESUME, "skills": {**RESUME["skills"], "description": "tools named"}}
    assert config(described).fingerprint_prefix() != config(RESUME).fingerprint_prefix(), "descriptions steer answers"


def test_the_json_format_keeps_the_schema_and_the_fingerprint_and_has_one_column():
    as_json = config(RESUME, llm_output_format="json")
    assert as_json.table_outputs() == [("llm_output", "JSON")]
    assert as_json.fingerprint_prefix() == config(RESUME).fingerprint_prefix(), "the format changes no answer"


@pytest.mark.parametrize(
    "output, problem",
    [
        ({"x": {"type": "string", "oneOf": []}}, "llm_output['x']: keyword 'oneOf' is not supported"),
        ({"x": {"type": "object"}}, "llm_output['x']: an object needs 'properties'"),
        ({"x": {"type": "array"}}, "llm_output['x']: an array needs 'items'"),
        ({"x": {"type": ["string", "integer"]}}, "llm_output['x'].type must be one of"),
        (
            {"x": {"type": "array", "items": {"type": "object", "properties": {"a": "float"}}}},
            "llm_output['x'].items.properties.a has unknown type 'float'",
        ),
        (
            {"x": {"type": "object", "properties": {"a": "text"}, "required": ["b"]}},
            "llm_output['x'].required must be a list of names among its properties",
        ),
        ({"x": {"type": "integer", "format": "date"}}, "llm_output['x'].format is for strings"),
        (
            {"x": {"type": "integer", "enum": ["a"]}},
            "llm_output['x'].enum must be a non-empty list of distinct strings",
        ),
        (
            {"x": {"type": "object", "properties": {"a": "text"}, "additionalProperties": True}},
            "llm_output['x'].additionalProperties can only be false",
        ),
    ],
)
def test_a_fragment_no_column_type_fits_is_refused_naming_the_field(output, problem):
    with pytest.raises(ConfigError) as exc:
        config(output)
    assert problem in str(exc.value)


def test_openai_strict_form_requires_everything_and_makes_optional_fields_nullable():
    schema = strict_schema(config(RESUME).output_json_schema())
    candidate = schema["properties"]["candidate"]
    assert candidate["required"] == ["email", "name"] and candidate["additionalProperties"] is False
    assert candidate["properties"]["email"] == {"type": ["string", "null"]}
    assert schema["properties"]["available_from"] == {"type": ["string", "null"], "format": "date"}
    jobs = schema["properties"]["jobs"]["items"]
    assert jobs["required"] == ["title", "years"] and jobs["additionalProperties"] is False
    optional_object = strict_schema(
        {
            "type": "object",
            "properties": {"o": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}},
            "required": [],
        }
    )
    assert optional_object["properties"]["o"]["anyOf"][1] == {"type": "null"}
    jsonschema.Draft202012Validator.check_schema(schema)


def nested(depth: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"], "additionalProperties": False}
    return node


@pytest.mark.parametrize(
    "column, problem",
    [
        (
            {"type": "array", "items": {"type": "string", "format": "uri"}},
            "llm_output['x'].items: OpenAI strict structured outputs do not support format 'uri'",
        ),
        (
            {"type": "string", "minLength": 2},
            "llm_output['x']: OpenAI strict structured outputs do not support 'minLength'",
        ),
        (nested(10), "llm_output['x'].a.a.a.a.a.a.a.a.a: OpenAI strict structured outputs allow at most 10 levels"),
    ],
)
def test_openai_refuses_what_strict_mode_cannot_take_naming_field_and_rule(column, problem):
    for provider, extra in (("openai", {}), ("openai_compatible", {"llm_base_url": "http://127.0.0.1:1/v1"})):
        with pytest.raises(ConfigError) as exc:
            config({"x": column}, provider, **extra)
        assert problem in str(exc.value), provider
    config({"x": column}, "anthropic")  # a forced tool's input_schema takes it


def test_openai_takes_nine_levels_and_counts_enum_values():
    assert strict_problems(config({"x": nested(9)}).output_json_schema()) == []
    many = {f"c{i}": [f"v{j}" for j in range(101)] for i in range(10)}
    assert (
        "at most 1000 enum values in total, this schema has 1010"
        in strict_problems(config(many).output_json_schema())[0]
    )


def test_yaml_columns_become_the_output_columns():
    cfg = parse_config(
        {
            "unique_key": "id",
            "llm_model": "m",
            "llm_provider": "openai",
            "llm_output_from_columns": True,
            "columns": [
                {"name": "id", "data_type": "integer", "description": "the key"},
                {"name": "prompt", "data_type": None, "description": None},
                {"name": "who", "data_type": "STRUCT(name VARCHAR, age INTEGER)", "description": "the candidate"},
                {"name": "tags", "data_type": "varchar[]", "description": ""},
                {"name": "since", "data_type": "date", "description": None},
                {"name": "urgent", "data_type": "boolean", "description": None},
            ],
        }
    )
    columns = {c.name: (c.duckdb_type, c.json_schema) for c in cfg.output_columns}
    assert columns == {
        "since": ("DATE", {"type": "string", "format": "date"}),
        "tags": ("VARCHAR[]", {"type": "array", "items": {"type": "string"}}),
        "urgent": ("BOOLEAN", {"type": "boolean"}),
        "who": (
            'STRUCT(age BIGINT, "name" VARCHAR)',
            {
                "type": "object",
                "description": "the candidate",
                "properties": {"age": {"type": "integer"}, "name": {"type": "string"}},
                "required": ["age", "name"],
                "additionalProperties": False,
            },
        ),
    }


def test_yaml_columns_problems():
    base = {"unique_key": "id", "llm_model": "m", "llm_output_from_columns": True}
    with pytest.raises(ConfigError) as exc:
        parse_config({**base, "llm_output": {"a": "text"}, "columns": []})
    assert "set either llm_output or llm_output_from_columns, not both" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        parse_config({**base, "columns": [{"name": "m", "data_type": "MAP(VARCHAR, INTEGER)"}, {"name": "n"}]})
    message = str(exc.value)
    assert "column 'm' (the model's YAML): data_type 'MAP(VARCHAR, INTEGER)' has a MAP(VARCHAR, INTEGER)" in message
    assert "'n'" not in message, "a column without a data_type is documentation only"
    with pytest.raises(ConfigError) as exc:
        parse_config({**base, "columns": [{"name": "n", "description": "docs only"}, {"name": "llm_status"}]})
    assert "llm_output_from_columns is true but the model's YAML lists no output column" in str(exc.value)


def test_answers_are_checked_with_the_validators_path_and_rule():
    schema = output_schema.validation_schema(config(RESUME).output_json_schema())
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    good = {
        "candidate": {"name": "A", "email": None},  # an optional field: null (OpenAI) or absent (Anthropic)
        "jobs": [{"title": "t", "years": 2}, {"title": "u", "years": 3}],
        "skills": ["x", "y"],
        "available_from": None,
        "updated": "2025-01-02T03:04:05Z",
        "level": "senior",
        "score": 1.5,
        "remote": True,
    }
    import json

    assert answer_schema_problem(validator, json.dumps(good)) is None
    assert answer_schema_problem(validator, json.dumps({**good, "candidate": {"name": "A"}})) is None
    bad_item = {**good, "jobs": [{"title": "t", "years": 2}, {"title": "u", "years": "three"}]}
    assert answer_schema_problem(validator, json.dumps(bad_item)) == (
        "answer does not match llm_output at $.jobs[1].years: 'three' is not of type 'integer' (rule 'type')"
    )
    missing = {**good, "candidate": {"email": "e"}}
    assert answer_schema_problem(validator, json.dumps(missing)) == (
        "answer does not match llm_output at $.candidate: 'name' is a required property (rule 'required')"
    )
    bad_date = {**good, "available_from": "2025-02-30"}
    assert answer_schema_problem(validator, json.dumps(bad_date)) == (
        "answer does not match llm_output at $.available_from: '2025-02-30' is not a 'date' (rule 'format')"
    )
