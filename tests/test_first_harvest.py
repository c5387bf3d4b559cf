"""A first harvest written in one insert (merge._first_harvest): the rows it writes are the ones the
general merge writes from the same ledger (a full refresh rebuilds the table from the ledger with the
general merge: the table is a pure function of the ledger and the selection), and every condition it
does not cover leaves the harvest to the general merge."""

from __future__ import annotations

import pytest
from helpers import PRICES, dup_model, prompt_of, triage_model, write_rows

from dbt_llm_batch.pipeline import merge


@pytest.fixture
def one_insert(monkeypatch):
    """What each merge's one-insert attempt returned (None: left to the general merge)."""
    seen = []
    original = merge._first_harvest

    def first_harvest(*args):
        result = original(*args)
        seen.append(result)
        return result

    monkeypatch.setattr(merge, "_first_harvest", first_harvest)
    return seen


def table(project, name: str = "triage") -> list[tuple]:
    return project.query(f"select * from main.{name} order by all")


def assert_same_as_a_rebuild(project, name: str = "triage", unselected: int | None = None) -> list[tuple]:
    """The table equals the one a full refresh writes (for the selected keys: a rebuild writes no
    other; the `unselected` key keeps its row in the incremental table)."""
    written = table(project, name)
    project.dbt("run", "-s", name, "--full-refresh")  # the general merge, from the ledger
    assert table(project, name) == [r for r in written if r[0] != unselected]
    return written


def test_a_plain_first_harvest_is_one_insert_and_writes_the_general_merge_s_rows(project, emulator, one_insert):
    emulator.auto_advance_seconds = None
    project.dbt("seed", "-s", "support_tickets")
    emulator.add_fault(prompt_contains="invoice", status_code=400, message="Bad line.", times=None)
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    (failed,) = project.query("select count(*) from main.support_tickets where body ilike '%invoice%'")[0]
    assert failed and [r for r in one_insert if r is not None] == [merge.Merged(6, failed, 0)], one_insert
    rows = assert_same_as_a_rebuild(project)
    assert len(rows) == 6
    statuses = project.query("select llm_status, count(*) from main.triage group by all order by all")
    assert statuses == [("failed", failed), ("succeeded", 6 - failed)]


@pytest.mark.parametrize("edit", ["prompt", "selection"])
def test_a_first_harvest_whose_rows_changed_in_flight_is_left_to_the_general_merge(project, emulator, one_insert, edit):
    """Rows whose prompt changed since they were asked (their row is read from the ledger) or that are no
    longer selected: the one insert does not write them, is rolled back, and the general merge writes
    the table."""
    emulator.auto_advance_seconds = None
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    changed = (
        triage_model().replace(
            "|| body as prompt", "|| body || case when ticket_id = 2 then ' (edited)' else '' end as prompt"
        )
        if edit == "prompt"
        else triage_model(where="where ticket_id <> 2")
    )
    project.write("models/triage.sql", changed)
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert one_insert and not any(one_insert), one_insert
    rows = assert_same_as_a_rebuild(project, unselected=2 if edit == "selection" else None)
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]
    if edit == "prompt":  # both of ticket 2's requests answered: the one its row asks now is shown
        assert project.query("select ticket_id from main.triage where prompt like '% (edited)'") == [(2,)]


@pytest.mark.parametrize("shared", ["within", "ledger"])
def test_a_first_harvest_of_rows_sharing_requests_is_left_to_the_general_merge(project, emulator, one_insert, shared):
    """Rows sharing a request (the same prompt; with llm_dedup = 'ledger', another model's rows too)
    split its cost: the general merge writes them."""
    emulator.auto_advance_seconds = None
    project.write("seeds/llm_prices.csv", PRICES)
    write_rows(project, {i: i % 3 for i in range(6)} if shared == "within" else {i: i for i in range(6)})
    names = ["dup"] if shared == "within" else ["dup", "twin"]
    for name in names:
        project.write(
            f"models/{name}.sql", dup_model("openai", extra="llm_dedup='ledger'" if shared == "ledger" else "")
        )
    for name in names:
        project.dbt("run", "-s", name)
    emulator.complete_all()
    project.dbt("run", "-s", "dup")
    assert one_insert and not any(one_insert), one_insert
    rows = assert_same_as_a_rebuild(project, "dup")
    assert [r[:2] for r in project.query("select id, prompt from main.dup order by id")] == [
        (i, prompt_of(i % 3 if shared == "within" else i)) for i in range(6)
    ]
    assert len(rows) == 6
