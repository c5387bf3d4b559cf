"""llm_output as one JSON Schema: the user's column specs read into canonical fragments, and the
DuckDB type each fragment becomes.

A column is written in the compact form ('text', 'integer', 'number', 'boolean', or a list of allowed
strings) or as a JSON Schema fragment (a dict with a 'type'). Fragments nest to any depth: an object
becomes a STRUCT (fields in name order, like the table's output columns), an array a LIST. A field is
optional when its object leaves it out of `required` or its type admits 'null'; it is NULL when absent.

The canonical schema is provider-neutral: every object sets `additionalProperties: false` (a STRUCT
has exactly its fields), `required` is sorted, and a nullable enum lists null. Providers translate it
to what their API takes (providers/openai_chat.py for OpenAI's strict mode); every answer is checked
against it (pipeline/harvest.py).
"""

from __future__ import annotations

from typing import Any

from dbt_llm_batch.sql import ident

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
    """Whether the column is one of the compact types (a scalar or a string enum, not null, no other
    keyword but a description): its answers are checked in bulk SQL instead of value by value."""
    return (
        isinstance(schema.get("type"), str)
        and schema["type"] in SCALARS
        and set(schema) <= {"type", "enum", "description"}
    )


def nested(schema: dict) -> bool:
    """Whether the column's value is read from the answer's JSON as a whole (anything not flat)."""
    return not is_flat(schema)
