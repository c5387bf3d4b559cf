"""The package's one SQL vocabulary: how a name or a value goes into DuckDB SQL text.

Values that vary per call go in as parameters (`?` or `$name`) wherever DuckDB accepts them; these
helpers are for what parameters cannot carry: identifiers, and literals inside DDL, table functions
(`read_csv('...')`) and SQL expressions built once and run over many rows.
"""

from __future__ import annotations

from collections.abc import Iterable


def ident(name: str) -> str:
    """An identifier (column, table or schema name), quoted for DuckDB."""
    return '"' + name.replace('"', '""') + '"'


def qualified(schema: str, name: str) -> str:
    """schema.name, both quoted."""
    return f"{ident(schema)}.{ident(name)}"


def literal(text: str) -> str:
    """A DuckDB string literal."""
    return "'" + text.replace("'", "''") + "'"


def in_list(values: Iterable[str]) -> str:
    """The parenthesised list of string literals for `x IN (...)`; `(NULL)` when empty, which matches
    nothing (an empty `IN ()` is a syntax error)."""
    items = [literal(v) for v in values]
    return "(" + (", ".join(items) if items else "NULL") + ")"


def list_literal(values: Iterable[str]) -> str:
    """A DuckDB LIST of strings: ['a', 'b']."""
    return "[" + ", ".join(literal(v) for v in values) + "]"
