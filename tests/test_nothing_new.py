"""llm_updated_at (#36): a run with nothing new reads only the key and updated_at columns, sends
nothing and leaves the table as it is; every change (a row, a config, the SQL, a variant, an added
output field) re-plans and sends what it must; the signature is recorded only by a run that leaves
the model complete, and a ledger of the previous version migrates in place with a batch in flight.
Real dbt in-process against the sandbox."""

from __future__ import annotations

import shutil

import duckdb
import pytest
from conftest import failure_messages
from helpers import log_text

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.ledger.store import SCHEMA_VERSION
from dbt_llm_batch.ops.cli import main as cli
from dbt_llm_batch.pipeline import model_input, settled

ROWS = {1: "row 1", 2: "row 2", 3: "row 3", 4: "row 4", 5: "row 5", 6: "row 6"}
OUTPUT = "llm_output = {'summary': 'text', 'sentiment': ['positive', 'negative']},"


def write_src(project, rows: dict[int, str], updated: dict[int, int] | None = None) -> None:
    """The source table `src` (a, body, u): u is 1 unless `updated` says otherwise."""
    updated = updated or {}
    values = ", ".join(f"({a}, '{body}', {updated.get(a, 1)})" for a, body in rows.items())
    project.write("models/src.sql", f"select * from (values {values}) t(a, body, u)")
    project.dbt("run", "-s", "src")


def llm_model(extra: str = "", prompt: str = "'Summarise: ' || body", where: str = "") -> str:
    return f"""
{{{{ config(materialized='llm_batch', unique_key='a', llm_model='gpt-4o-mini', llm_system='Summarise.',
            llm_max_tokens=100, llm_updated_at='u', {extra}) }}}}
select a, u, {prompt} as prompt from {{{{ ref('src') }}}} {where}
"""


def calls(emulator) -> int:
    return sum(emulator.stats()["calls"].values())


def asked(emulator) -> int:
    return len(emulator.billed())


def settled_rows(project, model: str = "main.m") -> list[tuple]:
    return project.query("select row_count from main.llm_batch_settled where model = ?", [model])


def table(project, name: str = "m") -> list[tuple]:
    return project.query(f"select * exclude (llm_completed_at) from main.{name} order by all")


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The SQL of every model input a run loaded (model_input.load_input): a skipped run loads none."""
    seen: list[str] = []
    real = model_input.load_input

    def counted(con, sql, df, config=None):
        seen.append(sql)
        return real(con, sql, df, config)

    monkeypatch.setattr(model_input, "load_input", counted)
    return seen


def answered(project, emulator, model: str, name: str = "m") -> None:
    """Run the model, let the sandbox answer its batch, run it again (harvest and merge)."""
    project.write(f"models/{name}.sql", model)
    project.dbt("run", "-s", name)
    emulator.complete_all()
    project.dbt("run", "-s", name)


def assert_skips(project, emulator, loads, name: str = "m") -> None:
    """The next run of `name` loads nothing, calls the provider for nothing, leaves the table as it is."""
    before, n_calls, n_loads = table(project, name), calls(emulator), len(loads)
    project.dbt("run", "-s", name)
    assert len(loads) == n_loads, "the model's input was loaded"
    assert calls(emulator) == n_calls, "the provider was called"
    assert table(project, name) == before
    assert f"main.{name}: nothing new: 6 row(s) unchanged since" in log_text(project)
    assert "(by llm_updated_at = u)" in log_text(project)


def runs_normally(project, loads, name: str = "m") -> None:
    n_loads = len(loads)
    project.dbt("run", "-s", name)
    assert len(loads) == n_loads + 1, "the run skipped"


def test_a_second_run_with_nothing_new_skips_and_a_batch_in_flight_records_nothing(project, emulator, loads):
    write_src(project, ROWS)
    project.write("models/m.sql", llm_model())
    project.dbt("run", "-s", "m")
    assert settled_rows(project) == [], "a batch is in flight: the model is not complete"
    runs_normally(project, loads)  # the batch still in flight at the provider: no skip, no signature
    assert settled_rows(project) == []
    emulator.complete_all()
    project.dbt("run", "-s", "m")  # harvests and merges: complete
    assert settled_rows(project) == [(6,)]
    assert project.query("select count(*) from main.m where llm_status = 'succeeded'") == [(6,)]
    assert_skips(project, emulator, loads)
    # dbt parses from scratch (every CI checkout does): the same model still skips.
    shutil.rmtree(project.root / "target", ignore_errors=True)
    project.dbt("parse", "--no-partial-parse")
    assert_skips(project, emulator, loads)
    assert asked(emulator) == 6


def test_each_change_re_plans_and_sends_what_it_must(project, emulator, loads):
    """One model's life, one change at a time: each run after a change plans (loads its rows) and sends
    what the change asks, the run that merges it records the new signature, and the next one skips."""
    rows, updated = dict(ROWS), {}
    model = {"output": OUTPUT, "system": "Summarise.", "extra": "", "prompt": "'Summarise: ' || body"}
    model["columns"] = "a, u,"
    nested = "'contact': {'type': 'object', 'properties': {'name': {'type': 'string'}}, 'required': ['name']},"

    def source(change: dict, drop: tuple = (), newer: dict | None = None):
        def apply():
            rows.update(change)
            for a in drop:
                rows.pop(a)
            updated.update(newer or {})
            write_src(project, rows, updated)

        return apply

    def config(**change):
        return lambda: model.update(change)

    def current() -> str:
        text = llm_model(model["output"] + model["extra"], prompt=model["prompt"])
        text = text.replace("llm_system='Summarise.'", f"llm_system='{model['system']}'")
        return text.replace("select a, u,", f"select {model['columns']}")

    write_src(project, rows)
    answered(project, emulator, current())
    assert settled_rows(project) == [(6,)]
    changes = [  # (what changes, how, requests it sends, rows selected after it)
        ("a row's body and updated_at", source({3: "row 3 edited"}, newer={3: 2}), 1, 6),
        ("a row removed (count and hash)", source({}, drop=(4,)), 0, 5),
        ("a row added", source({7: "row 7"}), 1, 6),
        ("the system prompt (the fingerprint)", config(system="Summarise briefly."), 6, 6),
        ("the prompt edited in the SQL", config(prompt="'Summarise this: ' || body"), 6, 6),
        # #31: an added output field is asked of every row, never skipped
        (
            "an added nested output field",
            config(output=OUTPUT.replace("'summary': 'text',", f"'summary': 'text', {nested}")),
            6,
            6,
        ),
        (
            "a removed output field: rows keep their wider answers",
            config(output=f"llm_output = {{'summary': 'text', {nested}}},"),
            0,
            6,
        ),
        ("a selected column added (on_schema_change)", config(columns="a, u, body,"), 0, 6),
        (
            "a variant added: its pass asks every row",
            config(extra="llm_variants={'mini': {'llm_system': 'In five words.'}},"),
            6,
            6,
        ),
    ]
    for name, apply, sent, selected in changes:
        apply()
        asked_before = asked(emulator)
        project.write("models/m.sql", current())
        runs_normally(project, loads)
        emulator.complete_all()
        assert asked(emulator) - asked_before == sent, name
        project.dbt("run", "-s", "m")  # harvest and merge what was sent
        assert settled_rows(project) == [(selected,)], name
        assert {s for (s,) in project.query("select distinct llm_status from main.m")} == {"succeeded"}, name
        n = asked(emulator)
        project.dbt("run", "-s", "m")
        assert asked(emulator) == n, name
        last_run = log_text(project).rsplit("START sql llm_batch model main.m", 1)[1]
        assert f"main.m: nothing new: {selected} row(s) unchanged since" in last_run, name
    assert project.query("select count(*) from main.m where body like 'row %' and contact.name is not null") == [(12,)]


def test_any_variant_s_config_change_re_plans(project, emulator, loads):
    variants = "llm_variants={'mini': {'llm_system': 'Summarise in five words.'}}, llm_variant_sample={'mini': 0.5},"
    write_src(project, ROWS)
    answered(project, emulator, llm_model(OUTPUT + variants))
    assert settled_rows(project) == [(6,)]
    assert_skips(project, emulator, loads)
    before = asked(emulator)
    project.write("models/m.sql", llm_model(OUTPUT + variants.replace("five", "six")))
    runs_normally(project, loads)
    emulator.complete_all()
    sampled = asked(emulator) - before
    assert 0 < sampled < 6, "the variant's sampled rows, and only those, are asked again"


def test_urgent_rows_answered_in_the_run_record_the_signature_at_once(project, emulator, loads):
    """Every row urgent (realtime, answered within the run): the first run leaves the model complete."""
    write_src(project, ROWS)
    project.write("models/m.sql", llm_model("llm_realtime_when='a > 0',"))
    project.dbt("run", "-s", "m")
    assert settled_rows(project) == [(6,)]
    assert_skips(project, emulator, loads)


def test_rows_waiting_on_another_model_s_shared_request_are_not_complete(project, emulator, loads):
    """llm_dedup = 'ledger': `n` asks what `m` has in flight; its rows wait on m's batch, so n records
    no signature until m's batch is harvested and n merges it."""
    write_src(project, ROWS)
    project.write("models/m.sql", llm_model("llm_dedup='ledger',"))
    project.dbt("run", "-s", "m")
    project.write("models/n.sql", llm_model("llm_dedup='ledger',"))
    project.dbt("run", "-s", "n")
    assert asked(emulator) == 0 and len(emulator.batches()) == 1, "n sent nothing of its own"
    assert settled_rows(project, "main.n") == []
    emulator.complete_all()
    project.dbt("run", "-s", "n")  # n harvests m's batch (shared.harvest_shared) and merges
    assert settled_rows(project, "main.n") == [(6,)]
    assert_skips(project, emulator, loads, "n")
    assert asked(emulator) == 6


def test_full_refresh_and_a_dropped_table_do_not_skip(project, emulator, loads):
    write_src(project, ROWS)
    answered(project, emulator, llm_model())
    assert_skips(project, emulator, loads)
    n_loads = len(loads)
    project.dbt("run", "-s", "m", "--full-refresh")
    assert len(loads) == n_loads + 1
    project.query("drop table main.m")
    runs_normally(project, loads)
    assert project.query("select count(*) from main.m where llm_status = 'succeeded'") == [(6,)]
    assert asked(emulator) == 6


def test_an_incremental_model_skips_once_its_filtered_selection_is_settled(project, emulator, loads):
    """`dbt_llm_batch.is_incremental()` changes the compiled SQL: the first incremental run plans, the
    next skips; a new row's run plans again."""
    write_src(project, ROWS)
    incremental = llm_model(
        where="{% if dbt_llm_batch.is_incremental() %} where u >= (select max(u) from {{ this }}) {% endif %}"
    )
    # The second (harvesting) run is the first incremental one: the table is empty then, so its filter
    # selects no row (and it records that); the third selects the six rows the table now holds.
    answered(project, emulator, incremental)
    assert settled_rows(project) == [(0,)]
    runs_normally(project, loads)
    assert "where u >= (select max(u)" in loads[-1]
    assert settled_rows(project) == [(6,)]
    assert_skips(project, emulator, loads)
    write_src(project, {**ROWS, 7: "row 7"}, updated={7: 2})
    runs_normally(project, loads)
    emulator.complete_all()
    project.dbt("run", "-s", "m")
    assert project.query("select count(*) from main.m where llm_status = 'succeeded'") == [(7,)]
    assert asked(emulator) == 7


def test_a_requeue_makes_the_next_run_plan_again(project, emulator, loads):
    write_src(project, ROWS)
    answered(project, emulator, llm_model())
    assert settled_rows(project) == [(6,)]
    project.release_database()
    from dbt_llm_batch.ops.operator import requeue_model

    with duckdb.connect(str(project.db_path)) as con:
        requeue_model(con, "main", "main.m")
    assert settled_rows(project) == []
    runs_normally(project, loads)


def test_a_v27_ledger_with_a_batch_in_flight_migrates_then_harvests_before_recording(project, emulator, loads):
    """The ledger the previous release (schema version 27) left with a batch in flight: migration 28
    was its only table change (29 changed the views only, recreated on reaching it), so undoing it (its
    table and the version rows since) gives that ledger."""
    write_src(project, ROWS)
    project.write("models/m.sql", llm_model().replace("llm_updated_at='u',", ""))
    project.dbt("run", "-s", "m")
    project.release_database()
    with duckdb.connect(str(project.db_path)) as con:
        con.execute("drop table main.llm_batch_settled")
        con.execute("delete from main.llm_batch_meta where schema_version >= 28")
        assert con.execute("select max(schema_version) from main.llm_batch_meta").fetchall() == [(27,)]
    project.write("models/m.sql", llm_model())
    project.dbt("run", "-s", "m")  # migrated; the batch is still in flight: nothing recorded
    assert project.query("select max(schema_version) from main.llm_batch_meta") == [(SCHEMA_VERSION,)]
    assert settled_rows(project) == []
    emulator.complete_all()
    project.dbt("run", "-s", "m")  # harvested and merged: only now complete
    assert project.query("select count(*) from main.m where llm_status = 'succeeded'") == [(6,)]
    assert settled_rows(project) == [(6,)]
    assert_skips(project, emulator, loads)
    assert asked(emulator) == 6


def test_on_a_python_model_it_is_an_error_saying_sql_only(project, emulator):
    write_src(project, ROWS)
    project.write(
        "models/p.py",
        "def model(dbt, session):\n"
        "    dbt.config(materialized='llm_batch', unique_key='a', llm_model='gpt-4o-mini', llm_updated_at='u')\n"
        "    return dbt.ref('src').project('a, u, body as prompt')\n",
    )
    result = project.dbt("run", "-s", "p", expect_ok=False)
    assert "llm_updated_at is for SQL models only" in failure_messages(result)
    assert calls(emulator) == 0


def test_a_column_the_model_does_not_select_is_a_config_error(project, emulator):
    write_src(project, ROWS)
    project.write("models/m.sql", llm_model().replace("select a, u,", "select a,"))
    result = project.dbt("run", "-s", "m", expect_ok=False)
    assert "llm_updated_at = 'u' is not a column the model selects" in failure_messages(result)
    assert calls(emulator) == 0


def test_the_aggregate_reads_only_the_key_and_updated_at_columns():
    """DuckDB projects the prompt's column away: the scan of the source reads a and u, never body."""
    con = duckdb.connect()
    con.execute("create table t as select range as a, repeat('x', 100) as body, 1 as u from range(10)")
    config = parse_config({"unique_key": "a", "llm_model": "gpt-4o-mini", "llm_updated_at": "u"})
    sql = "select a, u, 'Summarise: ' || body as prompt from t"
    plan = "\n".join(r[1] for r in con.execute("explain " + settled.rows_sql(f"(\n{sql}\n)", config)).fetchall())
    scan = plan.split("Seq Scan")[1]
    assert "Projections: a, u " in scan and "body" not in plan, plan
    assert con.execute(settled.rows_sql(f"(\n{sql}\n)", config)).fetchall()[0][0] == 10


def test_a_row_failed_with_attempts_left_is_not_complete(project, emulator, loads):
    """An urgent row whose realtime answer was unusable (off its schema: an attempt used, two left) is
    due for a retry: nothing is in flight or deferred, yet no signature; the next run asks it again and
    records."""
    write_src(project, ROWS)
    emulator.add_fault(kind="off_schema", code="missing_required", prompt_contains="row 3", times=1)
    project.write("models/m.sql", llm_model(OUTPUT + "llm_realtime_when='a > 0',"))
    project.dbt("run", "-s", "m")
    assert project.query("select status, is_final from main.llm_batch_requests where key = '[\"3\"]'") == [
        ("failed", False)
    ]
    assert settled_rows(project) == []
    runs_normally(project, loads)
    assert project.query("select count(*) from main.m where llm_status = 'succeeded'") == [(6,)]
    assert settled_rows(project) == [(6,)]
    assert_skips(project, emulator, loads)


def test_a_run_that_changed_the_table_deletes_the_signature_before_anything(project, emulator, loads):
    """The signature a complete run recorded must not outlive a run that changes the model: here a run
    deletes row 4 (llm_on_unselected = 'delete') and sends an edited row 3; `poll` harvests that batch
    outside any run. With the source back as it was, the selection is the recorded one again, yet the
    table differs: the run must plan (row 4 back, row 3's first answer), not skip."""
    from dbt_llm_batch.ops.cli import main as cli

    model = llm_model("llm_on_unselected='delete',")
    write_src(project, ROWS)
    answered(project, emulator, model)
    original = table(project)
    assert settled_rows(project) == [(6,)]
    write_src(project, {**{a: b for a, b in ROWS.items() if a != 4}, 3: "row 3 edited"}, updated={3: 2})
    project.dbt("run", "-s", "m")
    assert settled_rows(project) == []
    emulator.complete_all()
    project.release_database()
    assert cli(["poll", "--database", str(project.db_path)]) == 0
    write_src(project, ROWS)
    runs_normally(project, loads)
    assert table(project) == original
    assert settled_rows(project) == [(6,)]


def test_a_broken_promise_is_skipped_until_a_full_refresh_and_the_run_after_it(project, emulator, loads):
    """As docs/large-models.md says: a body changed without a new updated_at is not asked (the run
    skips); a --full-refresh rebuilds from the ledger, sends nothing and records no signature (the
    changed row has no answer for its prompt); the run after it asks that row alone."""
    write_src(project, ROWS)
    answered(project, emulator, llm_model())
    write_src(project, {**ROWS, 3: "row 3 edited"})  # updated_at left as it was: the promise broken
    assert_skips(project, emulator, loads)
    project.dbt("run", "-s", "m", "--full-refresh")
    assert asked(emulator) == 6 and settled_rows(project) == []
    runs_normally(project, loads)
    emulator.complete_all()
    assert asked(emulator) == 7
    project.dbt("run", "-s", "m")
    assert project.query("select prompt from main.m where a = 3") == [("Summarise: row 3 edited",)]
    assert settled_rows(project) == [(6,)]


def test_a_poll_harvests_and_the_run_its_then_names_records_then_the_next_skips(project, emulator, loads, tmp_path):
    """`poll --then` (cron's way with a batch in flight): the poll harvests it, `{models}` names this model;
    the run the then-command starts (here in-process) merges without a provider call and records the
    signature; the run after it skips."""
    write_src(project, ROWS)
    project.write("models/m.sql", llm_model())
    project.dbt("run", "-s", "m")
    emulator.complete_all()
    named = tmp_path / "then.txt"
    assert cli(["poll", "--database", str(project.db_path), "--then", f"printf '%s\\n' {{models}} > {named}"]) == 0
    assert named.read_text() == "m\n"
    assert settled_rows(project) == [], "harvested into the ledger, not yet merged: not complete"
    n_calls = calls(emulator)
    runs_normally(project, loads)  # `dbt run -s m`, as the then-command would
    assert calls(emulator) == n_calls, "the poll harvested it: the run merges from the ledger"
    assert project.query("select count(*) from main.m where llm_status = 'succeeded'") == [(6,)]
    assert settled_rows(project) == [(6,)]
    assert_skips(project, emulator, loads)
