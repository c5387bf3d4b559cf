"""Sequences of model edits between runs against the run's shortcuts: winners read without ranking
when no key has two row answers (pipeline/merge.py), settling without the requests join when nothing
failed (pipeline/harvest.py), and rows left out of the plan by their desired row's answer_id
(pipeline/plan.py). Each edits the model between runs the way a user would (prompts edited and
edited back in flight, retries, unknown result lines, unselected keys, variants, a key change), and
checks what was paid and the table against invariant 3: an incremental run and a full refresh give
the same table."""

from __future__ import annotations

import json

import pytest
from helpers import (
    THINGS_SYSTEM,
    append_result_lines,
    batch_counts,
    line_for_an_unknown_custom_id,
    log_text,
    result_lines,
    run,
    sorted_batches,
    things_model,
)

from dbt_llm_batch.sandbox import expected_answer

# Columns a full refresh may legitimately write differently (when the row was written).
VOLATILE = ("llm_completed_at",)


def write_things(project, prompts: dict[int, str]) -> None:
    values = ", ".join(f"({a}, {json.dumps(p).replace(chr(34), chr(39))})" for a, p in prompts.items())
    project.write("models/things.sql", f"select * from (values {values}) t(a, prompt)")
    project.dbt("run", "-s", "things")


def snapshot(project) -> list[tuple]:
    cols = [
        c
        for (c,) in project.query(
            "select column_name from information_schema.columns where table_name = 'm' and table_schema = 'main' "
            "order by ordinal_position"
        )
        if c not in VOLATILE
    ]
    return project.query(f"select {', '.join(cols)} from main.m order by all")


def assert_full_refresh_agrees(project) -> list[tuple]:
    before = snapshot(project)
    project.dbt("run", "-s", "m", "--full-refresh")
    after = snapshot(project)
    assert before == after, {
        "incremental only": set(before) - set(after),
        "full refresh only": set(after) - set(before),
    }
    return after


def outputs(project) -> dict:
    return {a: (p, s, o) for a, p, s, o in project.query("select a, prompt, llm_status, llm_output from main.m")}


def assert_answers_current_prompts(project, rows: int) -> None:
    got = outputs(project)
    assert len(got) == rows, got
    for a, (p, s, o) in got.items():
        assert s == "succeeded", (a, p, s, o)
        assert o == expected_answer(THINGS_SYSTEM, p, None), (a, p, o)


def base(n: int = 6, suffix: str = "") -> dict[int, str]:
    return {a: f"row {a}{suffix}" for a in range(n)}


def test_prompt_edited_back_and_forth_with_batches_in_flight(project, emulator):
    """Against the winners and the plan's answer_id: a key's prompt changed and changed back while both batches are in flight; once
    both end, the table shows the current prompt's answer, incremental and full refresh alike."""
    project.write("models/m.sql", things_model("openai"))
    write_things(project, base())
    run(project)  # batch 1: the original prompts, in flight
    write_things(project, {**base(), 2: "row 2 edited"})
    run(project)  # batch 2: row 2's edit, in flight
    write_things(project, base())
    run(project)  # back: row 2's original request is in flight, nothing new
    assert batch_counts(emulator) == [6, 1]
    emulator.complete_all()
    run(project)
    assert_answers_current_prompts(project, 6)
    assert_full_refresh_agrees(project)
    write_things(project, {**base(), 2: "row 2 edited"})
    run(project)  # the edit's answer is paid for already: shown, nothing asked
    assert batch_counts(emulator) == [6, 1]
    assert_answers_current_prompts(project, 6)
    assert_full_refresh_agrees(project)


def test_dedup_shared_request_failing_once_is_retried_in_the_harvesting_run(project, emulator):
    """Against the winners, settle and the plan's answer_id: two keys share one request (llm_dedup); it fails once and the harvesting run
    plans its retry (seq+1) at once; the retry answers both keys, and a full refresh agrees."""
    emulator.add_fault(prompt_contains="row 1", status_code=500, message="Upstream failure.", times=1)
    project.write("models/m.sql", things_model("openai", "llm_max_attempts = 3,"))
    write_things(project, {0: "row 0", 1: "row 1", 2: "row 1", 3: "row 3", 4: "row 3", 5: "row 5"})
    run(project)
    assert batch_counts(emulator) == [4], "one request per distinct prompt"
    emulator.complete_all()
    run(project)  # harvests the failure: the retry is planned in this run
    assert batch_counts(emulator) == [4, 1]
    assert project.query("select count(*) from main.m where a in (1, 2)") == [(0,)], "not final: not shown yet"
    emulator.complete_all()
    run(project)
    assert_answers_current_prompts(project, 6)
    assert (
        project.query("select key, seq, status from main.llm_batch_requests where status = 'failed' order by all") != []
    ), "the first attempt is kept as failed"
    assert_full_refresh_agrees(project)


def test_unknown_line_in_a_model_with_a_failed_request(project, emulator):
    """Against settle: the settle path that joins lines to requests (a model with a failed request) still
    ignores, and reports, a result line for a custom_id the batch never sent, and a duplicated line."""
    emulator.add_fault(prompt_contains="row 2", status_code=500, message="Upstream failure.", times=1)
    project.write("models/m.sql", things_model("openai", "llm_max_attempts = 3,"))
    write_things(project, base())
    run(project)
    emulator.complete_all()
    run(project)  # row 2 failed once: its retry is in flight
    emulator.complete_all()
    batch = sorted_batches(emulator)[1]
    existing = result_lines(emulator, batch)
    stranger = line_for_an_unknown_custom_id(existing[0])
    append_result_lines(emulator, batch, [existing[0], stranger])
    run(project)
    assert "1 result line(s) for custom_ids their batch never sent were ignored" in log_text(project)
    assert_answers_current_prompts(project, 6)
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1 order by 1") == [
        ("failed", 1),
        ("succeeded", 6),
    ]
    assert_full_refresh_agrees(project)


def test_unknown_line_and_a_lost_line_in_one_batch(project, emulator):
    """Against settle: a batch whose output lost one request's line and has one unknown line instead: as many
    lines as requests, but one settled fewer: the unknown line is reported, the lost request sent again."""
    project.write("models/m.sql", things_model("openai"))
    write_things(project, base())
    run(project)
    emulator.complete_all()
    batch = sorted_batches(emulator)[0]
    face = {f.name: f for f in emulator.faces}
    lines = [json.loads(x) for x in face["openai"].contents[batch["output_file_id"]].splitlines()]
    lost = lines[-1]["custom_id"]
    lines[-1]["custom_id"] = "r_not_ours"
    face["openai"].contents[batch["output_file_id"]] = "".join(json.dumps(x) + "\n" for x in lines).encode()
    run(project)
    assert "1 result line(s) for custom_ids their batch never sent were ignored" in log_text(project)
    assert project.query(f"select status from main.llm_batch_requests where custom_id = '{lost}'") != [("succeeded",)]
    emulator.complete_all()
    run(project)
    assert_answers_current_prompts(project, 6)
    assert_full_refresh_agrees(project)


def test_unselected_rows_deleted_then_selected_again_with_an_edit_in_flight(project, emulator):
    """Against the winners and the plan's answer_id: llm_on_unselected='delete' removes rows; selecting them again (one with a
    prompt edited meanwhile, in flight) shows their answers again; a full refresh agrees."""
    write_things(project, base())
    model = things_model("openai", "llm_on_unselected = 'delete',")
    project.write("models/m.sql", model)
    run(project)
    emulator.complete_all()
    run(project)
    project.write(
        "models/m.sql",
        model.replace("select * from {{ ref('things') }}", "select * from {{ ref('things') }} where a < 3"),
    )
    run(project)
    assert project.query("select count(*) from main.m") == [(3,)]
    write_things(project, {**base(), 4: "row 4 edited"})
    project.write("models/m.sql", model)
    run(project)  # row 4's edit asked; rows 3 and 5 shown again from the ledger
    assert batch_counts(emulator) == [6, 1]
    assert project.query("select a, llm_status from main.m where a in (3, 5) order by a") == [
        (3, "succeeded"),
        (5, "succeeded"),
    ]
    emulator.complete_all()
    run(project)
    assert_answers_current_prompts(project, 6)
    assert_full_refresh_agrees(project)


def test_variant_added_to_an_answered_model_then_removed(project, emulator):
    """Against the plan's answer_id: a variant added once the model's rows are answered is asked for every row (the
    default variant's row answers decide nothing for it); removed, the table goes back; a full refresh
    agrees each time."""
    project.write("models/m.sql", things_model("openai"))
    write_things(project, base())
    run(project)
    emulator.complete_all()
    run(project)
    with_twin = things_model("openai", "llm_variants = {'twin': {'llm_max_tokens': 60}},")
    project.write("models/m.sql", with_twin)
    run(project)
    assert batch_counts(emulator) == [6, 6], "the twin variant asks every row"
    emulator.complete_all()
    run(project)
    assert (
        project.query(
            "select llm_variant, count(*), count(*) filter (where llm_status = 'succeeded') "
            "from main.m group by 1 order by 1"
        )
        != []
    )
    assert len(batch_counts(emulator)) == 2
    assert_full_refresh_agrees(project)
    project.write("models/m.sql", things_model("openai"))
    project.dbt("run", "-s", "m", "--full-refresh")  # the table loses its llm_variant column
    run(project)
    assert batch_counts(emulator) == [6, 6], "nothing new to ask"
    assert_answers_current_prompts(project, 6)
    assert_full_refresh_agrees(project)


def test_unique_key_changed_with_a_batch_in_flight(project, emulator):
    """Against the plan's answer_id: the key column is renamed while a batch (with an edited prompt) is in flight: the
    re-key keeps the in-flight request, nothing is asked twice, and the table shows every answer."""
    project.write("models/m.sql", things_model("openai"))
    write_things(project, base())
    run(project)
    emulator.complete_all()
    run(project)
    write_things(project, {**base(), 3: "row 3 edited"})
    run(project)  # row 3's edit in flight
    assert batch_counts(emulator) == [6, 1]
    rekeyed = (
        things_model("openai")
        .replace("unique_key='a'", "unique_key='b'")
        .replace("select * from {{ ref('things') }}", "select a as b, prompt from {{ ref('things') }}")
    )
    project.write("models/m.sql", rekeyed)
    project.dbt("run", "-s", "m", "--full-refresh")
    assert batch_counts(emulator) == [6, 1], "the in-flight edit is not asked again"
    emulator.complete_all()
    project.dbt("run", "-s", "m")
    got = {b: (p, s, o) for b, p, s, o in project.query("select b, prompt, llm_status, llm_output from main.m")}
    assert len(got) == 6
    assert all(s == "succeeded" and o == expected_answer(THINGS_SYSTEM, p, None) for p, s, o in got.values()), got
    assert batch_counts(emulator) == [6, 1]


def test_one_waiting_run_retries_a_failure_it_harvested(project, emulator):
    """Against the plan's answer_id: with llm_wait_seconds the run's desired rows are built once; a request the run's
    own wait harvests as failed is planned again in the same run (its row had no answer_id when the
    rows were built), and the table is complete when the run ends."""
    emulator.auto_advance_seconds = 0.2
    emulator.add_fault(prompt_contains="row 4", status_code=500, message="Upstream failure.", times=1)
    project.write("models/m.sql", things_model("openai", "llm_max_attempts = 3, llm_wait_seconds = 60,"))
    write_things(project, base())
    run(project)
    assert batch_counts(emulator) == [6, 1]
    assert_answers_current_prompts(project, 6)
    assert_full_refresh_agrees(project)


def test_dry_run_after_an_edit_plans_only_the_edited_row(project, emulator):
    """Against the plan's answer_id: a dry run builds its desired rows outside the lock; with one prompt edited and one
    request in flight it reports one request to submit, sends nothing, and leaves the table as is."""
    project.write("models/m.sql", things_model("openai"))
    write_things(project, base())
    run(project)
    emulator.complete_all()
    run(project)
    before = snapshot(project)
    write_things(project, {**base(), 1: "row 1 edited"})
    project.dbt("run", "-s", "m", "--vars", "{llm_batch_dry_run: true}")
    assert "DRY RUN: would submit 1 request(s) in 1 batch(es)" in log_text(project)
    assert batch_counts(emulator) == [6]
    assert snapshot(project) == before
    run(project)
    assert batch_counts(emulator) == [6, 1]


@pytest.mark.parametrize("failed_before", [False, True])
def test_expired_batch_with_partial_results_and_an_unknown_line(project, emulator, provider, failed_before):
    """Against settle: an expired batch's partial results plus a line for a custom_id it never sent, with and
    without an earlier failed request in the model (the two settle paths): the answered requests
    succeed, the expired ones are sent again without using an attempt, the unknown line is reported."""
    if failed_before:
        emulator.add_fault(prompt_contains="row 0", status_code=500, message="Upstream failure.", times=1)
    project.write("models/m.sql", things_model(provider, "llm_max_attempts = 2,"))
    write_things(project, base(8))
    run(project)
    if failed_before:
        emulator.complete_all()
        write_things(project, base(12))  # new rows go in the retry's batch: it has lines to expire
        run(project)  # row 0 failed once; its retry goes with the next batch
        assert project.query("select count(*) from main.llm_batch_requests where status = 'failed'") == [(1,)]
    batch = sorted_batches(emulator)[-1]
    emulator.advance(batch["id"], "expired", done_fraction=0.5)
    batch = sorted_batches(emulator)[-1]
    existing = result_lines(emulator, batch)
    stranger = line_for_an_unknown_custom_id(existing[0])
    append_result_lines(emulator, batch, [stranger])
    run(project)
    assert "1 result line(s) for custom_ids their batch never sent were ignored" in log_text(project)
    assert project.query("select count(*) from main.llm_batch_requests where status = 'voided'") != [(0,)]
    emulator.complete_all()
    run(project)
    rows = 12 if failed_before else 8
    assert_answers_current_prompts(project, rows)
    assert project.query("select count(*) from main.llm_batch_requests where status = 'succeeded'") == [(rows,)]
    assert_full_refresh_agrees(project)


def test_ledger_dedup_across_models_with_a_shared_request_failing_once(project, emulator):
    """Against the plan's answer_id with llm_dedup='ledger': model n's rows are answered by model m's requests; one fails
    once and m plans its retry; n's row (whose answer_id is the failed request) maps to the retry, not
    to a request of its own: each distinct prompt is paid once, and both tables are complete."""
    emulator.add_fault(prompt_contains="row 2", status_code=500, message="Upstream failure.", times=1)
    model = things_model("openai", "llm_max_attempts = 3, llm_dedup = 'ledger',")
    project.write("models/m.sql", model)
    project.write("models/n.sql", model)
    write_things(project, base())
    run(project)
    project.dbt("run", "-s", "n")
    assert batch_counts(emulator) == [6], "n's rows share m's requests"
    emulator.complete_all()
    run(project)  # m harvests: row 2 failed once, its retry is planned
    project.dbt("run", "-s", "n")
    assert batch_counts(emulator) == [6, 1], "n maps row 2 to m's retry"
    emulator.complete_all()
    run(project)
    project.dbt("run", "-s", "n")
    assert batch_counts(emulator) == [6, 1]
    assert_answers_current_prompts(project, 6)
    got = {a: (s, o) for a, s, o in project.query("select a, llm_status, llm_output from main.n")}
    assert got == {a: ("succeeded", o) for a, (_, _, o) in outputs(project).items()}
    assert_full_refresh_agrees(project)


def test_realtime_rows_failing_once_with_a_prompt_edited_back(project, emulator):
    """Against settle (the realtime settle, by source) and the plan's answer_id: rows sent in realtime, one failing once, then a
    prompt edited and edited back: each distinct request is answered once and a full refresh agrees."""
    emulator.add_fault(prompt_contains="row 3", status_code=500, message="Upstream failure.", times=1)
    project.write("models/m.sql", things_model("openai", "llm_max_attempts = 3, llm_realtime_when = 'a >= 0',"))
    write_things(project, base())
    run(project)
    run(project)  # the failed row's retry, if the first run left it
    assert_answers_current_prompts(project, 6)
    write_things(project, {**base(), 1: "row 1 edited"})
    run(project)
    write_things(project, base())
    run(project)
    assert_answers_current_prompts(project, 6)
    assert project.query("select count(*) from main.llm_batch_requests where status = 'succeeded'") == [(7,)]
    assert_full_refresh_agrees(project)


def test_final_failure_then_more_attempts_allowed(project, emulator):
    """Against the winners and settle: a row failed finally (llm_max_attempts = 1) is shown failed; allowing a second
    attempt asks it again, and its success replaces the failure, incremental and full refresh alike."""
    emulator.add_fault(prompt_contains="row 2", status_code=500, message="Upstream failure.", times=1)
    project.write("models/m.sql", things_model("openai", "llm_max_attempts = 1,"))
    write_things(project, base())
    run(project)
    emulator.complete_all()
    run(project)
    assert project.query("select llm_status from main.m where a = 2") == [("failed",)]
    assert_full_refresh_agrees(project)
    project.write("models/m.sql", things_model("openai", "llm_max_attempts = 2,"))
    run(project)
    assert batch_counts(emulator) == [6, 1]
    emulator.complete_all()
    run(project)
    assert_answers_current_prompts(project, 6)
    assert_full_refresh_agrees(project)


def test_identical_variants_share_requests_through_edits(project, emulator):
    """Against the winners and the plan's answer_id: a variant identical to the model's own config shares its requests (one
    fingerprint, a row answer per variant); a prompt edited and edited back while in flight leaves
    both variants' rows answered by the same requests, incremental and full refresh alike."""
    model = things_model("openai", f"llm_variants = {{'same': {{'llm_system': {THINGS_SYSTEM!r}}}}},")
    project.write("models/m.sql", model)
    write_things(project, base())
    run(project)
    first = batch_counts(emulator)
    write_things(project, {**base(), 1: "row 1 edited"})
    run(project)
    write_things(project, base())
    run(project)
    emulator.complete_all()
    run(project)
    assert first == [6], "the identical variant shares the model's requests"
    assert batch_counts(emulator) == [6, 1], "the edit asked once for both variants, the revert nothing"
    rows = project.query(
        "select llm_variant, a, prompt, llm_status, llm_output from main.m order by llm_variant nulls first, a"
    )
    assert len(rows) == 12, rows
    assert all(s == "succeeded" and o == expected_answer(THINGS_SYSTEM, p, None) for _, _, p, s, o in rows), rows
    assert_full_refresh_agrees(project)
