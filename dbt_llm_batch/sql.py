"""The package's one SQL vocabulary: how a name or a value goes into DuckDB SQL text.

Values that vary per call go in as parameters (`?` or `$name`) wherever DuckDB accepts them; these
helpers are for what parameters cannot carry: identifiers, and literals inside DDL, table functions
(`read_csv('...')`) and SQL expressions built once and run over many rows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


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


# The optimizer DuckDB uses to swap a join's build and probe sides by estimated size.
BUILD_SIDE_OPTIMIZER = "build_side_probe_side"
JOIN_ORDER_OPTIMIZER = "join_order"
# DuckDB's disabled_optimizers is a setting of the database instance, not of a connection (it cannot be
# set locally): the statements that turn it off run one at a time in this process, each restoring the
# value it found, so dbt's threads never leave it off. A statement of another thread planned meanwhile
# gets its joins' sides as written too: slower at worst, never a different answer.
_AS_WRITTEN = threading.RLock()


@contextmanager
def joins_as_written(con, order: bool = False) -> Iterator[None]:
    """Run the statements inside with each outer join's build side as written: its right side.

    For a join that reads the model's rows (Scratch.input, the prompts: 5 GB at ten million
    512-character prompts) by `i.rowid` to add them to a narrower relation (the plan's requests, the
    merge's winners), written `from <input> i right join <narrow> n on i.rowid = n.<row>`: the hash
    table holds the narrow rows and the prompts stream through the probe side. DuckDB picks the build
    side by estimated rows times declared row width and declares a VARCHAR 24 bytes whatever its
    length, so the narrow side, with more columns, looked the bigger one: a hash table of every prompt,
    which spilled once they outgrew memory_limit (a merge at 1M rows under 600MB: 1.6 GB spilled; from
    1M to 10M rows the statement grew 26x). Inner joins are still ordered by DuckDB's join order
    optimizer, unless `order`: then every join is run as written, each one's right side its build
    side (merge._first_harvest: the requests stream through the row answers and desired rows, and
    the result is the build side of the join with the model's rows). The setting is restored after,
    whatever happens."""
    with _AS_WRITTEN:
        before = con.execute("select current_setting('disabled_optimizers')").fetchall()[0][0] or ""
        names = [name.strip() for name in before.split(",") if name.strip()]
        added = [BUILD_SIDE_OPTIMIZER, *([JOIN_ORDER_OPTIMIZER] if order else [])]
        con.execute(f"set disabled_optimizers = {literal(','.join([*names, *added]))}")
        try:
            yield
        finally:
            con.execute(f"set disabled_optimizers = {literal(before)}")
