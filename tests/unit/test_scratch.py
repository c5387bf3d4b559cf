"""The run's scratch tables have one owner (dbt_llm_batch/pipeline/scratch.py): no other module spells
a scratch name, and Scratch.drop_all removes every table and view it names, whatever state they are in."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pyarrow as pa

import dbt_llm_batch
from dbt_llm_batch.pipeline.scratch import Scratch

PACKAGE = Path(dbt_llm_batch.__file__).parent
SCRATCH_NAME = re.compile(r"__llm_\w+")


def scratch_left(con) -> list[str]:
    return [
        r[0]
        for r in con.execute(
            r"""select table_name from duckdb_tables() where temporary and table_name like '\_\_llm\_%' escape '\'
                union all
                select view_name from duckdb_views() where temporary and view_name like '\_\_llm\_%' escape '\'
                order by 1"""
        ).fetchall()
    ]


def test_only_scratch_py_names_scratch_tables():
    named_in = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".sql", ".jinja", ".md", ".txt"):
            for name in SCRATCH_NAME.findall(path.read_text(encoding="utf-8")):
                named_in.setdefault(path.relative_to(PACKAGE).as_posix(), set()).add(name)
    assert set(named_in) == {"pipeline/scratch.py"}, f"scratch names spelled outside scratch.py: {named_in}"
    # ... and every name spelled there is one drop_all knows (no name added without its cleanup).
    assert named_in["pipeline/scratch.py"] == set(Scratch.names())
    assert len(Scratch.names()) == len(set(Scratch.names())), "two roles share one name"


def test_drop_all_removes_every_table_and_view():
    con = duckdb.connect()
    for role in Scratch.TABLES:
        con.execute(f"create temp table {getattr(Scratch, role)} as select 1 as x")
    for role in Scratch.VIEWS:
        con.register(getattr(Scratch, role), pa.table({"x": [1]}))
    con.execute("create temp table keep_me as select 1 as x")  # not the run's: left alone
    assert scratch_left(con) == sorted(Scratch.names())

    Scratch(con).drop_all()

    assert scratch_left(con) == []
    assert con.execute("select count(*) from keep_me").fetchall() == [(1,)]


def test_drop_all_never_raises_so_the_runs_own_error_is_the_one_reported():
    con = duckdb.connect()
    Scratch(con).drop_all()  # nothing to drop: a run that failed before making any table
    con.close()
    Scratch(con).drop_all()  # a closed connection (a Python model's own cursor, already closed)
