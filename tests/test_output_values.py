"""What an output column holds is the answer's value, on both batch providers: real dbt against the
sandbox.

- An answer whose value the column cannot hold (a date-time that is no date-time, a leap second a
  TIMESTAMP WITH TIME ZONE has no room for, an integer past BIGINT's range, at the top level or in a
  nullable column) is a failed attempt with the reason, retried under llm_max_attempts like any other
  answer off the schema: never a succeeded row with NULL in its place.
- A nullable string column holds the string's text (no JSON quotes), and SQL NULL for JSON null.
"""

from __future__ import annotations

import json
import re

from helpers import run, setup

OUTPUT = (
    "{'when': {'type': 'string', 'format': 'date-time'}, 'n': 'integer', 'm': {'type': ['integer', 'null']}, "
    "'ks': {'type': 'array', 'items': {'type': 'integer'}}, "
    "'ds': {'type': 'array', 'items': {'type': 'string', 'format': 'date'}}}"
)
GOOD = {"when": "2026-01-01T10:00:00Z", "n": 1, "m": 1, "ks": [1], "ds": ["2026-02-28"]}

# The answer each row gets on its first attempt (GOOD but for one field), and the reason that attempt
# fails: flat columns are checked in SQL, the values in lists with jsonschema.
UNHOLDABLE = {
    "row 0": (
        {"when": "next tuesday"},
        "field 'when' is not a date-time its TIMESTAMP WITH TIME ZONE column holds (RFC 3339, e.g. "
        "2026-01-31T09:30:00Z): next tuesday",
    ),
    "row 1": (  # RFC 3339 has leap seconds; DuckDB's TIMESTAMP WITH TIME ZONE does not
        {"when": "2026-06-30T23:59:60Z"},
        "field 'when' is not a date-time its TIMESTAMP WITH TIME ZONE column holds (RFC 3339, e.g. "
        "2026-01-31T09:30:00Z): 2026-06-30T23:59:60Z",
    ),
    "row 2": (
        {"n": 9223372036854775808},
        "field 'n' is out of the range of its BIGINT column: 9223372036854775808",
    ),
    "row 3": ({"m": 1e20}, "field 'm' is missing or not of type integer or null"),
    "row 4": (
        {"ks": [1, 1e20]},
        "answer does not match llm_output at $.ks[1]: 1e+20 is out of the range of its BIGINT column (rule 'range')",
    ),
    "row 5": (
        {"ds": ["2026-02-30"]},
        "answer does not match llm_output at $.ds[0]: '2026-02-30' is not a 'date' (rule 'format')",
    ),
}


def settle(project, emulator, runs: int) -> None:
    for _ in range(runs):
        run(project)
        emulator.complete_all()


def test_a_value_the_column_cannot_hold_is_a_failed_attempt_that_is_retried(project, emulator, provider):
    setup(project, provider, extra=f"llm_output={OUTPUT}, llm_max_attempts=2,")
    for prompt, (field, _) in UNHOLDABLE.items():
        emulator.add_fault(kind="content", prompt_contains=prompt, content=json.dumps(GOOD | field), times=1)
    settle(project, emulator, runs=3)

    rows = project.query('select llm_status, ["when"::varchar, n::varchar], ks, ds from main.m')
    assert len(rows) == 6
    # Every row holds the sandbox's own answer, asked again: no NULL in a succeeded row.
    assert all(status == "succeeded" and _no_null([*values]) for status, *values in rows), rows
    attempts = project.query(
        """select json_extract_string(row_json, '$.prompt'), status, error from main.llm_batch_requests
           order by 1, seq"""
    )
    failed = {prompt: error for prompt, status, error in attempts if status == "failed"}
    assert failed == {prompt: error for prompt, (_, error) in UNHOLDABLE.items()}
    assert [status for _, status, _ in attempts] == ["failed", "succeeded"] * 6


def _no_null(value) -> bool:
    return value is not None and (not isinstance(value, list) or all(_no_null(v) for v in value))


def test_a_nullable_string_holds_its_text_and_null_as_null(project, emulator, provider):
    setup(project, provider, extra="llm_output={'note': {'type': ['string', 'null']}, 'tag': 'text'},")
    emulator.add_fault(kind="content", prompt_contains="row 0", content='{"note": null, "tag": "x"}')
    emulator.add_fault(kind="content", prompt_contains="row 1", content='{"note": "say \\"hi\\"", "tag": "null"}')
    settle(project, emulator, runs=2)

    rows = dict(project.query("select prompt, struct_pack(note, tag, llm_status) from main.m"))
    assert rows["row 0"] == {"note": None, "tag": "x", "llm_status": "succeeded"}
    assert rows["row 1"] == {"note": 'say "hi"', "tag": "null", "llm_status": "succeeded"}
    # The sandbox answers the others with a string or null (the text, never its JSON form).
    for prompt in ("row 2", "row 3", "row 4", "row 5"):
        note = rows[prompt]["note"]
        assert note is None or re.fullmatch(r"sandbox-[0-9a-f]{8}", note), (prompt, note)
    assert {rows[p]["note"] is None for p in ("row 2", "row 3", "row 4", "row 5")} == {True, False}


def test_a_realtime_answer_the_column_cannot_hold_is_a_failed_attempt_too(project, emulator, provider):
    # Every row goes realtime, answered within the run: its reply is settled by the same checks.
    setup(project, provider, extra=f"llm_output={OUTPUT}, llm_max_attempts=2, llm_realtime_when='true',")
    emulator.add_fault(kind="content", prompt_contains="row 0", content=json.dumps(GOOD | {"when": "next tuesday"}))
    run(project)
    assert project.query("select status from main.llm_batch_requests where row_json like '%row 0%'") == [("failed",)]
    run(project)  # the second attempt

    rows = project.query('select llm_status, ["when"::varchar, n::varchar], ks, ds from main.m')
    assert len(rows) == 6
    assert all(status == "succeeded" and _no_null([*values]) for status, *values in rows), rows
