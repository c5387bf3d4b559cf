"""llm_output as one JSON Schema: the user's column specs read into canonical fragments, and the
DuckDB type each fragment becomes; what an answer must be for its columns to hold it (the checks), and
the SQL that reads each column's value out of an answer. One owner of the output's shape: the schema
asked (config.py records it, providers translate it), the answer checks (pipeline/outcomes.py runs
them), the column values (pipeline/merge.py writes them).

A column is written in the compact form ('text', 'integer', 'number', 'boolean', or a list of allowed
strings) or as a JSON Schema fragment (a dict with a 'type'). Fragments nest to any depth: an object
becomes a STRUCT (fields in name order, like the table's output columns), an array a LIST. A field is
optional when its object leaves it out of `required` or its type admits 'null'; it is NULL when absent.

The canonical schema is provider-neutral: every object sets `additionalProperties: false` (a STRUCT
has exactly its fields), `required` is sorted, and a nullable enum lists null. Providers translate it
to what their API takes (providers/openai_chat.py for OpenAI's strict mode).

An answer is checked against the canonical schema and against what its columns can hold: a date,
date-time or time the way DuckDB reads it, an integer within its column's range. An answer that fails
is a failed attempt with the reason (retried under llm_max_attempts), never a succeeded row with NULL
where the value was. Flat columns (one scalar, maybe nullable) are checked in bulk SQL
(`answer_problems_sql`), the others value by value with jsonschema (`answer_validator`).
"""

from __future__ import annotations

import calendar
import json
import re
from typing import Any

from dbt_llm_batch.sql import ident, in_list, literal

# Compact type names, and the JSON Schema type each one is.
COMPACT = {"text": "string", "integer": "integer", "number": "number", "boolean": "boolean"}
SCALARS = {"string": "VARCHAR", "integer": "BIGINT", "number": "DOUBLE", "boolean": "BOOLEAN"}
# String formats with a DuckDB type of their own; any other format stays VARCHAR. A date-time carries
# its offset (RFC 3339): TIMESTAMP WITH TIME ZONE keeps the instant, where TIMESTAMP would drop the offset.
FORMATS = {"date": "DATE", "date-time": "TIMESTAMP WITH TIME ZONE"}
# The keywords a fragment may use: those that describe one typed value. Combinators (anyOf, oneOf,
# ...) and references would give a column no single DuckDB type.
KEYWORDS = {
    "type",
    "description",
    "title",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "format",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minItems",
    "maxItems",
}
TYPE_HELP = (
    "'text', 'integer', 'number', 'boolean', a list of allowed strings, or a JSON Schema fragment "
    "such as {'type': 'array', 'items': {'type': 'string'}}"
)


def column_schema(spec: Any, where: str, errors: list[str]) -> dict | None:
    """The canonical JSON Schema of one llm_output column (compact or fragment), or None with the
    problems appended to `errors` (each naming `where`, e.g. "llm_output['jobs'].items")."""
    if isinstance(spec, list):
        if not spec or not all(isinstance(v, str) for v in spec) or len(set(spec)) != len(spec):
            errors.append(f"{where} enum must be a non-empty list of distinct strings")
            return None
        return {"type": "string", "enum": list(spec)}
    if isinstance(spec, str) and spec in COMPACT:
        return {"type": COMPACT[spec]}
    if isinstance(spec, dict):
        return _fragment(spec, where, errors)
    errors.append(f"{where} has unknown type {spec!r}: use {TYPE_HELP}")
    return None


def _fragment(node: dict, where: str, errors: list[str]) -> dict | None:
    before = len(errors)
    unknown = sorted(k for k in node if k not in KEYWORDS)
    if unknown:
        errors.append(
            f"{where}: keyword '{unknown[0]}' is not supported in llm_output (a column has one type); "
            f"use {', '.join(sorted(KEYWORDS))}"
        )
    declared = node.get("type")
    types = declared if isinstance(declared, list) else [declared]
    nullable = "null" in types
    base = [t for t in types if t != "null"]
    if len(base) != 1 or base[0] not in (*SCALARS, "object", "array"):
        errors.append(
            f"{where}.type must be one of 'string', 'integer', 'number', 'boolean', 'object', 'array' "
            f"(or a list of one of them and 'null'), got {declared!r}"
        )
        return None
    kind = base[0]
    out: dict[str, Any] = {k: v for k, v in node.items() if k not in ("properties", "required", "items")}
    for key in ("description", "title", "format", "pattern"):
        if key in node and not isinstance(node[key], str):
            errors.append(f"{where}.{key} must be a string")
    if "format" in node and kind != "string":
        errors.append(f"{where}.format is for strings; {where} has type {kind!r}")
    if "enum" in node:
        enum = node["enum"]
        values = [v for v in enum if v is not None] if isinstance(enum, list) else None
        if (
            kind != "string"
            or not values
            or not all(isinstance(v, str) for v in values)
            or len(set(values)) != len(values)
        ):
            errors.append(f"{where}.enum must be a non-empty list of distinct strings, on a 'string' type")
        else:
            # A nullable enum lists null too, or null would fail validation (JSON Schema checks both).
            out["enum"] = values + ([None] if nullable else [])
    if kind == "object":
        props = node.get("properties")
        if not isinstance(props, dict) or not props:
            errors.append(f"{where}: an object needs 'properties' (a STRUCT has at least one field)")
            return None
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) and r in props for r in required):
            errors.append(f"{where}.required must be a list of names among its properties")
            required = []
        if node.get("additionalProperties", False) is not False:
            errors.append(f"{where}.additionalProperties can only be false (a STRUCT has exactly its fields)")
        fields = {}
        lowered: set[str] = set()
        for name in sorted(props, key=str):
            if not isinstance(name, str) or not name:
                errors.append(f"{where}: property name {name!r} must be a non-empty string")
                continue
            if name.lower() in lowered:
                errors.append(f"{where}: properties differing only in case ('{name}') cannot be STRUCT fields")
            lowered.add(name.lower())
            sub = column_schema(props[name], f"{where}.properties.{name}", errors)
            if sub is not None:
                fields[name] = sub
        out.update(properties=fields, required=sorted(set(required)), additionalProperties=False)
    elif kind == "array":
        items = node.get("items")
        if items is None:
            errors.append(f"{where}: an array needs 'items' (the type of its elements)")
            return None
        sub = column_schema(items, f"{where}.items", errors)
        if sub is not None:
            out["items"] = sub
    elif "properties" in node or "items" in node:
        errors.append(f"{where}: 'properties' and 'items' belong to 'object' and 'array' types")
    return out if len(errors) == before else None


def object_schema(columns: dict[str, dict]) -> dict:
    """The whole answer's schema: one property per output column, every column required (a column
    is optional through a type that admits 'null')."""
    return {
        "type": "object",
        "properties": dict(columns),
        "required": list(columns),
        "additionalProperties": False,
    }


def validation_schema(node: dict, required: bool = True) -> dict:
    """The schema answers are checked against: the canonical one, where an optional property may
    also be null (absent and null both become NULL; OpenAI's strict mode answers null, see
    providers/openai_chat.py)."""
    out = dict(node)
    if "properties" in out:
        optional = set(out["properties"]) - set(out.get("required", []))
        out["properties"] = {n: validation_schema(sub, n not in optional) for n, sub in out["properties"].items()}
    if "items" in out:
        out["items"] = validation_schema(out["items"])
    types = out["type"] if isinstance(out["type"], list) else [out["type"]]
    if "integer" in types:  # checked against its column's range (answer_validator)
        out["range"] = _type(node)
    if not required and "null" not in types:
        out["type"] = [*types, "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def duckdb_type(schema: dict) -> str:
    """The DuckDB type of a canonical fragment, spelled as DESCRIBE spells it (DuckDB's own parser
    prints it: which field names it quotes is its business), so an existing table compares equal."""
    import duckdb

    return str(duckdb.sqltype(_type(schema)))


def _type(schema: dict) -> str:
    declared = schema.get("type")
    kind = next(t for t in (declared if isinstance(declared, list) else [declared]) if t != "null")
    if kind == "object":
        return "STRUCT(" + ", ".join(f"{ident(n)} {_type(sub)}" for n, sub in schema["properties"].items()) + ")"
    if kind == "array":
        return f"{_type(schema['items'])}[]"
    if kind == "string" and schema.get("format") in FORMATS:
        return FORMATS[schema["format"]]
    return SCALARS[kind]


# DuckDB type ids (DuckDBPyType.id) a YAML data_type may name, and the JSON Schema each one is.
DUCKDB_IDS = {
    "varchar": {"type": "string"},
    "bigint": {"type": "integer"},
    "integer": {"type": "integer"},
    "smallint": {"type": "integer"},
    "tinyint": {"type": "integer"},
    "hugeint": {"type": "integer"},
    "double": {"type": "number"},
    "float": {"type": "number"},
    "decimal": {"type": "number"},
    "boolean": {"type": "boolean"},
    "date": {"type": "string", "format": "date"},
    "timestamp": {"type": "string", "format": "date-time"},
    "timestamp with time zone": {"type": "string", "format": "date-time"},
}


def from_duckdb_type(data_type: str, where: str, errors: list[str]) -> dict | None:
    """The JSON Schema fragment of a DuckDB type written in a model's YAML (`data_type`), parsed by
    DuckDB itself: STRUCT fields are required properties, T[] an array. None (with the reason) for a
    type no JSON answer maps to."""
    import duckdb

    try:
        parsed = duckdb.sqltype(data_type)
    except Exception:
        errors.append(f"{where}: data_type {data_type!r} is not a DuckDB type nor one of {TYPE_HELP}")
        return None
    return _from_parsed(parsed, data_type, where, errors)


def _from_parsed(parsed, data_type: str, where: str, errors: list[str]) -> dict | None:
    if parsed.id == "struct":
        props = {}
        for name, sub in parsed.children:
            fragment = _from_parsed(sub, data_type, where, errors)
            if fragment is None:
                return None
            props[name] = fragment
        return {"type": "object", "properties": props, "required": sorted(props)}
    if parsed.id == "list":
        items = _from_parsed(parsed.child, data_type, where, errors)
        return None if items is None else {"type": "array", "items": items}
    if parsed.id in DUCKDB_IDS:
        return dict(DUCKDB_IDS[parsed.id])
    errors.append(
        f"{where}: data_type {data_type!r} has a {str(parsed)} that no JSON answer gives: use VARCHAR, "
        "BIGINT, DOUBLE, BOOLEAN, DATE, TIMESTAMP, STRUCT(...) or T[]"
    )
    return None


def is_flat(schema: dict) -> bool:
    """Whether the column is one scalar (a compact type, a string enum, a date, date-time or time,
    nullable or not) with no other rule: its answers are checked in bulk SQL (answer_problems_sql)
    instead of value by value."""
    kind, _ = _kind(schema)
    return (
        kind in SCALARS
        and set(schema) <= {"type", "enum", "description", "title", "format"}
        and schema.get("format", "date") in FORMAT_PATTERNS
    )


def _kind(schema: dict) -> tuple[str, bool]:
    """(the fragment's one non-null type, whether it admits null)."""
    declared = schema.get("type")
    types = declared if isinstance(declared, list) else [declared]
    return next((t for t in types if t != "null"), "null"), "null" in types


def recorded(schema: dict | None) -> str:
    """A schema as a job records the one its requests were asked with (canonical JSON; 'null' for free
    text): an answer is checked against the schema it was asked for."""
    return json.dumps(schema, sort_keys=True)


# -- What a column can hold: the answer checks -----------------------------------------------------

# The formats checked, as RFC 3339 writes them and DuckDB's casts read them. jsonschema checks
# date-time and time only with rfc3339-validator installed, and that accepts values DuckDB turns into
# NULL (a leap second 23:59:60, a lower-case 't' or 'z'): so the package checks these three itself,
# by the same patterns in SQL (flat columns, in bulk) and in Python (nested values, with jsonschema).
# Whether the day exists (no February 30) is DuckDB's cast in SQL and `calendar` in Python.
_DATE = "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date": _DATE, "date-time": f"{_DATE}T{_TIME}", "time": _TIME}
FORMAT_EXAMPLES = {"date": "2026-01-31", "date-time": "2026-01-31T09:30:00Z", "time": "09:30:00Z"}
# The values an integer column holds, by its DuckDB type (an 'integer' fragment is a BIGINT).
INTEGER_RANGES = {"BIGINT": (-(2**63), 2**63 - 1)}
# The JSON types (DuckDB's json_type) each scalar type takes.
JSON_TYPES = {
    "string": ("VARCHAR",),
    "integer": ("BIGINT", "UBIGINT"),
    "number": ("BIGINT", "UBIGINT", "DOUBLE"),
    "boolean": ("BOOLEAN",),
}


def holds_format(fmt: str, value: str) -> bool:
    """Whether `value` is a `fmt` (date, date-time or time) its column can hold: the Python side of
    the formats' SQL check (answer_problems_sql), for nested values."""
    if not re.fullmatch(FORMAT_PATTERNS[fmt], value):
        return False
    if fmt == "time":  # a time column is VARCHAR: the text is kept as answered
        return True
    year, month, day = int(value[:4]), int(value[5:7]), int(value[8:10])
    return day <= calendar.monthrange(year, month)[1]


# The facts the bulk checks read (answer_facts_sql): each is one parse of the answer, where a check
# per field parsing it again was most of the checks' time (a million answers, two flat columns: 0.45 s
# against 0.25 s).
ANSWER_VALID, ANSWER_TYPES, ANSWER_TEXTS = "_llm_answer_valid", "_llm_answer_types", "_llm_answer_texts"


def answer_facts_sql(columns: dict[str, dict], answer: str = "answer") -> list[str]:
    """SELECT lists, in order (each reads the columns of the one before), adding the facts
    answer_problems_sql's checks read about the structured answer `answer` (an SQL expression):
    whether it is JSON; the JSON types of its root and of each flat column's field (NULL for a field it
    lacks); each flat field's text. The types and texts are read only from valid JSON (reading them
    from other text is an error)."""
    flat = [name for name, schema in columns.items() if is_flat(schema)]
    types = "[" + ", ".join(literal(p) for p in ["$", *(f"$.{name}" for name in flat)]) + "]"
    texts = "[" + ", ".join(literal(f"$.{name}") for name in flat) + "]"
    texts_sql = (
        f"case when {ANSWER_VALID} then json_extract_string({answer}, {texts}) end" if flat else "null::varchar[]"
    )
    return [
        f"coalesce(json_valid({answer}), false) as {ANSWER_VALID}",
        f"case when {ANSWER_VALID} then json_type({answer}, {types}) end as {ANSWER_TYPES}, "
        f"{texts_sql} as {ANSWER_TEXTS}",
    ]


def answer_problems_sql(columns: dict[str, dict]) -> list[tuple[str, str]]:
    """(SQL condition, SQL text of the problem) pairs, in order, that find why a structured answer
    is unusable: not a JSON object, or a flat column's value missing, of another type, not among its
    enum, not a date / date-time / time its column holds, or out of its integer column's range. They
    read the answer's facts (answer_facts_sql, with the same `columns`). The other columns are checked
    by answer_validator."""
    checks = [
        (f"not {ANSWER_VALID}", "'answer is not valid JSON'"),
        (f"{ANSWER_TYPES}[1] <> 'OBJECT'", "'answer is not a JSON object'"),
    ]
    flat = [(name, schema) for name, schema in columns.items() if is_flat(schema)]
    for n, (name, schema) in enumerate(flat, start=1):
        checks += _flat_checks(name, schema, jtype=f"{ANSWER_TYPES}[{n + 1}]", text=f"{ANSWER_TEXTS}[{n}]")
    return checks


def _flat_checks(name: str, schema: dict, jtype: str, text: str) -> list[tuple[str, str]]:
    """The checks of flat column `name`: `jtype`, its field's JSON type (NULL when missing); `text`,
    its field's text (SQL expressions)."""
    kind, nullable = _kind(schema)
    types = JSON_TYPES[kind] + (("NULL",) if nullable else ())
    or_null = " or null" if nullable else ""
    # A missing field has no json_type: every column is required (a nullable one answers null).
    wrong_type = f"coalesce({jtype}, 'missing') not in {in_list(types)}"
    column = _type(schema)
    checks = []
    if kind == "integer":
        # Written as an integer but past the column's range: JSON gives it as a UBIGINT or, past that, a
        # DOUBLE (the type check below takes no other DOUBLE); DuckDB's own cast says whether it fits.
        written = f"{jtype} in ('UBIGINT', 'DOUBLE') and regexp_full_match({text}, '-?[0-9]+')"
        why = f"field '{name}' is out of the range of its {column} column: "
        checks.append((f"{written} and try_cast({text} as {column}) is null", f"{literal(why)} || {text}"))
    if "enum" in schema:
        values = [v for v in schema["enum"] if v is not None]
        cond = f"{wrong_type} or ({jtype} = 'VARCHAR' and {text} not in {in_list(values)})"
        checks.append((cond, literal(f"field '{name}' is not one of {values}{or_null}")))
    else:
        checks.append((wrong_type, literal(f"field '{name}' is missing or not of type {kind}{or_null}")))
    fmt = schema.get("format")
    if fmt in FORMAT_PATTERNS:
        holds = f"regexp_full_match({text}, {literal(FORMAT_PATTERNS[fmt])})"
        if column != "VARCHAR":  # the day exists: DuckDB's own cast says so
            holds += f" and try_cast({text} as {column}) is not null"
        why = f"field '{name}' is not a {fmt} its {column} column holds (RFC 3339, e.g. {FORMAT_EXAMPLES[fmt]}): "
        checks.append((f"{jtype} = 'VARCHAR' and not ({holds})", f"{literal(why)} || left({text}, 60)"))
    return checks


def answer_validator(schema: dict):
    """A jsonschema validator of whole answers against `schema` (the canonical answer schema): its
    rules, the formats as answer_problems_sql checks them, and integer ranges by column type."""
    import jsonschema

    checker = jsonschema.FormatChecker()
    for fmt in FORMAT_PATTERNS:
        checker.checks(fmt)(lambda value, fmt=fmt: not isinstance(value, str) or holds_format(fmt, value))

    def in_range(validator, column: str, instance, _schema):
        low, high = INTEGER_RANGES[column]
        if validator.is_type(instance, "integer") and not low <= instance <= high:
            yield jsonschema.ValidationError(f"{instance!r} is out of the range of its {column} column")

    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"range": in_range})
    return cls(validation_schema(schema), format_checker=checker)


def answer_problem(validator, answer: str) -> str | None:
    """The validator's message for an answer that does not match (None if it does): the field's path
    and the rule."""
    import jsonschema

    try:
        value = json.loads(answer)
    except ValueError:  # the bulk checks catch this first, except for an earlier schema's answers
        return "answer is not valid JSON"
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return f"answer does not match llm_output at ${path}: {error.message} (rule '{error.validator}')"


# -- The column values and their docs ---------------------------------------------------------------


def value_sql(name: str, schema: dict, answer: str) -> str:
    """SQL: column `name`'s value in the structured answer `answer` (an SQL expression). A scalar is
    read as its text (a string without its JSON quotes, JSON null as NULL) and cast; an object or a
    list is cast from its JSON as a whole (DuckDB reads objects into STRUCT fields by name, an absent
    optional field as NULL, and arrays into LISTs). try_cast, not cast: answers checked by this version
    cast without loss (the checks above), and one stored by an earlier version that does not must not
    fail every later run of its model."""
    path = literal("$." + name)
    column = _type(schema)
    if _kind(schema)[0] in ("object", "array"):
        return f"try_cast(json_extract({answer}, {path}) as {column})"
    text = f"json_extract_string({answer}, {path})"
    return text if column == "VARCHAR" else f"try_cast({text} as {column})"


def describe(name: str, schema: dict) -> str:
    """What output column `name` holds, in words (its column comment, which `dbt docs` shows): the
    kind of value, and the schema's own description, which the provider was sent too."""
    kind, nullable = _kind(schema)
    if "enum" in schema:
        what = f"one of {[v for v in schema['enum'] if v is not None]}"
    elif schema.get("format") in FORMAT_PATTERNS:
        what = f"a {schema['format']} (RFC 3339, e.g. {FORMAT_EXAMPLES[schema['format']]})"
    else:
        what = {
            "string": "text",
            "integer": "an integer",
            "number": "a number",
            "boolean": "true or false",
            "object": "an object (STRUCT)",
            "array": "a list",
        }[kind]
    text = f"The answer's '{name}' field (llm_output): {what}{', or NULL' if nullable else ''}"
    return f"{text}; {schema['description']}" if schema.get("description") else text
