"""on_schema_change for llm_batch models (pipeline/schema_change.py, docs/schema-changes.md): an edited
SELECT or llm_output changes the table in the run that sees it, with no manual full refresh, and every
message names the model. A removed output field asks nothing again (pipeline/wider_answers.py)."""

from __future__ import annotations

import functools
import json

from conftest import failure_messages
from helpers import (
    PRICES,
    TRIAGE_OUTPUT,
    TRIAGE_SYSTEM,
    batch_counts,
    batch_input_lines,
    billed_cost,
    dup_model,
    expected_answer,
    log_text,
    sorted_batches,
    triage_model,
    write_rows,
)

MODEL = "models/triage.sql"
TRIAGE_PROPERTIES = {
    "category": {"type": "string", "enum": TRIAGE_OUTPUT["category"]},
    "summary": {"type": "string"},
    "urgent": {"type": "boolean"},
}


def write_triage_without_dedup(project, output: dict) -> None:
    """The triage model asking `output`, one request per row (llm_dedup = false)."""
    model = triage_model(extra_config="llm_dedup = false,")
    project.write(MODEL, model.replace(json.dumps(TRIAGE_OUTPUT), json.dumps(output)))


def write_dup(project, output: dict) -> None:
    """The dup model (rows sharing requests) on openai asking `output`."""
    project.write("models/dup.sql", dup_model("openai", extra=f"llm_output = {json.dumps(output)},"))


def schema_of(properties: dict) -> dict:
    """The JSON schema a request asks with these fields (in name order, all required)."""
    names = sorted(properties)
    return {
        "type": "object",
        "properties": {n: properties[n] for n in names},
        "required": names,
        "additionalProperties": False,
    }


def model_with(output: dict, extra: str = "", select_extra: str = "") -> str:
    """The triage model with `output` as llm_output; each run waits for its batch (the sandbox ends it)."""
    text = triage_model(extra_config=f"llm_wait_seconds = 60, {extra}").replace(
        f"llm_output = {json.dumps(TRIAGE_OUTPUT)}", f"llm_output = {json.dumps(output)}"
    )
    return text.replace("select ticket_id,", f"select ticket_id, {select_extra}") if select_extra else text


def columns(project) -> list[str]:
    return [
        r[0]
        for r in project.query(
            "select column_name from information_schema.columns where table_name = 'triage' order by column_name"
        )
    ]


def answered(project, emulator):
    project.dbt("seed")
    emulator.auto_advance_seconds = 0.05  # each batch ends while the run waits for it
    project.write(MODEL, model_with(TRIAGE_OUTPUT))
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) filter (where llm_status = 'succeeded') from main.triage") == [(6,)]


def test_an_added_output_field_is_a_new_column_filled_in_the_same_run(project, emulator):
    answered(project, emulator)
    wider = {**TRIAGE_OUTPUT, "language": "text"}
    project.write(MODEL, model_with(wider))
    project.dbt("run", "-s", "triage")  # no --full-refresh: the column is added and asked in this run
    assert "language" in columns(project)
    schema = schema_of({"language": {"type": "string"}})  # only the added field is asked (added_fields.py)
    rows = project.query("select ticket_id, prompt, language, llm_status from main.triage order by 1")
    assert len(rows) == 6
    for _, prompt, language, status in rows:
        assert status == "succeeded"
        assert language == json.loads(expected_answer(TRIAGE_SYSTEM, prompt, schema))["language"]
    assert len(emulator.batches()) == 2, "one batch for the first answers, one for the new field"
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "triage: the columns of" in log and "added: language VARCHAR" in log


def test_append_keeps_a_removed_column_and_sync_drops_it(project, emulator):
    answered(project, emulator)
    narrower = {k: v for k, v in TRIAGE_OUTPUT.items() if k != "summary"}
    project.write(MODEL, model_with(narrower))
    project.dbt("run", "-s", "triage")
    assert "summary" in columns(project), "append_new_columns (the default) keeps a removed column"
    project.write(MODEL, model_with(narrower, "on_schema_change = 'sync_all_columns',"))
    project.dbt("run", "-s", "triage")
    assert "summary" not in columns(project)
    assert project.query("select count(*) filter (where llm_status = 'succeeded') from main.triage") == [(6,)]


def test_fail_and_a_type_change_name_the_model_and_sync_casts_the_type(project, emulator):
    answered(project, emulator)
    project.write(MODEL, model_with(TRIAGE_OUTPUT, "on_schema_change = 'fail',", select_extra="1 as n,"))
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "triage: the columns of" in message and "added: n INTEGER" in message
    assert "dbt run --full-refresh -s triage" in message and "<model>" not in message
    assert "n" not in columns(project) and len(emulator.batches()) == 1, "fail changes and sends nothing"

    project.write(MODEL, model_with(TRIAGE_OUTPUT, select_extra="1 as n,"))
    project.dbt("run", "-s", "triage")  # append_new_columns: n added
    retyped = model_with(TRIAGE_OUTPUT, select_extra="'1' as n,")
    project.write(MODEL, retyped)
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "triage: columns of" in message and "n INTEGER -> VARCHAR" in message
    assert "on_schema_change='sync_all_columns'" in message and "<model>" not in message
    project.write(MODEL, model_with(TRIAGE_OUTPUT, "on_schema_change = 'sync_all_columns',", select_extra="'1' as n,"))
    project.dbt("run", "-s", "triage")
    assert project.query("select distinct n from main.triage") == [("1",)]
    assert len(emulator.batches()) == 1, "a selected column's change asks nothing again"


def test_a_changed_unique_key_rebuilds_the_table_from_the_ledger(project, emulator):
    answered(project, emulator)
    renamed = (
        model_with(TRIAGE_OUTPUT)
        .replace("unique_key = 'ticket_id'", "unique_key = 'id'")
        .replace("select ticket_id, subject,", "select ticket_id as id, subject,")
    )
    project.write(MODEL, renamed)
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*), count(id) from main.triage") == [(6, 6)]
    assert "ticket_id" not in columns(project)
    assert len(emulator.batches()) == 1, "the key's values did not change: nothing is asked again"


def test_a_unique_key_changed_back_to_a_column_the_table_kept_rebuilds_it(project, emulator):
    """unique_key goes to a computed column (`tno`), back to ticket_id (the table keeps `tno`: the
    default on_schema_change, append_new_columns), rows are written under it (a prompt edit: `tno`
    NULL in them), and the key returns to `tno`. The table is rebuilt from the ledger (its NULL key
    values have no key to be merged by): every row keyed, nothing asked again for the key changes.
    It failed every run after with "would have a NULL unique_key" (the model-based test, seed 1011)."""
    answered(project, emulator)
    system = f"llm_system = {json.dumps(TRIAGE_SYSTEM)},"
    by_tno = (
        model_with(TRIAGE_OUTPUT)
        .replace("unique_key = 'ticket_id'", "unique_key = 'tno'")
        .replace("select ticket_id, subject,", "select ticket_id * 7 + 100 as tno, ticket_id, subject,")
    )
    project.write(MODEL, by_tno)
    project.dbt("run", "-s", "triage")
    project.write(MODEL, model_with(TRIAGE_OUTPUT).replace(system, "llm_system = 'Triage it.',"))
    project.dbt("run", "-s", "triage")  # keyed by ticket_id again, every row asked again: tno NULL
    assert "tno" in columns(project)
    assert project.query("select count(*), count(tno) from main.triage") == [(6, 0)]
    project.write(MODEL, by_tno.replace(system, "llm_system = 'Triage it.',"))
    project.dbt("run", "-s", "triage", "--vars", "{llm_batch_dry_run: true}")
    held = "triage: key column(s) tno hold NULL in rows written under another unique_key"
    assert f"{held}: the real run will rebuild" in log_text(project), "the dry run says so"
    project.dbt("run", "-s", "triage")
    assert f"{held}: the table is rebuilt from the ledger in this run" in log_text(project)
    rows = project.query("select ticket_id, tno, llm_status, category from main.triage order by 1")
    assert [r[:3] for r in rows] == [(t, t * 7 + 100, "succeeded") for t in range(1, 7)], rows
    assert len(emulator.batches()) == 2, "asked once per system prompt: nothing again for the key changes"


def test_a_dry_run_build_of_models_that_never_ran_is_green_on_their_empty_tables(project, emulator):
    """`dbt build` with llm_batch_dry_run: each model that never ran gets its empty table, so its dbt
    tests run (and pass) on it instead of failing on a missing table; nothing is sent."""
    result = project.dbt("build", "--select", "+tag:batch", "--vars", "{llm_batch_dry_run: true}")
    tests = [r for r in result.result.results if r.node.resource_type == "test"]
    assert len(tests) == 5 and all(r.status == "pass" for r in tests), [(r.node.name, r.message) for r in tests]
    assert project.query("select count(*) from main.ticket_triage") == [(0,)]
    assert "category" in [r[0] for r in project.query("describe main.ticket_triage")]
    assert emulator.stats()["calls"] == {}
    project.dbt("run", "-s", "ticket_triage")  # a real run afterwards sends and fills the same table
    assert len(emulator.batches()) == 1


def answers(project, *fields: str) -> dict:
    """The table's answer columns `fields` and cost, by ticket."""
    cols = ", ".join(fields)
    return {r[0]: r[1:] for r in project.query(f"select ticket_id, {cols}, llm_cost_usd from main.triage order by 1")}


def test_a_removed_output_field_pays_nothing_and_adding_it_back_pays_nothing(project, emulator):
    """Removing a field keeps every held answer (its request asked a wider schema, which holds the
    fields asked now): nothing is sent, the other columns and costs stay as they were. Adding the
    field back asks nothing either: the first requests asked it."""
    answered(project, emulator)
    before = answers(project, "category", "urgent")
    narrower = {k: v for k, v in TRIAGE_OUTPUT.items() if k != "summary"}
    project.write(MODEL, model_with(narrower, "on_schema_change = 'sync_all_columns',"))
    project.dbt("run", "-s", "triage", "--vars", "{llm_batch_dry_run: true}")
    assert "main.triage: DRY RUN: would submit 0 request(s)" in log_text(project), "the dry run says so too"
    project.dbt("run", "-s", "triage")
    assert len(emulator.batches()) == 1, "a removed field asks no row again"
    assert "summary" not in columns(project)
    assert answers(project, "category", "urgent") == before, "the held answers and their costs are kept"
    project.write(MODEL, model_with(TRIAGE_OUTPUT))
    project.dbt("run", "-s", "triage")
    assert len(emulator.batches()) == 1, "the field added back was asked by the first requests"
    assert project.query("select count(summary) from main.triage") == [(6,)]


def test_a_removed_field_of_an_evaluation_variant_pays_nothing(project, emulator):
    """Each variant's answers are its own: removing a field from the model (both variants ask it)
    sends nothing for either variant."""
    variants = "llm_variants = {'terse': {'llm_system': 'Answer tersely.'}},"
    project.dbt("seed")
    emulator.auto_advance_seconds = 0.05
    project.write(MODEL, model_with(TRIAGE_OUTPUT, variants))
    project.dbt("run", "-s", "triage")
    assert sum(len(batch_input_lines(emulator, b)) for b in emulator.batches()) == 12
    narrower = {k: v for k, v in TRIAGE_OUTPUT.items() if k != "urgent"}
    project.write(MODEL, model_with(narrower, variants))
    project.dbt("run", "-s", "triage")
    assert sum(len(batch_input_lines(emulator, b)) for b in emulator.batches()) == 12, "nothing asked again"
    assert project.query(
        "select llm_variant, count(*) filter (where llm_status = 'succeeded') from main.triage group by 1 order by 1"
    ) == [("default", 6), ("terse", 6)]


def test_a_field_removed_while_its_batch_is_in_flight_is_answered_by_that_batch(project, emulator):
    """The first run leaves its batch in flight (no llm_wait_seconds); the run after a field's removal
    sends nothing (the batch in flight asks every field asked now) and the run after the batch ends
    merges its answers. One request per row (llm_dedup = false): each row's own answer moves."""
    project.dbt("seed")

    write = functools.partial(write_triage_without_dedup, project)

    write(TRIAGE_OUTPUT)
    project.dbt("run", "-s", "triage")
    write({k: v for k, v in TRIAGE_OUTPUT.items() if k != "urgent"})
    project.dbt("run", "-s", "triage")
    assert len(emulator.batches()) == 1, "the batch in flight answers the narrower llm_output"
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert len(emulator.batches()) == 1
    rows = project.query("select prompt, category, summary, llm_status, llm_cost_usd from main.triage")
    assert len(rows) == 6
    for prompt, category, summary, status, cost in rows:
        answer = json.loads(expected_answer(TRIAGE_SYSTEM, prompt, schema_of(TRIAGE_PROPERTIES)))
        assert (category, summary, status) == (answer["category"], answer["summary"], "succeeded")
        assert cost > 0, "each row costs what its request cost"


def test_a_field_whose_enum_changed_is_asked_alone(project, emulator):
    """A field whose own schema changed is another field: the answers held were constrained by the
    old enum, so that field is asked again, alone (added_fields.py); the other fields are kept."""
    answered(project, emulator)
    before = answers(project, "summary", "urgent")
    labels = [*TRIAGE_OUTPUT["category"], "security"]
    project.write(MODEL, model_with({**TRIAGE_OUTPUT, "category": labels}))
    project.dbt("run", "-s", "triage")
    last = sorted_batches(emulator)[-1]
    assert len(emulator.batches()) == 2
    schema = schema_of({"category": {"type": "string", "enum": labels}})
    assert asked_schemas(emulator, last) == [schema] * 6, "only the changed field is asked"
    for prompt, category in project.query("select prompt, category from main.triage"):
        assert category == json.loads(expected_answer(TRIAGE_SYSTEM, prompt, schema))["category"]
    assert {k: v[:2] for k, v in answers(project, "summary", "urgent").items()} == {k: v[:2] for k, v in before.items()}


def test_rows_sharing_a_request_keep_their_shares_of_its_cost_when_a_field_is_removed(project, emulator):
    """Rows asking the same request (llm_dedup, the default) share its cost; after a field's removal
    nothing is sent, and each row keeps its answer and its share (the shares still add up to what the
    sandbox billed)."""
    project.write("seeds/llm_prices.csv", PRICES)
    write_rows(project, {1: 1, 2: 1, 3: 2})  # rows 1 and 2 ask the same question

    write = functools.partial(write_dup, project)

    def shown() -> dict:
        return {r[0]: r[1:] for r in project.query("select id, topic, llm_status, llm_cost_usd from main.dup")}

    write({"topic": "text", "severe": "boolean"})
    project.dbt("run", "-s", "dup")
    emulator.complete_all()
    project.dbt("run", "-s", "dup")
    before = shown()
    assert sum(batch_counts(emulator)) == 2 and {s for _, s, _ in before.values()} == {"succeeded"}
    assert sum(c for _, _, c in before.values()) == billed_cost(emulator, "openai")
    write({"topic": "text"})
    project.dbt("run", "-s", "dup")
    assert sum(batch_counts(emulator)) == 2, "nothing asked again"
    assert shown() == before


# -- Added fields: only they are asked (pipeline/added_fields.py) ---------------------------------


def asked_schemas(emulator, batch: dict) -> list[dict]:
    """The output schema of each request line of `batch`."""
    return [line["body"]["response_format"]["json_schema"]["schema"] for line in batch_input_lines(emulator, batch)]


def request_costs(project) -> dict:
    """Each ledger request's cost, by custom_id."""
    return dict(project.query("select custom_id, cost_usd from main.llm_batch_requests where cost_usd is not null"))


def test_an_added_field_asks_only_for_it_and_each_row_pays_both_shares(project, emulator):
    """Each answered row is asked only the added field (one request per row, its schema that field
    alone), the column is filled in the run, the other columns stay as they were, and each row's
    cost is its first request's plus its new one's (the table's costs add up to the ledger's)."""
    answered(project, emulator)
    before = answers(project, "category", "summary", "urgent")
    project.write(MODEL, model_with({**TRIAGE_OUTPUT, "language": "text"}))
    project.dbt("run", "-s", "triage", "--vars", "{llm_batch_dry_run: true}")
    assert "main.triage: DRY RUN: would submit 6 request(s)" in log_text(project), "the dry run says so too"
    project.dbt("run", "-s", "triage")
    batches = sorted_batches(emulator)
    assert len(batches) == 2
    delta = schema_of({"language": {"type": "string"}})
    assert asked_schemas(emulator, batches[1]) == [delta] * 6, "only the added field is asked"
    after = answers(project, "category", "summary", "urgent", "language")
    rows = dict(project.query("select ticket_id, prompt from main.triage"))
    for ticket, (category, summary, urgent, language, cost) in after.items():
        assert (category, summary, urgent) == before[ticket][:3], "the fields held are not asked again"
        assert language == json.loads(expected_answer(TRIAGE_SYSTEM, rows[ticket], delta))["language"]
        assert cost > before[ticket][3], "the row pays its first request and its share of the new one"
    assert sum(c for *_, c in after.values()) == sum(request_costs(project).values())
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert project.query("select sum(rows_answered), sum(cost_usd) from main.llm_batch_costs") == [
        (6, sum(request_costs(project).values()))
    ], "six rows answered now, both requests' costs counted"


ROWS = "select sum(rows_succeeded), sum(rows_answered), sum(requests_succeeded) from main.llm_batch_costs"
PROGRESS = "select keys_succeeded, rows_mapped from main.llm_batch_progress"


def test_a_row_answered_by_two_requests_is_counted_once_in_both_views(project, emulator):
    """A combined answer (its first request's fields and the added field's request: two parts) is one
    row: llm_batch_costs.rows_succeeded counts it once, through its current answer, as
    llm_batch_progress.keys_succeeded does; progress maps it once. Its two requests are two requests."""
    answered(project, emulator)
    assert project.query(ROWS) == [(6, 6, 6)] and project.query(PROGRESS) == [(6, 6)]
    project.write(MODEL, model_with({**TRIAGE_OUTPUT, "language": "text"}))
    project.dbt("run", "-s", "triage")
    assert len(sorted_batches(emulator)) == 2 and project.query("select count(language) from main.triage") == [(6,)]
    assert project.query(ROWS) == [(6, 6, 12)], "six rows, each answered by two requests"
    assert project.query(PROGRESS) == [(6, 6)]


def test_a_row_whose_added_field_is_in_flight_is_counted_once(project, emulator):
    """While the added field's request is in flight the row shows its first answer: one row succeeded,
    mapped once (not once to its first request and once to the one in flight); and once when it lands."""
    project.dbt("seed")
    write_triage_without_dedup(project, TRIAGE_OUTPUT)
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    write_triage_without_dedup(project, {**TRIAGE_OUTPUT, "language": "text"})
    project.dbt("run", "-s", "triage")  # only the added field is asked; its batch stays in flight
    assert len(emulator.batches()) == 2 and project.query("select count(language) from main.triage") == [(0,)]
    assert project.query(ROWS) == [(6, 6, 6)] and project.query(PROGRESS) == [(6, 6)]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(language) from main.triage") == [(6,)]
    assert project.query(ROWS) == [(6, 6, 12)] and project.query(PROGRESS) == [(6, 6)]


def test_a_field_added_while_the_batch_is_in_flight_is_asked_after_it_merges(project, emulator):
    """The first run leaves its batch in flight; the run after a field is added asks nothing (the
    batch answers the other fields); the run after the batch ends merges it and asks only the added
    field; the run after that fills the column. One request per row (llm_dedup = false)."""
    project.dbt("seed")

    write = functools.partial(write_triage_without_dedup, project)

    write(TRIAGE_OUTPUT)
    project.dbt("run", "-s", "triage")
    write({**TRIAGE_OUTPUT, "language": "text"})
    project.dbt("run", "-s", "triage")
    assert len(emulator.batches()) == 1, "the rows wait for the batch in flight"
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(category), count(language) from main.triage") == [(6, 0)], "merged first"
    batches = sorted_batches(emulator)
    delta = schema_of({"language": {"type": "string"}})
    assert len(batches) == 2 and asked_schemas(emulator, batches[1]) == [delta] * 6, "then only the added field"
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert len(emulator.batches()) == 2
    for prompt, category, language, status in project.query(
        "select prompt, category, language, llm_status from main.triage"
    ):
        held = json.loads(expected_answer(TRIAGE_SYSTEM, prompt, schema_of(TRIAGE_PROPERTIES)))
        assert (category, status) == (held["category"], "succeeded")
        assert language == json.loads(expected_answer(TRIAGE_SYSTEM, prompt, delta))["language"]


def test_each_variant_is_asked_only_its_added_field(project, emulator):
    """Each variant's answers are its own: adding a field asks each variant's rows for it alone."""
    variants = "llm_variants = {'terse': {'llm_system': 'Answer tersely.'}},"
    project.dbt("seed")
    emulator.auto_advance_seconds = 0.05
    project.write(MODEL, model_with(TRIAGE_OUTPUT, variants))
    project.dbt("run", "-s", "triage")
    before = {r[:2]: r[2:] for r in project.query("select ticket_id, llm_variant, category, summary from main.triage")}
    project.write(MODEL, model_with({**TRIAGE_OUTPUT, "language": "text"}, variants))
    project.dbt("run", "-s", "triage")
    delta = schema_of({"language": {"type": "string"}})
    later = [s for b in sorted_batches(emulator)[1:] for s in asked_schemas(emulator, b)]
    assert later == [delta] * 12, "6 rows of each variant, asked the added field alone"
    rows = project.query("select ticket_id, llm_variant, category, summary, language, prompt from main.triage")
    assert {r[:2]: r[2:4] for r in rows} == before, "the fields held are kept, per variant"
    systems = {"default": TRIAGE_SYSTEM, "terse": "Answer tersely."}
    for _, variant, _, _, language, prompt in rows:
        assert language == json.loads(expected_answer(systems[variant], prompt, delta))["language"]


def test_urgent_rows_are_asked_their_added_field_in_realtime(project, emulator):
    """Rows on the realtime path (llm_realtime_when) are asked only the added field, in realtime, and
    the column is filled in that run: the realtime job records the field's schema alone."""
    urgent = "llm_realtime_when = 'true',"
    project.dbt("seed")
    project.write(MODEL, model_with(TRIAGE_OUTPUT, urgent))
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["realtime_requests"]["openai"] == 6 and emulator.batches() == []
    project.write(MODEL, model_with({**TRIAGE_OUTPUT, "language": "text"}, urgent))
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["realtime_requests"]["openai"] == 12 and emulator.batches() == []
    delta = schema_of({"language": {"type": "string"}})
    jobs = project.query("select output_schema from main.llm_batch_jobs order by created_at")
    assert [json.loads(s) for (s,) in jobs][1:] == [delta]
    for prompt, category, language, status in project.query(
        "select prompt, category, language, llm_status from main.triage"
    ):
        held = json.loads(expected_answer(TRIAGE_SYSTEM, prompt, schema_of(TRIAGE_PROPERTIES)))
        assert (category, status) == (held["category"], "succeeded")
        assert language == json.loads(expected_answer(TRIAGE_SYSTEM, prompt, delta))["language"]


CONTACT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "channels": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "channels"],
    "additionalProperties": False,
}


def test_an_added_nested_field_is_asked_alone_as_one_unit(project, emulator):
    """A nested field is a top-level unit: adding it asks it alone, and fills its STRUCT column."""
    answered(project, emulator)
    project.write(MODEL, model_with({**TRIAGE_OUTPUT, "contact": CONTACT}))
    project.dbt("run", "-s", "triage")
    batches = sorted_batches(emulator)
    assert len(batches) == 2
    (asked,) = {json.dumps(s, sort_keys=True) for s in asked_schemas(emulator, batches[1])}
    assert list(json.loads(asked)["properties"]) == ["contact"]
    for prompt, name, channels, category in project.query(
        "select prompt, contact.name, contact.channels, category from main.triage"
    ):
        expected = json.loads(expected_answer(TRIAGE_SYSTEM, prompt, json.loads(asked)))["contact"]
        assert (name, channels) == (expected["name"], expected["channels"])
        assert category is not None


def test_rows_sharing_a_request_in_flight_are_asked_the_added_field_once_and_share_both_costs(project, emulator):
    """Rows asking the same request (llm_dedup) whose batch is in flight when a field is added: the
    batch merges first, then the added field is asked once for them (one request per distinct
    prompt), and each row's cost is its share of both requests (the shares add up to the bill)."""
    project.write("seeds/llm_prices.csv", PRICES)
    write_rows(project, {1: 1, 2: 1, 3: 2})  # rows 1 and 2 ask the same question

    write = functools.partial(write_dup, project)

    write({"topic": "text", "severe": "boolean"})
    project.dbt("run", "-s", "dup")
    write({"topic": "text", "severe": "boolean", "language": "text"})
    project.dbt("run", "-s", "dup")
    assert batch_counts(emulator) == [2], "the rows wait for their batch in flight"
    emulator.complete_all()
    project.dbt("run", "-s", "dup")
    assert batch_counts(emulator) == [2, 2], "then the added field, once per distinct prompt"
    delta = schema_of({"language": {"type": "string"}})
    assert asked_schemas(emulator, sorted_batches(emulator)[1]) == [delta] * 2
    emulator.complete_all()
    project.dbt("run", "-s", "dup")
    rows = project.query("select id, topic, language, llm_status, llm_cost_usd from main.dup order by id")
    assert [r[3] for r in rows] == ["succeeded"] * 3 and all(r[1] and r[2] for r in rows)
    assert rows[0][1:3] == rows[1][1:3], "the rows sharing both requests show the same answer"
    assert sum(r[4] for r in rows) == billed_cost(emulator, "openai")
    assert rows[2][4] > rows[0][4], "row 3 pays its two requests alone; rows 1 and 2 split theirs"


def test_a_failed_added_field_request_retries_only_that_field(project, emulator):
    """A request asking the added field that fails (a server error on its line) is tried again with
    the added field alone; the row's held fields are never asked again."""
    answered(project, emulator)
    (subject,) = project.query("select subject from main.triage order by ticket_id limit 1")[0]
    emulator.add_fault(prompt_contains=subject, status_code=500, message="Upstream failure.", times=1)
    project.write(MODEL, model_with({**TRIAGE_OUTPUT, "language": "text"}))
    project.dbt("run", "-s", "triage")  # waits for its batch, then sends the failed line again
    delta = schema_of({"language": {"type": "string"}})
    later = sorted_batches(emulator)[1:]
    assert [len(asked_schemas(emulator, b)) for b in later] == [6, 1], "the failed line alone, again"
    assert all(s == delta for b in later for s in asked_schemas(emulator, b))
    assert project.query("select count(language) from main.triage where llm_status = 'succeeded'") == [(6,)]
