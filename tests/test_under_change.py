"""Features under change: the user edits a model while a batch is in flight (switches one sharing
model's provider, adds a field to a nested output, renames the model's file), and the two models of
one ledger sharing requests (llm_dedup = 'ledger') are run and harvested in every order. What the
user sees is checked: table rows, costs against what the sandbox billed, log lines, `status`."""

from __future__ import annotations

import collections
import threading
from decimal import Decimal

import pytest
from conftest import INTEGRATION, failure_messages
from helpers import (
    PRICES,
    PROVIDER_MODELS,
    TRIAGE_SYSTEM,
    batch_counts,
    billed_cost,
    billed_per_key,
    dup_model,
    expected_triage,
    log_text,
    prompt_of,
    triage_model,
    write_rows,
)

from dbt_llm_batch.ops.cli import main as cli
from dbt_llm_batch.sandbox import expected_answer

SHARED = "llm_dedup='ledger'"


def dedup_table(project, name: str) -> dict[int, tuple]:
    """{id: (prompt, answer, status, cost, route, llm_model)} of a dedup model's table."""
    rows = project.query(
        f"select id, prompt, llm_output, llm_status, llm_cost_usd, llm_route, llm_model from main.{name}"
    )
    return {r[0]: r[1:] for r in rows}


def shared_models(project, rows: dict[int, int]) -> None:
    """`dup` and `dup_twin`: the same rows, both sharing the ledger's requests, through OpenAI."""
    project.write("seeds/llm_prices.csv", PRICES)
    for name in ("dup", "dup_twin"):
        project.write(f"models/{name}.sql", dup_model("openai", extra=SHARED))
    write_rows(project, rows)


# -- 1. A provider switch while shared requests are in flight ------------------------------------


@pytest.mark.parametrize("switched", ["dup_twin", "dup"], ids=["the_sharer_switches", "the_submitter_switches"])
def test_a_provider_switch_with_shared_requests_in_flight_pays_nothing_twice(project, emulator, switched):
    """`dup` sends 8 requests for its 20 rows; `dup_twin` shares them while they are in flight; then
    one of the two moves to Anthropic before the batch ends. Documented (README "Deduplication",
    "Config keys"): switching the provider re-asks every row of that model (it is in the
    fingerprint), and a row shares only a request of the same fingerprint. So the switched model's
    rows get Anthropic's answers from requests of their own, the other model's rows keep OpenAI's
    answers, nothing is asked twice of either provider, and the two tables' costs add up to exactly
    what both providers billed."""
    shared_models(project, {i: i % 8 for i in range(20)})
    project.dbt("run", "-s", "dup")  # the submitter
    project.dbt("run", "-s", "dup_twin")  # the sharer: its rows point at the requests in flight
    assert batch_counts(emulator) == [8]

    project.write(f"models/{switched}.sql", dup_model("anthropic", extra=SHARED))
    project.dbt("run", "-s", switched)
    assert batch_counts(emulator) == [8, 8]
    emulator.complete_all()
    for name in ("dup", "dup_twin"):  # the submitter's run harvests the OpenAI batch
        project.dbt("run", "-s", name)

    billed = collections.Counter((b["face"], b["prompt"]) for b in emulator.billed())
    assert billed == {(face, prompt_of(n)): 1 for face in ("openai", "anthropic") for n in range(8)}
    assert batch_counts(emulator) == [8, 8], "nothing was sent again"
    tables = {name: dedup_table(project, name) for name in ("dup", "dup_twin")}
    for name, rows in tables.items():
        assert len(rows) == 20, name
        model = "claude-test" if name == switched else "gpt-test"
        for key, (prompt, answer, status, _cost, _route, llm_model) in rows.items():
            assert (status, answer, llm_model) == ("succeeded", expected_answer(None, prompt, None), model), (name, key)
    # Money: each provider's bill is carried by the rows that show its answers, exactly once.
    unswitched = "dup" if switched == "dup_twin" else "dup_twin"
    assert sum(r[3] for r in tables[switched].values()) == billed_cost(emulator, "anthropic") > 0
    assert sum(r[3] for r in tables[unswitched].values()) == billed_cost(emulator, "openai") > 0
    assert project.query("select sum(cost_usd) from main.llm_batch_costs") == [
        (billed_cost(emulator, "anthropic") + billed_cost(emulator, "openai"),)
    ]


# -- 2. A nested llm_output gains a field while a batch of the old schema is in flight ------------

EXTRACTION = "models/extraction/resume_extraction.sql"
EXTRACTION_SYSTEM = "Extract the candidate, their jobs, their skills and the date they can start from the resume."
CANDIDATE_V1 = 'STRUCT(email VARCHAR, "name" VARCHAR)'
CANDIDATE_V2 = 'STRUCT(email VARCHAR, "name" VARCHAR, phone VARCHAR)'


def write_extraction(project, provider: str, with_phone: bool) -> None:
    text = (INTEGRATION / EXTRACTION).read_text()  # the example as shipped
    text = text.replace(
        "materialized = 'llm_batch',",
        f"materialized = 'llm_batch', llm_provider = '{provider}', llm_model = '{PROVIDER_MODELS[provider]}',",
        1,
    )
    if with_phone:  # the candidate gains a required field
        text = text.replace(
            "'email': {'type': 'string', 'description': 'email address, if the resume gives one'},",
            "'email': {'type': 'string', 'description': 'email address, if the resume gives one'},\n"
            "                'phone': {'type': 'string', 'description': 'phone number'},",
        ).replace("'required': ['name'],", "'required': ['name', 'phone'],")
        assert "'phone'" in text
    project.write(EXTRACTION, text)


def extraction_rows(project) -> list[tuple]:
    return project.query(
        """select r.resume, e.candidate, e.llm_status, e.llm_error, e.llm_fingerprint
           from main.resume_extraction e join main.resumes r using (resume_id) order by resume_id"""
    )


def test_a_nested_output_gaining_a_field_with_a_batch_in_flight(project, emulator, provider):
    """README ("The table", "Config keys"): llm_output is in the fingerprint, so a changed schema
    asks every row again, once; the next run names the changed column and asks for --full-refresh,
    which rebuilds the table from the ledger without sending anything; a key keeps its last final
    row until the new outcome is final. The answers of the old schema are answers to the old
    request (its fingerprint): they are not failures of the new schema, and not shown as its answers."""
    project.dbt("seed", "-s", "resumes")
    write_extraction(project, provider, with_phone=False)
    project.dbt("run", "-s", "resume_extraction")  # 5 requests of the old schema in flight
    assert batch_counts(emulator) == [5]

    write_extraction(project, provider, with_phone=True)
    emulator.complete_all()
    calls = dict(emulator.stats()["calls"])
    result = project.dbt("run", "-s", "resume_extraction", expect_ok=False)
    message = failure_messages(result)
    assert f"changed: candidate {CANDIDATE_V1} -> {CANDIDATE_V2}" in message, message
    assert "--full-refresh" in message
    assert dict(emulator.stats()["calls"]) == calls, "refused before any provider call"

    project.dbt("run", "-s", "resume_extraction", "--full-refresh")  # harvests the old batch, sends nothing
    assert batch_counts(emulator) == [5]
    described = {name: typ for name, typ, *_ in project.query("describe main.resume_extraction")}
    assert described["candidate"] == CANDIDATE_V2
    rows = extraction_rows(project)
    assert len(rows) == 5
    old = {resume: fingerprint for resume, _, _, _, fingerprint in rows}
    for resume, candidate, status, error, _ in rows:
        # The old request's answer, as answered: no phone, and no error for lacking one.
        assert (status, error, candidate["phone"]) == ("succeeded", None, None), (resume, error)

    project.dbt("run", "-s", "resume_extraction")  # the new schema: each row asked once more
    assert batch_counts(emulator) == [5, 5]
    emulator.complete_all()
    project.dbt("run", "-s", "resume_extraction")
    project.dbt("run", "-s", "resume_extraction")
    assert batch_counts(emulator) == [5, 5], "asked once"
    rows = extraction_rows(project)
    assert len(rows) == 5
    for resume, candidate, status, error, fingerprint in rows:
        assert status == "succeeded" and error is None, (resume, error)
        assert fingerprint != old[resume]
        assert candidate["phone"] is not None and candidate["name"]
    billed = billed_per_key(emulator, {r: r for r, *_ in rows})
    assert sorted(billed.values()) == [2] * 5  # once per schema


# -- 3. The model's file is renamed while its batch is in flight; the poller harvests ------------


def poll(project, capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli(["poll", "--database", str(project.db_path), *args])
    return rc, capsys.readouterr().out


def triage_prompts(project) -> dict[str, int]:
    rows = project.query("select ticket_id, subject, body from main.support_tickets")
    return {f"Subject: {s}\n\n{b}": k for k, s, b in rows}


def test_a_renamed_model_keeping_its_identity_gets_the_polled_answers_without_paying_again(
    project, emulator, provider, capsys
):
    """README ("The table"): to keep a renamed model's answers and batches in flight, set
    llm_ledger_identity to the old schema.name. The poller harvests the batch, and names the model
    by the dbt name its last run recorded: the renamed one once it has run."""
    project.dbt("seed")
    project.write("models/triage.sql", triage_model(provider=provider))
    project.dbt("run", "-s", "triage")
    assert batch_counts(emulator) == [6]

    (project.root / "models/triage.sql").unlink()
    project.write(
        "models/triage_renamed.sql",
        triage_model(provider=provider, extra_config="llm_ledger_identity = 'main.triage',"),
    )
    project.dbt("run", "-s", "triage_renamed")  # the batch is still in flight: nothing is sent
    assert batch_counts(emulator) == [6]
    assert "first run of this model" not in log_text(project)

    emulator.complete_all()
    project.release_database()
    rc, out = poll(project, capsys)
    assert rc == 0, out
    assert "new results for: triage_renamed" in out
    calls = dict(emulator.stats()["calls"])
    project.dbt("run", "-s", "triage_renamed")
    assert dict(emulator.stats()["calls"]) == calls, "merged from the ledger, with no provider call"
    rows = project.query("""select s.subject, s.body, t.category, t.urgent, t.summary, t.llm_status
                            from main.triage_renamed t join main.support_tickets s using (ticket_id)""")
    assert len(rows) == 6
    for subject, body, *answer, status in rows:
        assert (*answer, status) == (*expected_triage(TRIAGE_SYSTEM, f"Subject: {subject}\n\n{body}"), "succeeded")
    assert sorted(billed_per_key(emulator, triage_prompts(project)).values()) == [1] * 6


def test_a_renamed_model_is_a_new_model_and_says_so_before_paying_again(project, emulator, provider, capsys):
    """README ("The table"): renaming a model's file starts a new ledger identity; its first run
    warns when another model of the ledger already has the answers, naming the setting that keeps
    them. The old model's answers, harvested by the poller, stay in the ledger."""
    project.dbt("seed")
    project.write("models/triage.sql", triage_model(provider=provider))
    project.dbt("run", "-s", "triage")
    (project.root / "models/triage.sql").unlink()
    project.write("models/triage_renamed.sql", triage_model(provider=provider))
    emulator.complete_all()
    project.release_database()
    rc, out = poll(project, capsys)
    assert rc == 0 and "main.triage: 1 batch(es) harvested: 6 succeeded, 0 failed" in out, out

    project.dbt("run", "-s", "triage_renamed")
    assert (
        "main.triage_renamed: first run of this model, and 6 of its requests were already asked for model "
        "'main.triage' (6 answered, 0 still in flight; the same prompts and settings): they are sent and paid "
        "again now. If you renamed the "
        "model, set llm_ledger_identity = 'main.triage'"
    ) in log_text(project)
    assert batch_counts(emulator) == [6, 6]
    assert project.query("select model, status, count(*) from main.llm_batch_requests group by all order by all") == [
        ("main.triage", "succeeded", 6),
        ("main.triage_renamed", "queued", 6),
    ]


# -- 4. Gap A: a model whose rows all share another model's requests shows in progress and status --


def test_a_model_answered_only_by_another_models_requests_shows_its_rows_in_progress(project, emulator, capsys):
    shared_models(project, {i: i % 8 for i in range(20)})
    project.dbt("run", "-s", "dup")
    project.dbt("run", "-s", "dup_twin")  # in flight: its rows point at dup's requests
    progress = "select model, keys_succeeded, requests_sent, rows_mapped, rows_reused from main.llm_batch_progress"
    assert sorted(project.query(progress)) == [("main.dup", 0, 8, 20, 0), ("main.dup_twin", 0, 0, 20, 0)]

    emulator.complete_all()
    project.dbt("run", "-s", "dup")
    project.dbt("run", "-s", "dup_twin")
    project.write("seeds/dup_rows.csv", (project.root / "seeds/dup_rows.csv").read_text() + f'20,"{prompt_of(3)}"\n')
    project.dbt("seed")
    project.dbt("run", "-s", "dup_twin")  # one more row, answered from the ledger
    assert batch_counts(emulator) == [8]
    twin = dedup_table(project, "dup_twin")
    assert len(twin) == 21 and twin[20][4] == "reused"
    assert sorted(project.query(progress)) == [("main.dup", 20, 8, 20, 0), ("main.dup_twin", 21, 0, 21, 1)]

    project.release_database()
    capsys.readouterr()
    assert cli(["status", "--database", str(project.db_path), "--schema", "main"]) == 0
    shown = capsys.readouterr().out
    progress_part = shown.split("Progress per model:", 1)[1]
    assert "main.dup_twin" in progress_part, shown


# -- 5. Gap B: a row mapped to a request at the moment another model's run harvests it -----------


def test_a_row_mapped_while_another_model_harvests_the_request_is_reused_at_no_cost(project, emulator):
    """Both models in one `dbt run` (threads): dup_twin plans while dup's request is still in flight,
    then dup harvests and merges before dup_twin writes its rows' mapping. The order is forced with
    two events (no timing): dup_twin's rows are answered from the stored answer (reused, $0), and
    the two tables' costs add up to exactly what was billed."""
    from dbt_llm_batch.pipeline import merge, runner, send

    shared_models(project, {i: i % 8 for i in range(20)})
    project.dbt("run", "-s", "dup")
    emulator.complete_all()

    twin_planned, dup_merged = threading.Event(), threading.Event()
    harvest_open, map_answered, merge_fn = runner.ModelRun.harvest_open, send.map_answered, merge.merge

    def waited(event: threading.Event, what: str) -> None:
        if not event.wait(120):
            raise AssertionError(f"{what} never happened")

    def harvest_after_twin_planned(self):
        if self.ledger.model == "main.dup":
            waited(twin_planned, "dup_twin's plan")
        return harvest_open(self)

    def map_after_dup_merged(state, dedup):
        if state.ledger.model == "main.dup_twin":
            twin_planned.set()
            waited(dup_merged, "dup's merge")
        return map_answered(state, dedup)

    def merge_then_say_so(ledger, *args, **kwargs):
        try:
            return merge_fn(ledger, *args, **kwargs)
        finally:
            if ledger.model == "main.dup":
                dup_merged.set()

    with pytest.MonkeyPatch.context() as patched:  # undone at the block's end (the fixtures' own patches stay)
        patched.setattr(runner.ModelRun, "harvest_open", harvest_after_twin_planned)
        patched.setattr(send, "map_answered", map_after_dup_merged)
        patched.setattr(merge, "merge", merge_then_say_so)
        project.dbt("run", "-s", "dup", "dup_twin", "--threads", "2")
    assert twin_planned.is_set() and dup_merged.is_set()
    project.dbt("run", "-s", "dup_twin")  # merges what its rows point at, if the first did not

    assert batch_counts(emulator) == [8]
    dup, twin = dedup_table(project, "dup"), dedup_table(project, "dup_twin")
    assert len(dup) == len(twin) == 20
    assert {(r[2], r[4]) for r in twin.values()} == {("succeeded", "reused")}
    assert {r[3] for r in twin.values()} == {Decimal(0)}
    assert sum(r[3] for r in dup.values()) == billed_cost(emulator, "openai") > 0
