"""The model's rows (the prompts) stream through the probe side of the joins that read them by row id,
never into a hash table (sql.joins_as_written; issue #36): the statement plans DuckDB makes, on small
data (benchmarks/scale.py's offline steps), not timings."""

from __future__ import annotations

import json
import os
import sys
import threading

import duckdb
import pytest

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.pipeline import merge, plan
from dbt_llm_batch.sql import joins_as_written

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import scale  # noqa: E402  (the scale benchmark's offline provider and steps)

WIDE = ", ".join(f"md5(i::varchar) as c{n}" for n in range(20))


def join_sides(con, query: str) -> list[tuple[set[str], set[str]]]:
    """(tables on the probe side, tables on the build side) of each hash join of `query`, as DuckDB
    would run it now."""
    found = []

    def tables(node) -> set[str]:
        table = (node.get("extra_info") or {}).get("Table")
        below = set().union(*(tables(child) for child in node.get("children", [])))
        return below | ({table.split(".")[-1]} if table else set())

    def walk(node):
        children = node.get("children", [])
        if node.get("name", "").strip() == "HASH_JOIN":
            found.append((tables(children[0]), tables(children[1])))
        for child in children:
            walk(child)

    for tree in json.loads(con.execute("explain (format json) " + query).fetchall()[0][1]):
        walk(tree)
    return found


def built_on(con, query: str) -> set[str]:
    """The tables some hash join of `query` builds its hash table over."""
    return set().union(*(build for _, build in join_sides(con, query)))


def test_the_input_is_the_probe_side_as_written_and_the_setting_comes_back(memory_con):
    con = memory_con
    con.execute(f"create temp table {plan.INPUT} as select i as id, repeat('x', 500) as prompt from range(2000) t(i)")
    con.execute(f"create temp table narrow as select i * 2 as row, {WIDE} from range(1000) t(i)")
    query = f"select n.*, i.prompt from {plan.INPUT} i right join narrow n on i.rowid = n.row"
    # What it rests on: DuckDB sizes a VARCHAR at 24 bytes whatever its length, so by its own choice
    # the prompts (fewer columns) are the build side.
    assert built_on(con, query) == {plan.INPUT}
    con.execute("set disabled_optimizers = 'top_n'")
    with joins_as_written(con):
        assert built_on(con, query) == {"narrow"}
    assert con.execute("select current_setting('disabled_optimizers')").fetchall()[0][0] == "top_n"
    with pytest.raises(duckdb.Error), joins_as_written(con):
        con.execute("select * from no_such_table")
    assert con.execute("select current_setting('disabled_optimizers')").fetchall()[0][0] == "top_n"


def materialized(con, query: str) -> set[str]:
    """The CTEs of DuckDB's plan of `query` that may be materialized (their rows stored, spilling past
    memory_limit, to be read more than once): a CTE named in a plan is one read more than once."""
    names: set[str] = set()

    def walk(node):
        info = node.get("extra_info") or {}
        if node.get("name", "").strip() == "CTE":  # whether it is stored is decided as it runs
            names.add(info.get("CTE Name"))
        for child in node.get("children", []):
            walk(child)

    for tree in json.loads(con.execute("explain (format json) " + query).fetchall()[0][1]):
        walk(tree)
    return names


class Explaining:
    """A connection that, before running a statement reading the model's rows by row id, records
    the tables its hash joins are built over."""

    def __init__(self, con, sides: dict):
        self._con, self.sides = con, sides

    def execute(self, sql, *args, **kwargs):
        if f"{plan.INPUT} i" in sql and "i.rowid" in sql and sql.lstrip().startswith("insert"):
            params = args[0] if args else None
            if not params:  # explain needs the statement's values: only unparameterized ones, or inline them
                built = built_on(self._con, sql)
            else:
                text = sql
                for value in params:
                    text = text.replace("?", f"'{value}'", 1)
                built = built_on(self._con, text)
            statement = "requests" if "llm_batch_requests" in sql.split("(")[0] else "merge"
            self.sides[statement] = built
            if statement == "merge" and " by name " in sql and "__llm_emit_rows" not in sql:
                # A first harvest in one insert (merge._first_harvest): the winners are joined inside it.
                self.sides["winners materialized"] = materialized(self._con, sql.split(" by name ", 1)[1])
        if sql.lstrip().startswith(f"create or replace temp table {merge.EMIT_ROWS} "):
            self.sides["winners materialized"] = materialized(self._con, sql)
        result = self._con.execute(sql, *args, **kwargs)
        return self if result is self._con else result

    def sql(self, query, *args, **kwargs):
        if f"{plan.INPUT} i" in query and "i.rowid" in query:  # the request lines, streamed (request_files)
            self.sides["request lines"] = built_on(self._con, query)
        return self._con.sql(query, *args, **kwargs)

    def cursor(self):
        return Explaining(self._con.cursor(), self.sides)

    def __getattr__(self, name):
        return getattr(self._con, name)


@pytest.mark.parametrize("one_insert", [True, False], ids=["first_harvest", "general_merge"])
def test_the_intents_and_the_merge_stream_the_model_rows(tmp_path, monkeypatch, one_insert):
    """The request lines streamed to the files, the requests' insert and the merge's insert of 1000 rows, every row new and answered (the scale
    the model's rows are the probe side of their join, so no hash table holds the prompts."""
    config = parse_config(scale.RAW_CONFIG)
    if not one_insert:  # the general merge, which writes the same harvest in two statements
        monkeypatch.setattr(merge, "_first_harvest", lambda *args: None)
    raw = duckdb.connect(str(tmp_path / "bench.duckdb"))
    raw.execute(f"create table src as {scale.SOURCE.format(n=1000)}")
    raw.execute(f"create temp table {plan.INPUT} as select * from src")
    Ledger(raw, "main", "main.bench").migrate()
    sides: dict = {}
    con = Explaining(raw, sides)
    assert scale.plan_and_write(con, config, str(tmp_path)) == 1000
    scale.write_results(raw, str(tmp_path))
    merge.merge(Ledger(raw, "main", "main.bench"), config, "main.bench", plan.describe(raw, plan.INPUT), True)
    scale.ingest(con, config, str(tmp_path))
    requests, merged, lines = "requests", "merge", "request lines"
    assert set(sides) == {requests, merged, lines, "winners materialized"}, sides
    # Each has its hash joins (it reads the model's rows by row id), none built over the model's rows.
    assert sides[lines] and plan.INPUT not in sides[lines], sides
    assert sides[requests] and plan.INPUT not in sides[requests], sides
    assert sides[merged] and plan.INPUT not in sides[merged], sides
    # The merge's winners (every answered key, with its request: `w`) are joined once, not stored
    # to be read twice (the combined answers' parts, none here, may be).
    assert "w" not in sides["winners materialized"], sides
    if not one_insert:  # the parts of combined answers (none here) may be: the one insert reads none
        assert "parts" in sides["winners materialized"], sides
    # The rows are right: each answered key once, with its prompt and its answer.
    assert raw.execute(
        "select count(*), count(distinct id), count(category), bool_and(prompt = repeat(md5(id::varchar), 16)) "
        "from main.bench"
    ).fetchall() == [(1000, 1000, 1000, True)]


def test_threads_leave_the_setting_as_they_found_it(memory_con):
    """disabled_optimizers belongs to the database, not the connection: dbt's threads (a cursor each)
    turning it off at once must still leave it as it was."""
    memory_con.execute("set disabled_optimizers = 'top_n'")

    def work():
        cursor = memory_con.cursor()
        for _ in range(200):
            with joins_as_written(cursor):
                cursor.execute("select 1").fetchall()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert memory_con.execute("select current_setting('disabled_optimizers')").fetchall()[0][0] == "top_n"
