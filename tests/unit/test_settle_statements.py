"""What a harvest's settle runs, on small data (benchmarks/scale.py's offline steps), not timings: the
anti-join that looks for result lines their batch never sent runs only when the lines and the requests
they settled differ in number, and still finds such a line when they do."""

from __future__ import annotations

import json
import logging
import os
import sys

import duckdb

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.pipeline import merge, plan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import scale  # noqa: E402  (the scale benchmark's offline provider and steps)

UNKNOWN_LINES = "not exists"  # only the check for unknown lines anti-joins the lines to the requests


class Recording:
    """A connection that keeps the text of every statement it runs."""

    def __init__(self, con, seen: list):
        self._con, self.seen = con, seen

    def execute(self, sql, *args, **kwargs):
        self.seen.append(sql)
        result = self._con.execute(sql, *args, **kwargs)
        return self if result is self._con else result

    def cursor(self):
        return Recording(self._con.cursor(), self.seen)

    def __getattr__(self, name):
        return getattr(self._con, name)


def harvest(tmp_path, stranger: bool) -> tuple[list[str], duckdb.DuckDBPyConnection]:
    """Plan and "submit" 300 rows, answer every request, with `stranger` add a line for a custom_id
    no batch sent to the first result file, then harvest and merge; the statements the harvest ran."""
    config = parse_config(scale.RAW_CONFIG)
    con = duckdb.connect(str(tmp_path / "bench.duckdb"))
    con.execute(f"create table src as {scale.SOURCE.format(n=300)}")
    con.execute(f"create temp table {plan.INPUT} as select * from src")
    assert scale.plan_and_write(con, config, str(tmp_path)) == 300
    # The model's table, empty, as the run that submitted would leave it.
    merge.merge(Ledger(con, "main", "main.bench"), config, "main.bench", plan.describe(con, plan.INPUT), True)
    scale.write_results(con, str(tmp_path))
    if stranger:
        path = scale.result_paths(str(tmp_path))[0]
        with open(path) as fh:
            line = json.loads(fh.readline())
        line["custom_id"] = "r_not_ours"
        with open(path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
    seen: list[str] = []
    scale.ingest(Recording(con, seen), config, str(tmp_path))
    return seen, con


def test_a_harvest_whose_every_line_settles_a_request_does_not_look_for_unknown_lines(tmp_path):
    seen, con = harvest(tmp_path, stranger=False)
    assert not [s for s in seen if UNKNOWN_LINES in s and "llm_batch_results l" in s]
    assert con.execute("select count(*), count(llm_status) from main.bench").fetchall() == [(300, 300)]


def test_a_line_for_a_custom_id_no_batch_sent_is_still_found_and_ignored(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dbt_llm_batch"):
        seen, con = harvest(tmp_path, stranger=True)
    assert [s for s in seen if UNKNOWN_LINES in s and "llm_batch_results l" in s]
    assert "1 result line(s) for custom_ids their batch never sent were ignored" in caplog.text
    assert con.execute("select count(*), count(llm_status) from main.bench").fetchall() == [(300, 300)]
    assert con.execute("select count(*) from main.llm_batch_requests where status = 'succeeded'").fetchall() == [(300,)]
