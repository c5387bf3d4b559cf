"""Operator controls through real dbt runs and the `dbt-llm-batch` command line: cancel a model's
batches (their finished half is harvested, the rest held until released), requeue failed rows
without a config change, and delete the provider's files once results are stored."""

from __future__ import annotations

import pytest
from helpers import (
    TRIAGE_SYSTEM,
    batch_counts,
    command,
    expected_triage,
    triage_model,
)

from dbt_llm_batch.ops.cli import main as cli

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]


def statuses(project) -> dict[str, int]:
    return dict(project.query("select status, count(*) from main.llm_batch_requests group by all"))


def test_cancel_harvests_the_finished_half_holds_the_rest_until_released(project, emulator, provider, capsys):
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    batch_id = emulator.batches()[0]["id"]
    emulator.advance(batch_id, "in_progress", 0.5)  # half the requests have run

    rc, out, _ = command(project, capsys, "cancel")
    assert rc == 0
    assert f"{batch_id}: cancel requested by " in out
    assert "requests they left unanswered are held (not resent) until `dbt-llm-batch release" in out
    assert emulator.batches()[0].get("status", emulator.batches()[0].get("processing_status")) in (
        "cancelling",
        "canceling",
    )
    status, who, when = project.query("select status, cancelled_by, cancel_requested_at from main.llm_batch_jobs")[0]
    assert status in ("cancelling", "canceling") and "@" in who and when is not None

    emulator.advance(batch_id, "cancelled", 0.5)  # the provider finishes cancelling
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6]  # nothing resent
    assert statuses(project) == {"succeeded": 3, "held": 3}
    assert "pending 0; held 3 (release with `dbt-llm-batch release`)" in (project.root / "logs" / "dbt.log").read_text()
    assert project.query("select requests_pending, requests_held from main.llm_batch_progress") == [(0, 3)]
    rows = project.query(
        "select t.llm_status, s.subject, s.body, t.category, t.urgent, t.summary "
        "from main.triage t join main.support_tickets s using (ticket_id)"
    )
    assert len(rows) == 3 and all(r[0] == "succeeded" for r in rows)
    for _, subject, body, *answer in rows:  # each harvested answer is that row's own
        assert tuple(answer) == expected_triage(TRIAGE_SYSTEM, f"Subject: {subject}\n\n{body}")
    errors = project.query("select distinct error from main.llm_batch_requests where status = 'held'")
    assert len(errors) == 1 and errors[0][0].startswith(f"batch {batch_id} was cancelled by ")
    assert errors[0][0].endswith("before answering; held until `dbt-llm-batch release` or a change of prompt or config")

    project.dbt("run", *SELECT)  # still held: no new batch
    assert batch_counts(emulator) == [6]

    rc, out, _ = command(project, capsys, "release")
    assert (rc, out.strip()) == (0, "released 3 held request(s) of triage: the next run sends them")
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 3]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select count(*), count(*) filter (where llm_status = 'succeeded') from main.triage") == [
        (6, 6)
    ]
    # The history is kept: the released requests stay in the ledger (no attempt used), with why.
    assert project.query(
        "select count(*) from main.llm_batch_requests where status = 'released' and error like '%; released by %'"
    ) == [(3,)]


def test_held_requests_are_sent_again_when_their_fingerprint_changes(project, emulator, capsys):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.dbt("run", *SELECT)
    batch_id = emulator.batches()[0]["id"]
    rc, out, _ = command(project, capsys, "cancel")
    assert rc == 0
    emulator.advance(batch_id, "cancelled", 0.0)  # nothing had run
    project.dbt("run", *SELECT)
    assert statuses(project) == {"held": 6} and batch_counts(emulator) == [6]
    rc, out, _ = command(project, capsys, "status")
    assert "Held after `dbt-llm-batch cancel`" in out and "│ main.triage │             6 │" in out

    project.write(MODEL, triage_model(system="Triage the ticket."))  # a new fingerprint for every row
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 6]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert statuses(project) == {"held": 6, "succeeded": 6}  # the old fingerprint's stay held, as history


def test_cancel_after_the_batch_ended_changes_nothing_and_the_run_harvests_it(project, emulator, provider, capsys):
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    batch_id = emulator.batches()[0]["id"]
    emulator.complete_all()  # ended at the provider, not yet harvested
    rc, out, _ = command(project, capsys, "cancel")
    assert rc == 0
    # The provider's status code and its own message, never the SDK's wording around them (it changes between
    # SDK releases: anthropic 2.17 dropped "Error code:").
    refusal = {"openai": "HTTP 409: ", "anthropic": "HTTP 400: "}[provider]
    assert out.startswith(f"{batch_id}: not cancelled ({refusal}")
    assert "Error code" not in out.splitlines()[0]
    assert out.splitlines()[0].endswith("); the next run harvests it")
    assert project.query("select cancel_requested_at, cancelled_by from main.llm_batch_jobs") == [(None, None)]
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert "held" not in statuses(project)


def test_cancel_with_nothing_in_flight_and_unknown_model(project, emulator, capsys):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.dbt("run", *SELECT)
    emulator.complete_all()
    project.dbt("run", *SELECT)
    rc, out, _ = command(project, capsys, "cancel")
    assert (rc, out.strip()) == (0, "main.triage: no batch in flight; nothing to cancel")
    capsys.readouterr()
    rc = cli(["cancel", "--database", str(project.db_path), "--model", "nope"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (
        "dbt-llm-batch cancel: model nope has no requests in the ledger in schema main"
    )


def test_requeue_gives_failed_rows_new_attempts_without_a_config_change(project, emulator, capsys):
    project.write(MODEL, triage_model(extra_config="llm_max_attempts = 1,"))
    project.dbt("seed")
    emulator.add_fault(prompt_contains="Dark mode", kind="content", content="not json", times=1)
    project.dbt("run", *SELECT)
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query(
        "select ticket_id, llm_status, llm_error from main.triage where llm_status <> 'succeeded'"
    ) == [(5, "failed", "answer is not valid JSON")]
    project.dbt("run", *SELECT)  # attempts used up: not resent
    assert batch_counts(emulator) == [6]

    rc, out, _ = command(project, capsys, "requeue")
    assert (rc, out.strip()) == (
        0,
        "requeued 1 failed request(s) of triage: the next run sends them again, with a fresh set of llm_max_attempts",
    )
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 1]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select count(*) filter (where llm_status = 'succeeded') from main.triage") == [(6,)]
    # The first failure is still in the ledger, marked as not counting.
    assert project.query("select status, error from main.llm_batch_requests where status = 'requeued'") == [
        ("requeued", "answer is not valid JSON")
    ]


@pytest.mark.parametrize("delete", [True, False])
def test_provider_files_deleted_once_results_are_stored(project, emulator, provider, delete):
    extra = "" if delete else "llm_delete_provider_files = false,"
    project.write(MODEL, triage_model(provider=provider, extra_config=extra))
    project.dbt("seed")
    project.dbt("run", *SELECT)
    batch = emulator.batches()[0]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    deleted_at, error = project.query("select files_deleted_at, files_delete_error from main.llm_batch_jobs")[0]
    assert (deleted_at is not None) == delete and error is None
    calls = emulator.stats()["calls"]
    if provider == "openai":
        finished = [b for b in emulator.batches() if b["id"] == batch["id"]][0]
        ids = {finished["input_file_id"], finished["output_file_id"]}
        assert calls.get("DELETE /v1/files/{id}", 0) == (2 if delete else 0)
        face = [f for f in emulator.faces if f.name == "openai"][0]
        assert (ids & set(face.files)) == (set() if delete else ids)
    else:
        assert calls.get("DELETE /v1/messages/batches/{id}", 0) == (1 if delete else 0)
        face = [f for f in emulator.faces if f.name == "anthropic"][0]
        assert (batch["id"] in face.jobs) == (not delete)
    deletes = {k: v for k, v in calls.items() if k.startswith("DELETE")}
    project.dbt("run", *SELECT)  # nothing more to delete: no further call
    assert {k: v for k, v in emulator.stats()["calls"].items() if k.startswith("DELETE")} == deletes


def test_a_failed_delete_is_logged_and_never_fails_the_run(project, emulator):
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.dbt("run", *SELECT)
    emulator.complete_all()
    emulator.add_fault(
        endpoint="DELETE /v1/files/{id}", status_code=400, times=None, message="deletion refused for this test"
    )
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    deleted_at, error = project.query("select files_deleted_at, files_delete_error from main.llm_batch_jobs")[0]
    assert deleted_at is None and "deletion refused for this test" in error
    emulator.clear_faults()
    project.dbt("run", *SELECT)  # tried again on the next run
    assert project.query("select files_deleted_at is not null, files_delete_error from main.llm_batch_jobs") == [
        (True, None)
    ]


def test_requests_whose_job_row_was_deleted_are_reported_and_released(project, emulator, capsys):
    """A deleted llm_batch_jobs row leaves its requests in flight that no run polls or resends: every
    run warns, naming the count and the command; `status` shows them; `release` frees them."""
    project.write(MODEL, triage_model())
    project.dbt("seed")
    project.dbt("run", *SELECT)
    project.release_database()
    project.query("delete from main.llm_batch_jobs")
    project.dbt("run", *SELECT)
    log = (project.root / "logs" / "dbt.log").read_text()
    assert "main.triage: 6 request(s) are in flight under a job missing from llm_batch_jobs" in log
    assert "`dbt-llm-batch release --database " in log and " --schema main --model main.triage`" in log
    assert batch_counts(emulator) == [6]  # nothing is resent on its own: their batch may be running
    rc, out, _ = command(project, capsys, "status")
    assert rc == 0 and "In-flight requests whose job is missing from llm_batch_jobs" in out

    rc, out, _ = command(project, capsys, "release")
    assert rc == 0
    assert (
        "released 6 request(s) whose job is missing from llm_batch_jobs: the next run sends them. "
        "WARNING: if their batch ran at the provider, they are paid twice"
    ) in out
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 6]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select count(*) from main.triage where llm_status = 'succeeded'") == [(6,)]
    assert statuses(project) == {"released": 6, "succeeded": 6}
