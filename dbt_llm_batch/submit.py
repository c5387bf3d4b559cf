"""Submission: write each planned chunk as a JSONL file, record the intent, then call the provider.

The order is the ledger's first invariant: the job intents and their 'queued' request rows are
committed (all chunks at once) before the first upload, so no request can be billed without the ledger knowing it. The
provider's batch metadata carries the job id, which lets a later run adopt a batch whose id was
never recorded (a crash between `create` and the ledger write).

Job statuses before the batch id is known: 'intent' (written, the provider never asked: voided at
once by the next run) and 'submitting' (the upload or `create` was called: it may exist at the
provider, so reconciliation asks it before anything is resent).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pyarrow as pa

from dbt_llm_batch import crashpoints
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.planner import PLAN
from dbt_llm_batch.providers.base import BatchProvider
from dbt_llm_batch.providers.calls import ProviderUnavailable, describe, is_transient, status_of
from dbt_llm_batch.runlog import logger

WRITE_BATCH_ROWS = 10_000


def write_jsonl(con, line_sql: str, chunk: int, path: str, rows: str = PLAN) -> int:
    """Write one chunk's request lines to `path`, streaming; returns the number of lines.

    Each line is built in SQL with its newline, so an Arrow batch of lines is already the file's
    bytes: its value buffer is written as is, without a Python object per line.
    """
    reader = con.sql(
        f"select {line_sql} || chr(10) as line from {rows} where chunk = {int(chunk)} order by custom_id"
    ).to_arrow_reader(WRITE_BATCH_ROWS)
    n = 0
    with open(path, "wb") as f:
        for batch in reader:
            lines = batch.column(0)
            if lines.type != pa.large_string():
                lines = lines.cast(pa.large_string())
            offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)[lines.offset:lines.offset + len(lines) + 1]
            f.write(memoryview(lines.buffers()[2])[offsets[0]:offsets[-1]])
            n += len(lines)
    return n


def submit_chunks(ledger: Ledger, provider: BatchProvider, chunks: list[int], rows: str = PLAN) -> list[str]:
    """Submit each given chunk of the plan as one batch; returns the provider batch ids. `rows` is
    the plan with `prompt` and `row_json` (planner.plan_rows)."""
    line_sql = provider.request_line_sql()
    batch_ids = []
    job_ids = ledger.write_intents(provider.name, provider.config.model, rows, chunks)
    crashpoints.reach("after_intents")
    attempted = 0
    try:
        with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_") as directory:
            for chunk, job_id in job_ids.items():
                path = os.path.join(directory, f"requests-{chunk}.jsonl")
                write_jsonl(ledger.con, line_sql, chunk, path, rows)
                attempted += 1
                # From here the provider may have the batch: reconciliation asks it (an 'intent'
                # never got this far and is voided without asking).
                ledger.update_job(job_id, status="submitting")
                try:
                    submission = provider.submit(path, token=job_id, model_name=ledger.model)
                except Exception as exc:
                    if not (isinstance(exc, ProviderUnavailable) or is_transient(exc)):
                        _void_if_refused(ledger, job_id, exc)
                        raise
                    _stop_after_failed_create(ledger, job_id, exc)
                    break
                crashpoints.reach("after_create")
                ledger.record_submission(job_id, submission.batch_id, submission.input_file_id, submission.status)
                batch_ids.append(submission.batch_id)
                os.remove(path)  # prompts do not linger on disk
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
