"""Submission: record the intents of the written request files (request_files.py), then call the provider.

The order is the ledger's first invariant: the job intents and their 'queued' request rows are
committed (all files at once) before the first upload, so no request can be billed without the ledger knowing it. The
provider's batch metadata carries the job id, which lets a later run adopt a batch whose id was
never recorded (a crash between `create` and the ledger write).

Job statuses before the batch id is known: 'intent' (written, the provider never asked: voided at
once by the next run) and 'submitting' (the upload or `create` was called: it may exist at the
provider, so reconciliation asks it before anything is resent).
"""

from __future__ import annotations

import os

from dbt_llm_batch import crashpoints
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.request_files import RequestFile
from dbt_llm_batch.providers.base import BatchProvider
from dbt_llm_batch.providers.calls import ProviderUnavailable, describe, is_transient, status_of
from dbt_llm_batch.runlog import logger

def submit_chunks(ledger: Ledger, provider: BatchProvider, files: list[RequestFile], sent_rows: str) -> list[str]:
    """Submit each written request file as one batch; returns the provider batch ids. `sent_rows` is
    the plan's rows with the file (`chunk`) and `line` each was written to (request_files.sent_rows)."""
    batch_ids = []
    job_ids = ledger.write_intents(provider.name, provider.config.model, sent_rows, [f.chunk for f in files])
    crashpoints.reach("after_intents")
    attempted = 0
    try:
        for request_file in files:
            job_id = job_ids[request_file.chunk]
            attempted += 1
            # From here the provider may have the batch: reconciliation asks it (an 'intent'
            # never got this far and is voided without asking).
            ledger.update_job(job_id, status="submitting")
            try:
                submission = provider.submit(request_file.path, token=job_id, model_name=ledger.model)
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
    except BaseException:
        # The failing chunk is left to reconciliation (it may have reached the provider); chunks never
        # attempted go back to waiting, so nothing is lost even for rows the model no longer selects.
        ledger.return_to_deferred(list(job_ids.values())[attempted:])
        raise
    if attempted < len(job_ids):  # stopped after a failed create: the rest wait for the next run
        ledger.return_to_deferred(list(job_ids.values())[attempted:])
    return batch_ids


def _void_if_refused(ledger: Ledger, job_id: str, exc: BaseException) -> bool:
    """A 4xx answer to `create` (429 included) means the provider refused it: no batch exists, so the
    requests go back to the queue at once. A 5xx, a timeout or a dropped connection proves nothing:
    the batch may exist, and reconciliation finds out."""
    status = status_of(exc)
    if status is None or status >= 500:
        return False
    ledger.void_job(job_id, f"the provider refused the batch ({describe(exc)}); resubmitted")
    ledger.update_job(job_id, status="voided", error=describe(exc))
    return True


def _stop_after_failed_create(ledger: Ledger, job_id: str, exc: BaseException) -> None:
    """Throttled or failing provider: no more chunks this run (they wait as deferred); the run goes on."""
    if _void_if_refused(ledger, job_id, exc):
        fate = "its requests will be resubmitted by the next run"
    else:
        fate = "it may have reached the provider, so its requests are held until reconciliation can tell"
    logger().warning(f"{ledger.model}: creating a batch failed ({describe(exc)}); {fate}; the remaining chunks "
                     "wait for the next run")
