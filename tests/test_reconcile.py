"""Reconciliation of interrupted submissions, through real dbt runs against the sandbox: a create that
never left (connection refused) is voided at once; a run killed before its create reached the
provider is resent as soon as the provider's batch list shows nothing that could be it; a batch that
could be it holds the requests only until it ends and its custom_ids confirm or rule it out, among
decoys of the same size (and, for OpenAI, past the first page of the list); whatever reconciliation
holds is shown by `dbt-llm-batch status` and freed by `dbt-llm-batch release`."""

from __future__ import annotations

import collections
import json
import socket
import subprocess
import sys
import tempfile

import anthropic
import openai
from helpers import (
    PROVIDER_MODELS,
    assert_triage_rows_answered,
    batch_counts,
    command,
    dbt_subprocess,
    log_text,
    sorted_batches,
    succeeded_custom_ids,
    triage_model,
)

from dbt_llm_batch.pipeline import tempdirs

MODEL, SELECT = "models/triage.sql", ["-s", "triage"]
CREATE = {"openai": "POST /v1/batches", "anthropic": "POST /v1/messages/batches"}


def jobs(project) -> list[tuple]:
    return project.query("select status, batch_id is not null from main.llm_batch_jobs order by created_at")


def assert_all_answered_once(project, emulator) -> None:
    """Every row succeeded with its own answer, and the provider answered (billed) each key once."""
    assert_triage_rows_answered(project)
    key_of = dict(project.query("select custom_id, key from main.llm_batch_requests"))
    billed = collections.Counter(key_of[c] for c in succeeded_custom_ids(emulator) if c in key_of)
    assert sorted(billed.values()) == [1] * 6, billed


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refuse_creates(monkeypatch, provider: str) -> None:
    """The SDK's create call goes to a port nothing listens on (the upload, if any, still reaches the
    sandbox): the real SDK raises its APIConnectionError caused by a refused connection."""
    dead = f"http://127.0.0.1:{closed_port()}"
    if provider == "openai":
        from openai.resources.batches import Batches

        original = Batches.create
        monkeypatch.setattr(
            Batches,
            "create",
            lambda self, **kw: original(self._client.with_options(base_url=dead + "/v1").batches, **kw),
        )
    else:
        from anthropic.resources.messages.batches import Batches

        original = Batches.create
        monkeypatch.setattr(
            Batches,
            "create",
            lambda self, **kw: original(self._client.with_options(base_url=dead).messages.batches, **kw),
        )


def openai_files(emulator) -> dict:
    return [f for f in emulator.faces if f.name == "openai"][0].files


# -- A: a create that never left, and a run killed before its create ---------------------------------


def test_a_create_refused_on_connect_is_voided_at_once(project, emulator, provider, monkeypatch):
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")
    with monkeypatch.context() as patch:
        refuse_creates(patch, provider)
        project.dbt("run", *SELECT)
    assert batch_counts(emulator) == []
    # Nothing was sent: no reconciliation, no hold; the requests are planned again at once.
    assert jobs(project) == [("voided", False)]
    assert project.query("select status, count(*) from main.llm_batch_requests group by 1") == [("voided", 6)]
    assert "Connection refused" in log_text(project) or "Connection error" in log_text(project)
    if provider == "openai":  # the uploaded request file is not left at the provider
        assert openai_files(emulator) == {}
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert_all_answered_once(project, emulator)


def kill_at(project, tmp_path, point: str) -> None:
    marker = tmp_path / "crash-marker"
    project.release_database()
    killed = dbt_subprocess(project, {"DBT_LLM_BATCH_CRASH_AT": point, "DBT_LLM_BATCH_CRASH_MARKER": str(marker)})
    assert killed.returncode == -9, killed.stdout[-2000:]
    assert marker.read_text() == point


def test_a_run_killed_before_its_create_is_resent_when_the_provider_has_no_such_batch(
    project, emulator, provider, tmp_path
):
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")
    kill_at(project, tmp_path, "before_create")
    assert batch_counts(emulator) == []
    assert jobs(project) == [("submitting", False)]
    project.dbt("run", *SELECT)  # the provider lists no batch that could be it: voided and sent once
    assert batch_counts(emulator) == [6]
    assert "cannot be matched to a provider batch yet" not in log_text(project)
    if provider == "openai":  # the killed run's uploaded file is deleted once the submission is voided
        assert [f["id"] for f in openai_files(emulator).values()] == [sorted_batches(emulator)[0]["input_file_id"]]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert_all_answered_once(project, emulator)


def test_a_run_killed_after_its_upload_deletes_the_file_and_resends(project, emulator, tmp_path):
    project.write(MODEL, triage_model(provider="openai"))
    project.dbt("seed")
    kill_at(project, tmp_path, "after_upload")
    assert len(openai_files(emulator)) == 1 and batch_counts(emulator) == []
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6]
    # The orphaned upload (its id never reached the ledger) is found by its name and deleted.
    assert [f["id"] for f in openai_files(emulator).values()] == [sorted_batches(emulator)[0]["input_file_id"]]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert_all_answered_once(project, emulator)


def test_a_held_submission_is_shown_and_released_with_a_warning(project, emulator, capsys):
    """An Anthropic create answered 5xx may have reached the provider; while a batch of the same size
    created since then has not ended, its requests are held: the run log and `status` say so, and
    `release` frees them, warning that they are paid twice if that batch was this submission."""
    project.write(MODEL, triage_model(provider="anthropic"))
    project.dbt("seed")
    emulator.add_fault(endpoint=CREATE["anthropic"], status_code=500, times=1)
    project.dbt("run", *SELECT)
    other = anthropic.Anthropic().messages.batches.create(
        requests=[
            {
                "custom_id": f"other_{i}",
                "params": {
                    "model": PROVIDER_MODELS["anthropic"],
                    "max_tokens": 10,
                    "messages": [{"role": "user", "content": f"other {i}"}],
                },
            }
            for i in range(6)
        ]
    )  # someone else's batch of the same size, still running
    project.dbt("run", *SELECT)
    assert jobs(project) == [("submitting", False)]
    assert "its 6 request(s) are held, not resent" in log_text(project)
    assert "dbt-llm-batch release" in log_text(project)
    rc, out, _ = command(project, capsys, "status")
    assert rc == 0 and "Interrupted submissions held by reconciliation" in out
    section = out.split("Interrupted submissions held by reconciliation")[1].split("Cost per model")[0]
    job_id = project.query("select job_id from main.llm_batch_jobs")[0][0]
    assert "main.triage" in section and job_id in section and "submitting" in section

    rc, out, _ = command(project, capsys, "release")
    assert rc == 0
    assert "released 6 request(s) of 1 interrupted submission(s)" in out
    assert "paid twice" in out
    project.dbt("run", *SELECT)
    assert batch_counts(emulator) == [6, 6]  # the other batch, then ours
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert_all_answered_once(project, emulator)
    assert other.id not in {r[0] for r in project.query("select batch_id from main.llm_batch_jobs")}


# -- B: decoys of the same size -------------------------------------------------------------------


def anthropic_decoy(emulator) -> str:
    batch = anthropic.Anthropic().messages.batches.create(
        requests=[
            {
                "custom_id": f"decoy_{i}",
                "params": {
                    "model": PROVIDER_MODELS["anthropic"],
                    "max_tokens": 10,
                    "messages": [{"role": "user", "content": f"decoy {i}"}],
                },
            }
            for i in range(6)
        ]
    )
    emulator.advance(batch.id, "ended")
    return batch.id


def openai_decoy(emulator, client) -> str:
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"decoy_{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": PROVIDER_MODELS["openai"], "messages": [{"role": "user", "content": f"decoy {i}"}]},
            }
        )
        + "\n"
        for i in range(6)
    )
    uploaded = client.files.create(file=("decoy.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"owner": "someone else"},
    )
    emulator.advance(batch.id, "completed")
    return batch.id


def test_the_interrupted_batch_is_adopted_among_ended_decoys_of_the_same_size(project, emulator, provider, tmp_path):
    """Killed between `create` and the ledger write, among batches of the same request count that
    ended with other custom_ids, some newer than ours (OpenAI: over 100 of them, so ours is past the
    list's first page): the next runs adopt exactly ours, and nothing is sent twice."""
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")
    client = openai.OpenAI()
    make_decoy = (
        (lambda: anthropic_decoy(emulator)) if provider == "anthropic" else (lambda: openai_decoy(emulator, client))
    )
    older = [make_decoy() for _ in range(2)]
    kill_at(project, tmp_path, "after_create")
    ours = sorted_batches(emulator)[-1]["id"]
    newer = [make_decoy() for _ in range(3 if provider == "anthropic" else 101)]
    decoys = set(older + newer)
    assert ours not in decoys and len(batch_counts(emulator)) == len(decoys) + 1

    project.dbt("run", *SELECT)
    if provider == "anthropic":  # ours has not ended: nothing can confirm it, so it is held
        assert jobs(project) == [("submitting", False)]
        assert "its 6 request(s) are held, not resent" in log_text(project)
    else:  # the metadata token names it
        assert project.query("select batch_id from main.llm_batch_jobs") == [(ours,)]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert project.query("select batch_id from main.llm_batch_jobs") == [(ours,)]
    assert len(batch_counts(emulator)) == len(decoys) + 1, "nothing was sent again"
    assert_all_answered_once(project, emulator)
    if provider == "openai":  # the adopted batch's files are deleted once harvested, like any other's
        adopted = [b for b in emulator.batches() if b["id"] == ours][0]
        assert {adopted["input_file_id"], adopted["output_file_id"]}.isdisjoint(openai_files(emulator))


def test_an_interrupted_submission_with_only_decoys_is_resent(project, emulator, provider):
    """A create answered 5xx that never made a batch, among ended decoys of the same size: the decoys'
    custom_ids rule them out, so the requests are sent again at once."""
    project.write(MODEL, triage_model(provider=provider))
    project.dbt("seed")
    client = openai.OpenAI()
    make_decoy = (
        (lambda: anthropic_decoy(emulator)) if provider == "anthropic" else (lambda: openai_decoy(emulator, client))
    )
    emulator.add_fault(endpoint=CREATE[provider], status_code=500, times=1)
    project.dbt("run", *SELECT)
    assert jobs(project) == [("submitting", False)]
    decoys = [make_decoy() for _ in range(3 if provider == "anthropic" else 101)]
    project.dbt("run", *SELECT)
    assert len(batch_counts(emulator)) == len(decoys) + 1
    ours = sorted_batches(emulator)[-1]["id"]
    assert ours not in decoys
    assert [r[0] for r in project.query("select status from main.llm_batch_jobs order by created_at")] == [
        "voided",
        "validating" if provider == "openai" else "in_progress",
    ]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert_all_answered_once(project, emulator)


# -- D: nothing left on disk or at the provider by a killed run -----------------------------------


def ours(directory) -> list:
    return [p for p in directory.iterdir() if p.name.startswith("dbt_llm_batch_")]


def test_a_killed_runs_request_files_are_removed_by_the_next_run(project, emulator, tmp_path, monkeypatch):
    """Killed mid-submission, a run leaves its request files (the prompts) in $TMPDIR: the next run
    removes the directories of processes that no longer exist, and only those."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # recomputed from TMPDIR
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live_dir = tmp / f"dbt_llm_batch_{live.pid}_{tempdirs._host()}_abc"
        live_dir.mkdir()
        project.write(MODEL, triage_model())
        project.dbt("seed")
        kill_at(project, tmp_path, "after_upload")
        left = [p for p in ours(tmp) if p != live_dir]
        files = list(left[0].rglob("requests-0.jsonl"))  # in the sender's own subdirectory (send.py)
        assert len(left) == 1 and len(files) == 1 and "Subject: " in files[0].read_text()
        project.dbt("run", *SELECT)
        assert ours(tmp) == [live_dir], "a live process's directory is left alone"
    finally:
        live.kill()
        live.wait()


# -- F: which call failed ---------------------------------------------------------------------------


def test_a_failed_upload_is_reported_as_an_upload_and_resent(project, emulator):
    project.write(MODEL, triage_model(extra_config="llm_retry_budget_seconds = 0,"))
    project.dbt("seed")
    emulator.add_fault(endpoint="POST /v1/files", status_code=500, times=1)
    project.dbt("run", *SELECT)
    log = log_text(project)
    assert "main.triage: uploading the request file failed (" in log
    assert "upload the request file: HTTP 500" in log
    assert "no batch was created, so its requests are sent again by the next run" in log
    assert "creating a batch failed" not in log
    assert emulator.stats()["calls"].get("POST /v1/batches", 0) == 0
    assert jobs(project) == [("uploading", False)]
    project.dbt("run", *SELECT)  # `create` was never called: no batch to wait for
    assert batch_counts(emulator) == [6]
    emulator.complete_all()
    project.dbt("run", *SELECT)
    assert_all_answered_once(project, emulator)
