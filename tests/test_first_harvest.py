"""A first harvest written in one insert (merge._first_harvest): the rows it writes are the ones the
general merge writes from the same ledger (a full refresh rebuilds the table from the ledger with the
general merge: the table is a pure function of the ledger and the selection), and every condition it
does not cover leaves the harvest to the general merge."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from helpers import (
    PRICES,
    PROVIDER_MODELS,
    TRIAGE_OUTPUT,
    TRIAGE_SYSTEM,
    dup_model,
    prompt_of,
    triage_model,
    write_rows,
)

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


def test_a_first_harvest_of_nested_outputs_is_one_insert_and_writes_the_general_merge_s_rows(
    project, emulator, one_insert
):
    """Typed nested columns (a struct, a list of structs, a list, a date): the one insert types them as
    the general merge does."""
    from test_nested_outputs import MODEL, settle, write_model

    project.dbt("seed", "-s", "resumes")
    write_model(project, "openai", emulator)
    settle(project, emulator)
    assert [r for r in one_insert if r is not None] == [merge.Merged(5, 0, 0)], one_insert
    name = MODEL.rsplit("/", 1)[1].removesuffix(".sql")
    rows = assert_same_as_a_rebuild(project, name)
    assert len(rows) == 5
    nested = project.query(f"select count(*) from main.{name} where len(jobs) > 1 and len(skills) > 1")
    assert nested == [(5,)]


def test_a_first_harvest_of_an_embedding_model_is_one_insert_and_writes_the_general_merge_s_rows(
    project, emulator, one_insert
):
    from test_embeddings import NAME, assert_every_row_has_its_vector, embed_model, write_docs
    from test_embeddings import table as embedded

    project.write(f"models/{NAME}.sql", embed_model())
    write_docs(project, {i: i for i in range(6)})
    project.dbt("run", "-s", NAME)
    emulator.complete_all()
    project.dbt("run", "-s", NAME)
    assert [r for r in one_insert if r is not None] == [merge.Merged(6, 0, 0)], one_insert
    assert_every_row_has_its_vector(embedded(project), 6)
    assert len(assert_same_as_a_rebuild(project, NAME)) == 6


def test_urgent_rows_merged_in_the_run_that_sent_them_leave_the_batch_s_rows_to_the_general_merge(
    project, emulator, one_insert
):
    """The sending run merges the urgent rows while the batch's rows are in flight (the one insert,
    short of rows, is rolled back); the batch's harvest then finds a table with rows."""
    emulator.auto_advance_seconds = None
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model(extra_config="llm_realtime_when = 'ticket_id < 3',"))
    project.dbt("run", "-s", "triage")
    assert project.query("select ticket_id, llm_route from main.triage order by all") == [
        (1, "realtime"),
        (2, "realtime"),
    ]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert one_insert and not any(one_insert), one_insert
    rows = assert_same_as_a_rebuild(project)
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]
    routes = project.query("select llm_route, count(*) from main.triage group by all order by all")
    assert routes == [("batch", 4), ("realtime", 2)]


def test_a_row_another_model_maps_to_these_requests_as_the_first_harvest_begins_splits_their_cost(
    project, emulator, one_insert, monkeypatch
):
    """dbt's threads: twin's run maps its rows to dup's requests in flight (llm_dedup = 'ledger') and
    commits just as dup's merge opens its transaction, after dup's harvest. The one insert reads its
    conditions inside that transaction, so it sees twin's rows and leaves the split to the general
    merge: the two tables' costs add up to what was billed. (Read before the transaction, it would
    write dup's rows at their requests' whole cost, and twin's rows would add their shares again.)"""
    from helpers import billed_cost

    from dbt_llm_batch.pipeline import runner

    emulator.auto_advance_seconds = None
    project.write("seeds/llm_prices.csv", PRICES)
    write_rows(project, {i: i for i in range(6)})
    for name in ("dup", "twin"):
        project.write(f"models/{name}.sql", dup_model("openai", extra="llm_dedup='ledger'"))
    project.dbt("run", "-s", "dup")
    project.dbt("run", "-s", "twin")  # maps its rows to dup's requests in flight
    # twin's run is made to commit its rows later: they are set aside, and put back as dup's merge begins.
    project.query("create table main.twin_rows as select * from main.llm_batch_row_answers where model = 'main.twin'")
    project.query("delete from main.llm_batch_row_answers where model = 'main.twin'")
    emulator.complete_all()
    runs, put_back = {}, []
    original_merge, original_transaction = runner.ModelRun.merge, merge.transaction

    def run_merge(run, target, rebuild):
        runs["dup"] = run
        return original_merge(run, target, rebuild)

    def transaction(con):
        if "dup" in runs and not put_back:
            other = runs["dup"].con.cursor()  # another connection, as another dbt thread's
            put_back.append(
                other.execute("insert into main.llm_batch_row_answers select * from main.twin_rows").fetchall()
            )
            other.close()
        return original_transaction(con)

    with monkeypatch.context() as patched:
        patched.setattr(runner.ModelRun, "merge", run_merge)
        patched.setattr(merge, "transaction", transaction)
        project.dbt("run", "-s", "dup")
    assert put_back == [[(6,)]] and one_insert == [None], (put_back, one_insert)
    project.dbt("run", "-s", "twin")
    costs = {}
    for name in ("dup", "twin"):
        rows = project.query(f"select id, prompt, llm_status, llm_cost_usd from main.{name} order by id")
        assert [r[:3] for r in rows] == [(i, prompt_of(i), "succeeded") for i in range(6)], name
        costs[name] = [r[3] for r in rows]
    # Each request's cost is split between its two rows (one in each table), adding up to what was billed.
    assert all(d and t and abs(d - t) <= Decimal("0.000001") for d, t in zip(costs["dup"], costs["twin"], strict=True))
    assert sum(costs["dup"]) + sum(costs["twin"]) == billed_cost(emulator, "openai")
    assert len(emulator.billed()) == 6


def test_a_first_harvest_after_a_full_re_parse_with_the_config_moved_to_yaml_is_one_insert(
    project, emulator, one_insert
):
    """A CI checkout parses from scratch, and a user may move a model's config from its SQL to its
    YAML between runs: the same config is the same model, so the batch sent before is harvested by
    the one insert, and the table is the general merge's."""
    emulator.auto_advance_seconds = None
    project.dbt("seed", "-s", "support_tickets")
    project.write("models/triage.sql", triage_model())
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.write("models/triage.sql", triage_model().split("}}", 1)[1])  # the select, no config() call
    project.write(
        "models/triage.yml",
        "version: 2\nmodels:\n  - name: triage\n    config:\n"
        + "".join(
            f"      {k}: {json.dumps(v)}\n"
            for k, v in {
                "materialized": "llm_batch",
                "llm_provider": "openai",
                "llm_model": PROVIDER_MODELS["openai"],
                "unique_key": "ticket_id",
                "llm_system": TRIAGE_SYSTEM,
                "llm_output": TRIAGE_OUTPUT,
                "llm_max_tokens": 200,
            }.items()
        ),
    )
    project.dbt("run", "-s", "triage", "--no-partial-parse")
    assert len(emulator.batches()) == 1  # nothing asked again: the config is the one the batch was sent with
    assert one_insert == [merge.Merged(6, 0, 0)], one_insert
    rows = assert_same_as_a_rebuild(project)
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert project.query("select llm_status, count(*) from main.triage group by all") == [("succeeded", 6)]
