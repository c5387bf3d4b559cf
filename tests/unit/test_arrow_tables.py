"""pipeline/arrow_tables.py: NumPy arrays read from what DuckDB streams, whatever its integer type."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from dbt_llm_batch.pipeline import arrow_tables


def batch(sql: str) -> pa.RecordBatch:
    return next(iter(duckdb.connect().sql(sql).to_arrow_reader(1000)))


def test_integers_of_every_width_a_sum_and_nulls_are_read_as_int64():
    b = batch("""select range::int as i, range::bigint as b, sum(range) over (order by range) as s,
                        case when range % 2 = 0 then range end as n
                 from range(5)""")
    assert b.schema.field("s").type == pa.decimal128(38, 0)  # what a SUM of integers streams as
    assert arrow_tables.to_numpy(b.column("i"), np.int64).tolist() == [0, 1, 2, 3, 4]
    assert arrow_tables.to_numpy(b.column("b"), np.int64).tolist() == [0, 1, 2, 3, 4]
    assert arrow_tables.to_numpy(b.column("s"), np.int64).tolist() == [0, 1, 3, 6, 10]
    assert arrow_tables.to_numpy(b.column("n"), np.int64, null=-1).tolist() == [0, -1, 2, -1, 4]
    assert arrow_tables.to_numpy(b.column("n").slice(1, 3), np.int64, null=-1).tolist() == [-1, 2, -1]
    with pytest.raises(ValueError, match="unexpected NULL"):
        arrow_tables.to_numpy(b.column("n"), np.int64)


def test_numpy_columns_round_trip_through_duckdb():
    con = duckdb.connect()
    table = arrow_tables.from_numpy({"row": np.arange(4, dtype=np.int64), "chunk": np.array([0, 0, 1, 1], np.int32)})
    con.register("t", table)
    assert con.execute("select row, chunk from t order by row").fetchall() == [(0, 0), (1, 0), (2, 1), (3, 1)]
    made = arrow_tables.from_lists(con, {"job_id": ("varchar", ["a", None]), "n": ("bigint", [1, None])})
    assert made.to_pylist() == [{"job_id": "a", "n": 1}, {"job_id": None, "n": None}]
