"""Submission: record the intents of the written request files (request_files.py), then call the provider;
and reconciliation of the submissions a run could not finish.

The order is the ledger's first invariant: the job intents and their 'queued' request rows are
committed (all files at once) before the first upload, so no request can be billed without the ledger knowing it. The
provider's batch metadata carries the job id, which lets a later run adopt a batch whose id was
never recorded (a crash between `create` and the ledger write).

Job statuses before the batch id is known: 'intent' (written, the provider never asked: voided at
once by the next run), 'uploading' (the request file's upload was called, `create` was not: no
batch can exist, so it is voided too, and a file the upload left at the provider is deleted) and
'submitting' (`create` was called: it may exist at the provider, so reconciliation asks it before
anything is resent).
"""

from __future__ import annotations

import dataclasses
import os

from dbt_llm_batch import output_schema
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.locks import database_path
from dbt_llm_batch.ledger.status import JobStatus
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import crashpoints, interrupt, pool
from dbt_llm_batch.pipeline.progress import Progress
from dbt_llm_batch.pipeline.request_files import RequestFile
from dbt_llm_batch.providers.base import UNRESOLVED, BatchProvider
from dbt_llm_batch.providers.calls import ProviderUnavailable, describe, is_transient, status_of

NEVER_SENT = "submission interrupted before reaching the provider"


@dataclasses.dataclass(frozen=True)
class Submitted:
    """What submit_chunks did with a run's request files. The files before `first_unsent` are the
    ledger's, each in a job: created (`batch_ids`, one per file, in order), or, the last of them,
    failed and left to reconciliation (it may have reached the provider) or voided. The files from
    `first_unsent` on were never attempted: their requests wait as deferred. This is the one answer to
    "which requests are in a job", so a request is never deferred while its job may be billed."""

    batch_ids: list[str]
    first_unsent: int
    interrupted: bool = False  # Ctrl-C stopped it: the deferred requests wait for that, not for a cap


def submit_chunks(
    ledger: Ledger,
    provider: BatchProvider,
    files: list[RequestFile],
    sent_rows: str,
    members: str | None = None,
    answer_rows: str | None = None,
    per_row_variant: bool = False,
) -> Submitted:
    """Submit each written request file as one batch (Submitted says which files a job holds). `sent_rows` is
    the plan's rows with the file (`chunk`) and `line` each was written to (plan.plan_rows with `sent`);
    `members` the other rows each request answers (plan.build_plan), recorded with the intents;
    `answer_rows`: `sent_rows` without prompt and row, for the row answers (Ledger.write_intents);
    `per_row_variant`: the rows carry their evaluation variant (Ledger.write_intents)."""
    batch_ids = []
    job_ids = ledger.write_intents(
        provider.name,
        provider.config.model,
        sent_rows,
        [f.chunk for f in files],
        members=members,
        answer_rows=answer_rows,
        output_schema=output_schema.recorded(provider.config.output_json_schema()),
        per_row_variant=per_row_variant,
        provider_options=pool.recorded_options(provider.config),
    )
    crashpoints.reach("after_intents")
    attempted = 0
    interrupted = False
    submitting = Progress(f"{ledger.model}: submitting", sum(f.requests for f in files), "requests")
    try:
        for request_file in files:
            job_id = job_ids[request_file.chunk]
            assert request_file.path is not None  # a dry run writes no file and submits nothing
            if interrupt.cancelled():  # Ctrl-C: nothing more is sent; the files not attempted wait
                log.warning(
                    f"{ledger.model}: the run was interrupted (Ctrl-C): {sum(f.requests for f in files[attempted:])} "
                    "request(s) not sent wait for the next run, nothing is lost"
                )
                interrupted = True
                break
            attempted += 1
            # From here a file may be at the provider, but no batch: `create` was not called.
            ledger.mark_uploading(job_id)
            try:
                file_id = provider.upload(request_file.path, token=job_id)
            except Exception as exc:
                if not (isinstance(exc, ProviderUnavailable) or is_transient(exc)):
                    # Refused (a 4xx): no file and no batch exist; the requests go back to the queue.
                    void_submission(ledger, job_id, f"the provider refused the upload ({describe(exc)}); resubmitted")
                    ledger.update_job(job_id, error=describe(exc))
                    raise
                _stop_after_failed_upload(ledger, job_id, exc)
                break
            crashpoints.reach("after_upload")
            # From here the provider may have the batch: reconciliation asks it before anything is resent.
            ledger.mark_submitting(job_id, file_id)
            crashpoints.reach("before_create")
            try:
                submission = provider.create(request_file.path, file_id, token=job_id, model_name=ledger.model)
            except Exception as exc:
                if not (isinstance(exc, ProviderUnavailable) or is_transient(exc)):
                    _void_if_refused(ledger, job_id, exc)
                    raise
                _stop_after_failed_create(ledger, job_id, exc)
                break
            crashpoints.reach("after_create")
            ledger.record_submission(job_id, submission.batch_id, submission.input_file_id, submission.status)
            batch_ids.append(submission.batch_id)
            os.remove(request_file.path)  # prompts do not linger on disk
            submitting.update(submitting.done + request_file.requests)
    except BaseException:
        # The failing chunk is left to reconciliation (it may have reached the provider); chunks never
        # attempted go back to waiting, so nothing is lost even for rows the model no longer selects.
        ledger.return_to_deferred(list(job_ids.values())[attempted:])
        raise
    if attempted < len(job_ids):  # stopped after a failed create or Ctrl-C: the rest wait for the next run
        ledger.return_to_deferred(list(job_ids.values())[attempted:])
    submitting.finish()
    return Submitted(batch_ids, attempted, interrupted)


def never_sent(exc: BaseException) -> bool:
    """The connection was refused: the request never left this machine (both SDKs raise their
    APIConnectionError with the socket's ConnectionRefusedError as its cause). A timeout or a
    connection dropped later proves nothing: the request may have arrived."""
    seen = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ConnectionRefusedError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _void_if_refused(ledger: Ledger, job_id: str, exc: BaseException) -> bool:
    """A 4xx answer to `create` (429 included) means the provider refused it, and a refused connection
    means it never got it: no batch exists, so the requests go back to the queue at once (an
    uploaded file is deleted by the run, reconcile.delete_provider_files). A 5xx, a timeout or a
    dropped connection proves nothing: the batch may exist, and reconciliation finds out."""
    status = status_of(exc)
    if status is None and never_sent(exc):
        reason = f"the provider could not be reached ({describe(exc)}): nothing was sent; resubmitted"
    elif status is None or status >= 500:
        return False
    else:
        reason = f"the provider refused the batch ({describe(exc)}); resubmitted"
    ledger.void_job(job_id, reason)
    ledger.mark_job_voided(job_id, error=describe(exc))
    return True


def _stop_after_failed_create(ledger: Ledger, job_id: str, exc: BaseException) -> None:
    """Throttled or failing provider: no more chunks this run (they wait as deferred); the run goes on."""
    if _void_if_refused(ledger, job_id, exc):
        fate = "its requests will be resubmitted by the next run"
    else:
        ledger.update_job(job_id, error=describe(exc))
        fate = "it may have reached the provider, so its requests are held until reconciliation can tell"
    log.warning(
        f"{ledger.model}: creating a batch failed ({describe(exc)}); {fate}; the remaining chunks wait for the next run"
    )


def _stop_after_failed_upload(ledger: Ledger, job_id: str, exc: BaseException) -> None:
    """The upload kept failing: no batch was created. The job stays 'uploading' for reconciliation,
    which voids it and deletes a file the provider may have kept."""
    ledger.update_job(job_id, error=describe(exc))
    log.warning(
        f"{ledger.model}: uploading the request file failed ({describe(exc)}); no batch was created, "
        "so its requests are sent again by the next run; the remaining chunks wait for the next run"
    )


def void_submission(ledger: Ledger, job_id: str, reason: str, input_file_id: str | None = None) -> None:
    """The submission never made a batch: its requests are planned again (no attempt used). A file it
    uploaded is recorded on the job, and deleted at the provider (reconcile.delete_provider_files)."""
    ledger.void_job(job_id, reason)
    ledger.mark_job_voided(job_id, input_file_id=input_file_id or None)


# The job error of a submission reconciliation holds (UNRESOLVED): the only ones `release` may void.
HELD_BY_RECONCILIATION = "held by reconciliation: a batch that could be this submission has not ended"


def reconcile(ledger: Ledger, get_provider, job: dict, run_started) -> None:
    """A job without a batch id whose run died (or whose upload or `create` failed). Adopt its batch,
    void it when no batch at the provider can be it, or hold it (leave it, and its requests, alone)
    while a batch that could be it has not ended. `get_provider()` gives the run's provider."""
    if job["status"] == JobStatus.INTENT:  # the run died before asking the provider (submit_chunks)
        void_submission(ledger, job["job_id"], NEVER_SENT)
        return
    since = job["created_at"].timestamp()
    if job["status"] == JobStatus.UPLOADING:  # `create` was never called: no batch can exist
        file_id = ledger.con.execute(
            f"select input_file_id from {ledger.table('llm_batch_jobs')} where job_id = ?", [job["job_id"]]
        ).fetchall()[0][0]
        if file_id is None:
            try:  # an upload whose answer never reached the ledger: found by its name, to delete it
                file_id = get_provider().find_upload(job["job_id"], since)
            except ProviderUnavailable:
                raise  # asked again by the next run
            except Exception as exc:  # a file left behind costs nothing: never fail the run for it
                log.warning(
                    f"{ledger.model}: could not look for the file an interrupted upload of "
                    f"{job['job_id']} may have left at the provider ({describe(exc)})"
                )
        void_submission(ledger, job["job_id"], NEVER_SENT, file_id)
        return
    if job["created_at"] >= run_started:
        # This run's own failed `create`: the provider may still be creating it, so it is asked by
        # the next run, not seconds later by this one's wait loop.
        return
    requests, jobs = ledger.table("llm_batch_requests"), ledger.table("llm_batch_jobs")
    custom_ids = {
        r[0]
        for r in ledger.con.execute(f"select custom_id from {requests} where job_id = ?", [job["job_id"]]).fetchall()
    }
    known = frozenset(
        r[0] for r in ledger.con.execute(f"select batch_id from {jobs} where batch_id is not null").fetchall()
    )
    found = get_provider().find_submission(job["job_id"], since, custom_ids, known_batch_ids=known)
    if found == UNRESOLVED:
        # Recorded on the job: `release` frees only submissions a run looked up and could not decide.
        ledger.update_job(job["job_id"], error=HELD_BY_RECONCILIATION)
        log.warning(
            f"{ledger.model}: submission {job['job_id']} was interrupted and cannot be matched to a provider batch "
            f"yet (a batch of the same size created since then has not ended): its {len(custom_ids)} request(s) "
            f"are held, not resent, until that batch ends and its custom_ids confirm or rule it out. To send them "
            f"now: `dbt-llm-batch release --database {database_path(ledger.con)} --schema {ledger.schema} --model "
            f"{ledger.model}` (if that batch is this submission, they are paid twice)"
        )
    elif found:
        ledger.record_submission(job["job_id"], found.batch_id, found.input_file_id, found.status)
        log.info(f"{ledger.model}: adopted batch {found.batch_id} submitted by an interrupted run")
    else:
        void_submission(ledger, job["job_id"], "submission interrupted; no batch at the provider is it; resubmitted")
