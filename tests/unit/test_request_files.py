"""Request files on in-memory DuckDB: JSONL lines split greedily within the provider's per-batch
request and byte limits and the in-flight caps, and which row went to which file and line."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from dbt_llm_batch.errors import InputError
from dbt_llm_batch.pipeline import request_files
from dbt_llm_batch.pipeline.request_files import Room, write_request_files

# Each line is {"custom_id":"r<n>","prompt":"<prompt>"} and a newline.
COST = Decimal("0.001")  # each row's estimate
LINE_SQL = "to_json(struct_pack(custom_id := 'r' || plan_row, prompt := prompt))"


def plan(con, prompts: list[str], tokens: int = 10) -> str:
    con.execute(
        """create or replace temp table rows as
           select i::bigint as plan_row, ? as estimated_input_tokens, 0.001::decimal(18, 9) as estimated_cost_usd,
                  prompts[i] as prompt
           from (select ?::varchar[] as prompts), range(1, len(prompts) + 1) t(i)""",
        [tokens, prompts],
    )
    return "(select * from rows order by plan_row)"  # files follow the order rows stream in


def written(files) -> list[list[dict]]:
    out = []
    for f in files:
        with open(f.path, encoding="utf-8") as handle:
            text = handle.read()
        assert text.endswith("\n") and len(text.encode()) == f.bytes
        out.append([json.loads(line) for line in text.splitlines()])
    return out


def sent(con) -> list[tuple]:
    return con.execute(f"select plan_row, chunk, line from {request_files.SENT} order by plan_row").fetchall()


def test_lines_are_split_at_the_request_limit(memory_con, tmp_path):
    rows = plan(memory_con, [f"prompt {i:03}" for i in range(1, 6)])
    files = write_request_files(memory_con, LINE_SQL, rows, str(tmp_path), 2, 10_000, Room())
    assert [(f.chunk, f.requests, f.tokens, f.cost) for f in files] == [
        (0, 2, 20, 2 * COST),
        (1, 2, 20, 2 * COST),
        (2, 1, 10, COST),
    ]
    assert [[line["custom_id"] for line in file] for file in written(files)] == [["r1", "r2"], ["r3", "r4"], ["r5"]]
    assert written(files)[0][0] == {"custom_id": "r1", "prompt": "prompt 001"}
    assert sent(memory_con) == [(1, 0, 1), (2, 0, 2), (3, 1, 1), (4, 1, 2), (5, 2, 1)]  # 1-based lines


def test_lines_are_split_at_the_byte_limit(memory_con, tmp_path):
    rows = plan(memory_con, ["0123456789"] * 5)
    line_bytes = len(json.dumps({"custom_id": "r1", "prompt": "0123456789"}, separators=(",", ":"))) + 1
    files = write_request_files(memory_con, LINE_SQL, rows, str(tmp_path), 100, 2 * line_bytes + 1, Room())
    assert [f.requests for f in files] == [2, 2, 1]
    assert all(f.bytes <= 2 * line_bytes + 1 for f in files)
    assert sum(len(file) for file in written(files)) == 5


def test_a_line_over_the_byte_limit_on_its_own_is_refused(memory_con, tmp_path):
    rows = plan(memory_con, ["short", "x" * 200])
    with pytest.raises(
        InputError, match=r"a request is \d+ bytes, larger than the provider's batch limit \(100 bytes\)"
    ):
        write_request_files(memory_con, LINE_SQL, rows, str(tmp_path), 100, 100, Room())


def test_the_in_flight_caps_stop_writing_and_the_rest_waits(memory_con, tmp_path):
    rows = plan(memory_con, [f"p{i}" for i in range(1, 8)])
    files = write_request_files(memory_con, LINE_SQL, rows, str(tmp_path), 2, 10_000, Room(requests=3))
    assert [f.requests for f in files] == [2, 1]
    waiting = memory_con.execute(
        f"select plan_row from {request_files.unsent_rows(rows, len(files))} order by 1"
    ).fetchall()
    assert waiting == [(4,), (5,), (6,), (7,)]
    files = write_request_files(memory_con, LINE_SQL, rows, None, 2, 10_000, Room(batches=1))
    assert [f.requests for f in files] == [2]
    files = write_request_files(memory_con, LINE_SQL, rows, None, 5, 10_000, Room(tokens=35))  # 10 tokens a row
    assert [(f.requests, f.path) for f in files] == [(3, None)]  # only counted: no file without a directory


def test_one_request_over_the_token_cap_goes_alone_only_when_nothing_is_in_flight(memory_con, tmp_path):
    rows = plan(memory_con, ["a", "b"], tokens=500)
    alone = write_request_files(memory_con, LINE_SQL, rows, None, 5, 10_000, Room(tokens=100))
    assert [f.requests for f in alone] == [1]
    waits = write_request_files(memory_con, LINE_SQL, rows, None, 5, 10_000, Room(tokens=100, nothing_in_flight=False))
    assert waits == [] and sent(memory_con) == []
