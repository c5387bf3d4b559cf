"""Submission: write each planned chunk as a JSONL file, record the intent, then call the provider.

The order is the ledger's first invariant: the job intent and its 'queued' request rows are
committed before the upload, so no request can be billed without the ledger knowing it. The
provider's batch metadata carries the job id, which lets a later run adopt a batch whose id was
never recorded (a crash between `create` and the ledger write).
"""

from __future__ import annotations

import os
import tempfile

from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.planner import PLAN
from dbt_llm_batch.providers.base import BatchProvider

WRITE_BATCH_ROWS = 10_000


def write_jsonl(con, line_sql: str, chunk: int, path: str) -> int:
    """Write one chunk's request lines to `path`, streaming; returns the number of lines."""
    reader = con.sql(
        f"select {line_sql} as line from {PLAN} where chunk = ? order by custom_id", params=[chunk]
    ).to_arrow_reader(WRITE_BATCH_ROWS)
    n = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for batch in reader:
            lines = batch.column(0).to_pylist()
            f.write("\n".join(lines))
            f.write("\n")
            n += len(lines)
    return n


def submit_plan(ledger: Ledger, provider: BatchProvider, n_chunks: int) -> list[str]:
    """Submit every chunk of the plan as one batch each; returns the provider batch ids."""
    line_sql = provider.request_line_sql()
    batch_ids = []
    with tempfile.TemporaryDirectory(prefix="dbt_llm_batch_") as directory:
        for chunk in range(n_chunks):
            path = os.path.join(directory, f"requests-{chunk}.jsonl")
            write_jsonl(ledger.con, line_sql, chunk, path)
            job_id = ledger.write_intent(provider.name, provider.config.model, PLAN, chunk)
            submission = provider.submit(path, token=job_id, model_name=ledger.model)
            ledger.record_submission(job_id, submission.batch_id, submission.input_file_id, submission.status)
            batch_ids.append(submission.batch_id)
            os.remove(path)  # prompts do not linger on disk
    return batch_ids
