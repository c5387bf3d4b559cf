"""A user's edits around an added output field (pipeline/added_fields.py, docs/schema-changes.md),
through real dbt against the sandbox: what the sandbox was asked (request lines and each line's
schema) and what the table holds. Written by tester3 to probe the added-field work; a failing test
here is a finding, not an expected failure."""

from __future__ import annotations

import json

import pytest
from conftest import failure_messages
from helpers import (
    TRIAGE_OUTPUT,
    TRIAGE_SYSTEM,
    batch_input_lines,
    expected_answer,
    kill_then_run_on,
    sorted_batches,
    triage_model,
)

MODEL = "models/triage.sql"
PROPS = {
    "category": {"type": "string", "enum": TRIAGE_OUTPUT["category"]},
    "summary": {"type": "string"},
    "urgent": {"type": "boolean"},
    "language": {"type": "string"},
    "priority_score": {"type": "integer"},
}
WIDER = {**TRIAGE_OUTPUT, "language": "text"}


def schema_of(*names: str) -> dict:
    names_sorted = sorted(names)
    return {
        "type": "object",
        "properties": {n: PROPS[n] for n in names_sorted},
        "required": names_sorted,
        "additionalProperties": False,
    }


def model(output: dict, extra: str = "", wait: bool = True, system: str = TRIAGE_SYSTEM) -> str:
    text = triage_model(system=system, extra_config=("llm_wait_seconds = 60, " if wait else "") + extra)
    return text.replace(f"llm_output = {json.dumps(TRIAGE_OUTPUT)}", f"llm_output = {json.dumps(output)}")


def asked(emulator) -> list[list[dict]]:
    """Per batch (oldest first), each request line's output schema."""
    return [
        [line["body"]["response_format"]["json_schema"]["schema"] for line in batch_input_lines(emulator, b)]
        for b in sorted_batches(emulator)
    ]


def answered(project, emulator, output: dict = TRIAGE_OUTPUT, extra: str = "") -> None:
    project.dbt("seed")
    emulator.auto_advance_seconds = 0.05  # each batch ends while the run waits for it
    project.write(MODEL, model(output, extra))
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) filter (where llm_status = 'succeeded') from main.triage") == [(6,)]


def answered_no_wait(project, emulator) -> None:
    project.dbt("seed")
    project.write(MODEL, model(TRIAGE_OUTPUT, wait=False))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query("select count(*) filter (where llm_status = 'succeeded') from main.triage") == [(6,)]


def expected(prompt: str, schema: dict, system: str = TRIAGE_SYSTEM) -> dict:
    return json.loads(expected_answer(system, prompt, schema))


def table(project, *cols: str) -> dict:
    return {r[0]: r[1:] for r in project.query(f"select ticket_id, {', '.join(cols)} from main.triage order by 1")}


def test_an_added_field_reverted_while_its_request_is_in_flight_then_added_again(project, emulator):
    """Revert while the delta batch is in flight: nothing is sent, rows keep their answers. Adding the
    field again after the delta ended asks nothing more: its answers are held."""
    answered_no_wait(project, emulator)
    before = table(project, "category", "summary", "urgent", "llm_cost_usd")
    project.write(MODEL, model(WIDER, wait=False))
    project.dbt("run", "-s", "triage")
    assert len(asked(emulator)) == 2
    project.write(MODEL, model(TRIAGE_OUTPUT, wait=False))
    project.dbt("run", "-s", "triage")
    assert len(asked(emulator)) == 2, "the reverted model asks nothing"
    assert table(project, "category", "summary", "urgent", "llm_cost_usd") == before
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert table(project, "category", "summary", "urgent", "llm_cost_usd") == before, "the delta is not this model's"
    project.write(MODEL, model(WIDER, wait=False))
    project.dbt("run", "-s", "triage")
    assert len(asked(emulator)) == 2, "the field added again was answered by the delta that ended"
    assert project.query("select count(language) from main.triage") == [(6,)]


def test_an_old_field_removed_while_the_delta_is_in_flight_asks_nothing_more(project, emulator):
    answered_no_wait(project, emulator)
    project.write(MODEL, model(WIDER, wait=False))
    project.dbt("run", "-s", "triage")
    narrower = {k: v for k, v in WIDER.items() if k != "urgent"}
    project.write(MODEL, model(narrower, wait=False))
    project.dbt("run", "-s", "triage")
    assert len(asked(emulator)) == 2, "the held answers and the delta in flight cover every field"
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert len(asked(emulator)) == 2
    delta = schema_of("language")
    for prompt, category, language, status in project.query(
        "select prompt, category, language, llm_status from main.triage"
    ):
        assert status == "succeeded" and language == expected(prompt, delta)["language"]
        assert category == expected(prompt, schema_of("category", "summary", "urgent"))["category"]


def test_on_schema_change_fail_with_an_added_field_sends_nothing_and_names_the_model(project, emulator):
    answered(project, emulator)
    project.write(MODEL, model(WIDER, "on_schema_change = 'fail',"))
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "triage: the columns of" in message and "added: language VARCHAR" in message
    assert len(asked(emulator)) == 1 and emulator.stats()["realtime_requests"].get("openai", 0) == 0


def test_a_budget_below_the_deltas_estimate_refuses_and_sends_nothing(project, emulator):
    answered(project, emulator)
    project.write(MODEL, model(WIDER, "llm_max_cost_usd = 0.0000001,"))
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "triage" in message and "llm_max_cost_usd" in message
    assert len(asked(emulator)) == 1


CONTACT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "channels": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "channels"],
    "additionalProperties": False,
}
CONTACT_WITH_EMAIL = {
    "type": "object",
    "properties": {**CONTACT["properties"], "email": {"type": "string"}},
    "required": ["name", "channels", "email"],
    "additionalProperties": False,
}


def test_a_key_added_inside_a_struct_field_asks_that_field_alone(project, emulator):
    """A nested key added inside `contact` changes `contact`'s own schema: `contact` is asked again
    alone (a field is a top-level unit); the other fields are kept and not paid again."""
    answered(project, emulator, {**TRIAGE_OUTPUT, "contact": CONTACT})
    before = table(project, "category", "summary", "urgent", "llm_cost_usd")
    project.write(
        MODEL, model({**TRIAGE_OUTPUT, "contact": CONTACT_WITH_EMAIL}, "on_schema_change = 'sync_all_columns',")
    )
    project.dbt("run", "-s", "triage")
    later = asked(emulator)[1:]
    assert len(later) == 1 and len(later[0]) == 6
    assert {tuple(s["properties"]) for s in later[0]} == {("contact",)}
    after = table(project, "category", "summary", "urgent", "llm_cost_usd", "contact.email")
    for key, (category, summary, urgent, cost, email) in after.items():
        assert (category, summary, urgent) == before[key][:3]
        assert email is not None and cost > before[key][3]


@pytest.mark.parametrize("point", ["after_create"])  # between the delta batch's create and its ledger record
def test_a_run_killed_in_the_deltas_run_bills_each_delta_once(project, emulator, tmp_path, point):
    """SIGKILL at a crash point of the run that asks the added field; the later runs finish it."""
    answered(project, emulator)
    project.write(MODEL, model(WIDER))
    kill_then_run_on(project, emulator, tmp_path / "crash-marker", point)
    later = asked(emulator)[1:]
    assert sum(len(b) for b in later) == 6, "each row's delta sent once"
    assert all(s == schema_of("language") for b in later for s in b)
    assert project.query("select count(language), count(category) from main.triage where llm_status = 'succeeded'") == [
        (6, 6)
    ]


def test_a_variant_whose_prompt_changes_with_the_added_field_asks_it_everything(project, emulator):
    """Field added and the terse variant's llm_system edited in one run: the terse rows are asked every
    field (their prompt changed), the default rows the added field alone."""
    project.dbt("seed")
    emulator.auto_advance_seconds = 0.05
    project.write(MODEL, model(TRIAGE_OUTPUT, "llm_variants = {'terse': {'llm_system': 'Answer tersely.'}},"))
    project.dbt("run", "-s", "triage")
    project.write(MODEL, model(WIDER, "llm_variants = {'terse': {'llm_system': 'Answer very tersely.'}},"))
    project.dbt("run", "-s", "triage")
    later = sorted(tuple(sorted(s["properties"])) for b in asked(emulator)[1:] for s in b)
    assert later == sorted([("category", "language", "summary", "urgent")] * 6 + [("language",)] * 6), later
    for variant, prompt, category, language in project.query(
        "select llm_variant, prompt, category, language from main.triage"
    ):
        if variant == "terse":
            answer = expected(prompt, schema_of("category", "summary", "urgent", "language"), "Answer very tersely.")
            assert (category, language) == (answer["category"], answer["language"])
        else:
            assert language == expected(prompt, schema_of("language"))["language"]


def test_a_field_added_while_the_selection_is_narrowed_asks_the_rest_later_only_it(project, emulator):
    """Add a field while the model selects 3 of 6 tickets: 3 deltas; widen the selection again: the
    other 3 rows are asked the added field alone too."""
    answered(project, emulator)
    narrowed = model(WIDER).replace(
        "from {{ ref('support_tickets') }}", "from {{ ref('support_tickets') }} where ticket_id <= 3"
    )
    assert narrowed != model(WIDER)
    project.write(MODEL, narrowed)
    project.dbt("run", "-s", "triage")
    assert [len(b) for b in asked(emulator)] == [6, 3]
    assert project.query("select count(language), count(category) from main.triage") == [(3, 6)]
    project.write(MODEL, model(WIDER))
    project.dbt("run", "-s", "triage")
    later = [tuple(sorted(s["properties"])) for b in asked(emulator)[1:] for s in b]
    assert later == [("language",)] * 6, later
    assert project.query("select count(language), count(category) from main.triage") == [(6, 6)]


def test_a_second_added_field_asks_only_it_not_the_first_added_again(project, emulator):
    """language added (answered), then priority_score added: each row holds every other field (its
    first answer and its language answer), so only priority_score is asked; language is not paid twice."""
    answered(project, emulator)
    project.write(MODEL, model(WIDER))
    project.dbt("run", "-s", "triage")
    held = table(project, "category", "language")
    project.write(MODEL, model({**WIDER, "priority_score": "integer"}))
    project.dbt("run", "-s", "triage")
    third = [sorted(s["properties"]) for s in asked(emulator)[2]]
    assert third == [["priority_score"]] * 6, third
    assert {k: v[:2] for k, v in table(project, "category", "language", "priority_score").items()} == held


def test_an_old_fields_enum_changed_after_a_delta_asks_that_field_alone(project, emulator):
    """language added (answered), then category's enum gains a label: only category is asked; the
    language answer the row holds is not asked again."""
    answered(project, emulator)
    project.write(MODEL, model(WIDER))
    project.dbt("run", "-s", "triage")
    labels = [*TRIAGE_OUTPUT["category"], "security"]
    project.write(MODEL, model({**WIDER, "category": labels}))
    project.dbt("run", "-s", "triage")
    third = [sorted(s["properties"]) for s in asked(emulator)[2]]
    assert third == [["category"]] * 6, third


def test_a_full_refresh_while_the_delta_is_in_flight_keeps_the_held_answers(project, emulator):
    """--full-refresh with the delta batch in flight: the table is rebuilt with the held answers
    (language NULL, rows succeeded), nothing is sent; after the batch ends a run fills language."""
    answered_no_wait(project, emulator)
    before = table(project, "category", "summary", "urgent")
    project.write(MODEL, model(WIDER, wait=False))
    project.dbt("run", "-s", "triage")
    project.dbt("run", "-s", "triage", "--full-refresh")
    assert len(asked(emulator)) == 2
    assert table(project, "category", "summary", "urgent") == before
    assert project.query(
        "select count(*) filter (where llm_status = 'succeeded'), count(language) from main.triage"
    ) == [(6, 0)]
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert len(asked(emulator)) == 2
    assert project.query("select count(language) from main.triage") == [(6,)]


def test_rows_answered_in_realtime_are_asked_their_added_field_in_a_batch(project, emulator):
    """Rows first answered in realtime (llm_realtime_when), then no longer urgent when a field is added:
    the added field alone is asked, in a batch."""
    project.dbt("seed")
    emulator.auto_advance_seconds = 0.05
    project.write(MODEL, model(TRIAGE_OUTPUT, "llm_realtime_when = 'true',"))
    project.dbt("run", "-s", "triage")
    assert emulator.stats()["realtime_requests"]["openai"] == 6
    project.write(MODEL, model(WIDER))
    project.dbt("run", "-s", "triage")
    assert [sorted(s["properties"]) for b in asked(emulator) for s in b] == [["language"]] * 6
    assert emulator.stats()["realtime_requests"]["openai"] == 6
    assert project.query("select count(language), count(category) from main.triage") == [(6, 6)]


def test_old_fields_removed_after_a_delta_asks_nothing(project, emulator):
    """language and priority_score added (answered), then summary and urgent removed: every field asked
    now is held (category in the first answer, the others in the delta, which holds more of them), so
    nothing is sent and the values and costs stay."""
    answered(project, emulator)
    added = {**WIDER, "priority_score": "integer"}
    project.write(MODEL, model(added))
    project.dbt("run", "-s", "triage")
    held = table(project, "category", "language", "priority_score", "llm_cost_usd")
    project.write(MODEL, model({k: v for k, v in added.items() if k not in ("summary", "urgent")}))
    project.dbt("run", "-s", "triage")
    assert len(asked(emulator)) == 2, [sorted(s["properties"]) for s in asked(emulator)[-1]]
    assert table(project, "category", "language", "priority_score", "llm_cost_usd") == held


def test_a_second_field_added_while_the_first_delta_is_in_flight_asks_only_it(project, emulator):
    """language added (its delta in flight), then priority_score added: the row waits for or asks only
    priority_score; language is never asked twice."""
    answered_no_wait(project, emulator)
    project.write(MODEL, model(WIDER, wait=False))
    project.dbt("run", "-s", "triage")
    project.write(MODEL, model({**WIDER, "priority_score": "integer"}, wait=False))
    for _ in range(3):
        project.dbt("run", "-s", "triage")
        emulator.complete_all()
    project.dbt("run", "-s", "triage")
    asked_language = sum(1 for b in asked(emulator) for s in b if "language" in s["properties"])
    assert asked_language == 6, f"language asked {asked_language} times for 6 rows"
    assert project.query("select count(language), count(priority_score) from main.triage") == [(6, 6)]


def test_a_variant_cannot_add_a_field_of_its_own(project, emulator):
    """Only one variant adding a field: llm_output is not a variant key, so the run refuses, naming the
    model and the key, and sends nothing."""
    project.dbt("seed")
    variants = f"llm_variants = {{'wide': {{'llm_output': {json.dumps(WIDER)}}}}},"
    project.write(MODEL, model(TRIAGE_OUTPUT, variants))
    message = failure_messages(project.dbt("run", "-s", "triage", expect_ok=False))
    assert "triage" in message and "llm_output" in message, message
    assert emulator.batches() == [] and emulator.stats()["realtime_requests"]["openai"] == 0


def test_a_field_added_while_the_other_models_rows_wait_for_the_shared_answer_asks_only_it(project, emulator):
    """llm_dedup = 'ledger': the copy's rows were mapped to the first model's request (answered, not yet
    merged into the copy) when a field is added to both. The held answer is in the ledger, so the copy
    is asked only the added field (and shares the first model's delta): 6 lines in all, not 12."""
    dedup = "llm_dedup = 'ledger',"
    project.dbt("seed")
    emulator.auto_advance_seconds = 0.05
    project.write(MODEL, model(TRIAGE_OUTPUT, dedup))
    project.write("models/triage_copy.sql", model(TRIAGE_OUTPUT, dedup))
    project.dbt("run", "--threads", "4", "-s", "triage", "triage_copy")
    assert sum(len(b) for b in asked(emulator)) == 6
    project.write(MODEL, model(WIDER, dedup))
    project.write("models/triage_copy.sql", model(WIDER, dedup))
    project.dbt("run", "--threads", "4", "-s", "triage", "triage_copy")
    later = [sorted(s["properties"]) for b in asked(emulator)[1:] for s in b]
    assert later == [["language"]] * 6, later
    # One more run: both tables show the held fields and the added one, and nothing is asked again
    # (the model that claimed the shared requests second points its rows at the other's in its run).
    project.dbt("run", "--threads", "4", "-s", "triage", "triage_copy")
    assert sum(len(b) for b in asked(emulator)) == 12
    for name in ("triage", "triage_copy"):
        assert project.query(f"select count(language), count(category) from main.{name}") == [(6, 6)], name
    held = {k: v for k, v in table(project, "category", "summary", "language").items()}
    copy = {r[0]: r[1:] for r in project.query("select ticket_id, category, summary, language from main.triage_copy")}
    assert copy == held


def test_a_provider_switch_while_the_delta_is_in_flight_asks_everything_there_and_pays_the_delta_once(
    project, emulator
):
    """A field added (its delta batch in flight at OpenAI), then the model moved to Anthropic before it
    ended: the new provider is asked every field of every row (another provider's answer is not this
    config's), the OpenAI delta is still harvested through OpenAI and costed once, and the table shows
    one row per key with the Anthropic answers."""
    answered_no_wait(project, emulator)
    project.write(MODEL, model(WIDER, wait=False))
    project.dbt("run", "-s", "triage")
    assert asked(emulator)[-1] == [schema_of("language")] * 6
    moved = model(WIDER, wait=False).replace("llm_provider = 'openai'", "llm_provider = 'anthropic'")
    project.write(MODEL, moved.replace("llm_model = 'gpt-4o-mini'", "llm_model = 'claude-sonnet-4-5'"))
    project.dbt("run", "-s", "triage")
    emulator.complete_all()
    project.dbt("run", "-s", "triage")
    billed = emulator.billed()
    assert len(billed) == 6 + 6 + 6, "the first answers, the delta, the new provider's: each request once"
    assert len({(b["face"], b["custom_id"]) for b in billed}) == len(billed)
    assert [b["face"] for b in billed[12:]] == ["anthropic"] * 6
    every = schema_of("category", "language", "summary", "urgent")
    rows = project.query("select prompt, category, language, llm_status from main.triage order by ticket_id")
    assert len(rows) == 6
    for prompt, category, language, status in rows:
        answer = expected(prompt, every)
        assert (status, category, language) == ("succeeded", answer["category"], answer["language"])
    # Nothing is left open, and the ledger's cost counts each billed request once (the delta's included).
    assert project.query("select count(*) from main.llm_batch_jobs where status not in ('completed', 'ended')") == [
        (0,)
    ]
    assert project.query(
        "select count(*), count(distinct custom_id) from main.llm_batch_requests where cost_usd > 0"
    ) == [(18, 18)]


def test_rows_whose_held_fields_are_another_models_request_in_flight_land_without_that_model(project, emulator):
    """triage_copy asks every row (6 lines, a batch left open); its batch ends at the provider but
    triage_copy does not run again. triage, asking one more field with the same prompt, finds
    triage_copy's requests as parts in flight: its own runs must still land every row."""
    dedup = "llm_dedup = 'ledger',"
    project.dbt("seed")
    project.write("models/triage_copy.sql", model(TRIAGE_OUTPUT, dedup, wait=False))
    project.dbt("run", "-s", "triage_copy")
    emulator.complete_all()  # ended at the provider; still queued in the ledger (triage_copy never runs again)
    project.write(MODEL, model(WIDER, dedup, wait=False))
    for _ in range(3):
        project.dbt("run", "-s", "triage")
        emulator.complete_all()
    project.dbt("run", "-s", "triage")
    assert project.query(
        "select count(*) filter (where llm_status = 'succeeded' and language is not null) from main.triage"
    ) == [(6,)]


def test_urgent_rows_whose_held_fields_are_another_models_request_in_flight_land_in_realtime_in_the_run(
    project, emulator
):
    """As above, every row of triage urgent (llm_realtime_when): triage_copy's requests, ended at the
    provider but still queued in the ledger, are not parts of triage's rows, so each row is asked every
    field in realtime, once, and lands in triage's first run. triage_copy, run later, harvests its own
    batch and shows its own answers; nothing is billed twice."""
    dedup = "llm_dedup = 'ledger',"
    project.dbt("seed")
    project.write("models/triage_copy.sql", model(TRIAGE_OUTPUT, dedup, wait=False))
    project.dbt("run", "-s", "triage_copy")
    emulator.complete_all()  # ended at the provider; still queued in the ledger until triage_copy runs again
    assert [len(b) for b in asked(emulator)] == [6]
    project.write(MODEL, model(WIDER, dedup + " llm_realtime_when = 'true',", wait=False))
    project.dbt("run", "-s", "triage")
    every = schema_of("category", "language", "summary", "urgent")
    rows = project.query(
        "select prompt, category, summary, urgent, language, llm_status, llm_route from main.triage order by ticket_id"
    )
    assert len(rows) == 6
    for prompt, category, summary, urgent, language, status, route in rows:
        answer = expected(prompt, every)  # asked every field, not only language
        assert (status, route) == ("succeeded", "realtime"), prompt
        assert (category, summary, urgent, language) == (
            answer["category"],
            answer["summary"],
            answer["urgent"],
            answer["language"],
        ), prompt
    prompts = [r[0] for r in rows]
    realtime = {p: n for (face, p), n in emulator.counters.realtime_prompts.items() if face == "openai"}
    assert realtime == {p: 1 for p in prompts}, "each urgent row asked once, in realtime"
    assert len(emulator.batches()) == 1, "no batch of triage's"
    billed = emulator.billed()
    assert sorted(b["via"] for b in billed) == ["batch"] * 6 + ["realtime"] * 6
    assert len({b["request"] for b in billed}) == 12, "no request billed twice"
    # Another run of triage asks nothing more and keeps its table.
    held = table(project, "category", "summary", "urgent", "language", "llm_status", "llm_route")
    project.dbt("run", "-s", "triage")
    assert (emulator.stats()["realtime_requests"]["openai"], len(emulator.batches())) == (6, 1)
    assert table(project, "category", "summary", "urgent", "language", "llm_status", "llm_route") == held
    # triage_copy, run later, lands its own batch's answers (its own schema), without asking anything.
    project.dbt("run", "-s", "triage_copy")
    narrow = schema_of("category", "summary", "urgent")
    copy = project.query(
        "select prompt, category, summary, urgent, llm_status, llm_route from main.triage_copy order by ticket_id"
    )
    assert len(copy) == 6
    for prompt, category, summary, urgent, status, route in copy:
        answer = expected(prompt, narrow)
        assert (status, route) == ("succeeded", "batch"), prompt
        assert (category, summary, urgent) == (answer["category"], answer["summary"], answer["urgent"]), prompt
    assert len(emulator.billed()) == 12 and len(emulator.batches()) == 1
    assert emulator.stats()["realtime_requests"]["openai"] == 6
    assert table(project, "category", "summary", "urgent", "language", "llm_status", "llm_route") == held
    assert project.query(
        "select count(*), count(distinct custom_id) from main.llm_batch_requests where cost_usd > 0"
    ) == [(12, 12)]
