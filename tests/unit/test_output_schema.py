"""llm_output's schema forms: compact and JSON Schema fragments, their DuckDB types, the canonical
schema (and its fingerprint), OpenAI's strict translation and what it refuses, YAML data_types, and
the validator's messages."""

from __future__ import annotations

import datetime
import json

import duckdb
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
    validator = output_schema.answer_validator(config(RESUME).output_json_schema())
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


# -- What a column can hold: the same rules in bulk SQL (flat columns) and with jsonschema (nested) ----


def one(sql: str, param: str):
    """The one value `sql` gives with its one parameter."""
    with duckdb.connect() as con:
        return con.execute(sql, [param]).fetchall()[0][0]


def sql_problem(columns: dict, answer: str) -> str | None:
    """The bulk SQL checks' problem with `answer` (output_schema.answer_problems_sql), None if none."""
    cases = " ".join(f"when {cond} then {why}" for cond, why in output_schema.answer_problems_sql(columns))
    source = "(select ? as a)"
    for select in output_schema.answer_facts_sql(columns, "a"):  # each layer reads the one before
        source = f"(select *, {select} from {source})"
    return one(f"select case {cases} end from {source}", answer)


def nested_problem(column: dict, value) -> str | None:
    """jsonschema's problem with `value` as one item of a list column of `column`."""
    schema = output_schema.object_schema({"x": {"type": "array", "items": column}})
    return output_schema.answer_problem(output_schema.answer_validator(schema), json.dumps({"x": [value]}))


FORMAT_CASES = [
    ("date", "2026-01-31", True),
    ("date", "2024-02-29", True),  # a leap year's
    ("date", "0000-01-01", True),  # RFC 3339's year 0000 is DuckDB's 1 BC
    ("date", "2026-02-29", False),
    ("date", "2026-02-30", False),
    ("date", "2026-13-01", False),
    ("date", "2026-1-31", False),  # DuckDB would read it; RFC 3339 does not write it
    ("date", "20260131", False),
    ("date", "31/01/2026", False),
    ("date", " 2026-01-31", False),
    ("date", "next tuesday", False),
    ("date-time", "2026-01-31T09:30:00Z", True),
    ("date-time", "2026-01-31T09:30:00.123456789+05:30", True),
    ("date-time", "2026-01-31T09:30:00-23:59", True),
    ("date-time", "2026-06-30T23:59:60Z", False),  # a leap second: RFC 3339 has it, DuckDB does not
    ("date-time", "2026-01-31t09:30:00z", False),  # lower case: RFC 3339 allows it, DuckDB's cast does not
    ("date-time", "2026-01-31T24:00:00Z", False),
    ("date-time", "2026-02-30T09:30:00Z", False),
    ("date-time", "2026-01-31T09:30:00", False),  # no offset: the instant is unknown
    ("date-time", "2026-01-31 09:30:00Z", False),
    ("date-time", "2026-01-31", False),
    ("date-time", "next tuesday", False),
    ("time", "09:30:00Z", True),
    ("time", "23:59:59.5+01:00", True),
    ("time", "09:30:00", False),
    ("time", "24:00:00Z", False),
    ("time", "9:30", False),
]


@pytest.mark.parametrize(("fmt", "value", "holds"), FORMAT_CASES)
def test_a_format_is_checked_as_rfc_3339_writes_it_and_duckdb_casts_it_in_sql_and_with_jsonschema(fmt, value, holds):
    column = {"type": "string", "format": fmt}
    assert output_schema.is_flat(column)
    problem = sql_problem({"x": column}, json.dumps({"x": value}))
    type_name = output_schema.duckdb_type(column)
    assert problem == (
        None
        if holds
        else f"field 'x' is not a {fmt} its {type_name} column holds (RFC 3339, e.g. "
        f"{output_schema.FORMAT_EXAMPLES[fmt]}): {value}"
    )
    assert nested_problem(column, value) == (
        None if holds else f"answer does not match llm_output at $.x[0]: {value!r} is not a {fmt!r} (rule 'format')"
    )
    if holds and fmt != "time":  # what passes, the column holds: DuckDB's cast gives a value
        assert one(f"select try_cast(? as {type_name}) is not null", value)


@pytest.mark.parametrize(
    ("value", "holds"),
    [
        ("9223372036854775807", True),
        ("-9223372036854775808", True),
        ("0", True),
        ("9223372036854775808", False),
        ("18446744073709551616", False),
        ("-9223372036854775809", False),
    ],
)
def test_an_integer_is_checked_against_its_columns_range(value, holds):
    assert sql_problem({"n": {"type": "integer"}}, f'{{"n": {value}}}') == (
        None if holds else f"field 'n' is out of the range of its BIGINT column: {value}"
    )
    assert nested_problem({"type": "integer"}, int(value)) == (
        None
        if holds
        else f"answer does not match llm_output at $.x[0]: {value} is out of the range of its BIGINT column (rule 'range')"
    )


def test_an_integer_written_as_a_float_is_in_range_or_not_in_a_nested_value():
    assert nested_problem({"type": "integer"}, 3.0) is None  # JSON Schema's integer; DuckDB casts it to 3
    assert nested_problem({"type": "integer"}, 1e20) == (
        "answer does not match llm_output at $.x[0]: 1e+20 is out of the range of its BIGINT column (rule 'range')"
    )
    # A flat column takes integers written as integers only (as it always did).
    assert sql_problem({"n": {"type": "integer"}}, '{"n": 1e20}') == "field 'n' is missing or not of type integer"


def test_each_flat_field_is_checked_by_its_own_place_among_the_facts():
    """The checks read each answer's JSON types and texts parsed once, as lists over the flat columns
    (output_schema.answer_facts_sql): a nested column between two flat ones takes no place, and each
    flat field's problem names that field. Not JSON, not an object and NULL come first."""
    columns = {
        "a": {"type": "integer"},
        "nested": {"type": "object", "properties": {"x": {"type": "string"}}},
        "b": {"type": "string", "enum": ["p", "q"]},
        "c": {"type": "string", "format": "date"},
    }
    good = {"a": 1, "nested": {"x": "y"}, "b": "p", "c": "2026-01-31"}
    assert sql_problem(columns, json.dumps(good)) is None
    assert sql_problem(columns, json.dumps({**good, "b": "r"})) == "field 'b' is not one of ['p', 'q']"
    assert sql_problem(columns, json.dumps({**good, "a": "1"})) == "field 'a' is missing or not of type integer"
    assert sql_problem(columns, json.dumps({**good, "c": "2026-02-30"})).startswith("field 'c' is not a date")
    assert sql_problem(columns, json.dumps({k: v for k, v in good.items() if k != "b"})) == (
        "field 'b' is not one of ['p', 'q']"
    )
    assert sql_problem(columns, "not json") == "answer is not valid JSON"
    assert sql_problem(columns, None) == "answer is not valid JSON"
    assert sql_problem(columns, "[1]") == "answer is not a JSON object"
    assert sql_problem(columns, "null") == "answer is not a JSON object"


def test_a_nullable_scalar_is_flat_and_takes_null_but_not_a_missing_field():
    note = {"type": ["string", "null"]}
    assert output_schema.is_flat(note)
    assert sql_problem({"note": note}, '{"note": null}') is None
    assert sql_problem({"note": note}, '{"note": "x"}') is None
    assert sql_problem({"note": note}, "{}") == "field 'note' is missing or not of type string or null"
    assert sql_problem({"note": note}, '{"note": 1}') == "field 'note' is missing or not of type string or null"
    assert (
        sql_problem({"note": {"type": "string"}}, '{"note": null}') == "field 'note' is missing or not of type string"
    )
    level = {"type": ["string", "null"], "enum": ["a", "b", None]}
    assert sql_problem({"level": level}, '{"level": null}') is None
    assert sql_problem({"level": level}, '{"level": "c"}') == "field 'level' is not one of ['a', 'b'] or null"
    # Keywords the SQL checks do not know go to jsonschema.
    for other in (
        {"type": "string", "pattern": "^a"},
        {"type": "string", "format": "email"},
        {"type": "integer", "minimum": 1},
    ):
        assert not output_schema.is_flat(other)


@pytest.mark.parametrize(
    ("column", "answer", "value"),
    [
        ({"type": ["string", "null"]}, '{"x": "say \\"hi\\""}', 'say "hi"'),
        ({"type": ["string", "null"]}, '{"x": null}', None),
        ({"type": ["string", "null"]}, '{"x": "null"}', "null"),
        ({"type": "string"}, '{"x": "a"}', "a"),
        ({"type": ["integer", "null"]}, '{"x": null}', None),
        ({"type": ["integer", "null"]}, '{"x": 7}', 7),
        ({"type": ["string", "null"], "format": "date"}, '{"x": "2026-01-31"}', datetime.date(2026, 1, 31)),
        ({"type": ["boolean", "null"]}, '{"x": false}', False),
        (
            {"type": "object", "properties": {"a": {"type": ["string", "null"]}}, "required": ["a"]},
            '{"x": {"a": null}}',
            {"a": None},
        ),
        ({"type": "array", "items": {"type": "string"}}, '{"x": ["a", "b"]}', ["a", "b"]),
    ],
)
def test_a_column_holds_the_answers_value_a_string_as_its_text_and_null_as_null(column, answer, value):
    assert one(f"select {output_schema.value_sql('x', column, '?')}", answer) == value


def test_a_column_is_described_by_what_it_holds_and_its_own_description():
    assert output_schema.describe(
        "when", {"type": ["string", "null"], "format": "date-time", "description": "start"}
    ) == ("The answer's 'when' field (llm_output): a date-time (RFC 3339, e.g. 2026-01-31T09:30:00Z), or NULL; start")
    assert output_schema.describe("n", {"type": "integer"}) == "The answer's 'n' field (llm_output): an integer"
    assert output_schema.describe("tags", {"type": "array", "items": {"type": "string"}}) == (
        "The answer's 'tags' field (llm_output): a list"
    )


def test_the_sandbox_answers_each_format_with_a_value_its_column_holds():
    from dbt_llm_batch.sandbox import expected_answer

    schema = output_schema.object_schema(
        {fmt: {"type": "string", "format": fmt} for fmt in output_schema.FORMAT_PATTERNS}
    )
    for prompt in ("a", "b", "c"):
        answer = expected_answer(None, prompt, schema)
        assert sql_problem(schema["properties"], answer) is None, answer
