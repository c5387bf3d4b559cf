"""Batch-level failures that are not the requests' fault, or only some requests' fault.

- OpenAI validation errors that name input lines (`Batch.errors.data[].line`): the named requests
  fail with the provider's message (an attempt used); the others did nothing wrong and are voided,
  to be resubmitted without using an attempt. `line` is 1-based over the request file; each
  request's line is recorded in the ledger (`file_line`, request_files.py).
- `token_limit_exceeded` (OpenAI's enqueued-token limit): the batch's requests are voided with a
  `not_before` the planner honours: 10 min, doubling with each consecutive occurrence, at most 6 h.
All of it runs inside harvest.settle's transaction, so it is settled exactly once.
"""

from __future__ import annotations

import pyarrow as pa

from dbt_llm_batch.providers.base import BatchState
from dbt_llm_batch.runlog import logger as run_log

BACKOFF_FIRST_SECONDS = 600
BACKOFF_MAX_SECONDS = 6 * 3600
TOKEN_LIMIT = "token_limit_exceeded"


def backoff_seconds(occurrence: int) -> int:
    """Wait before resubmitting after the `occurrence`-th consecutive token_limit_exceeded (1, 2, ...)."""
    return min(BACKOFF_FIRST_SECONDS * 2 ** (occurrence - 1), BACKOFF_MAX_SECONDS)


def consecutive_token_limits(ledger) -> int:
    """How many of this model's most recently harvested batches failed on the token limit, in a row."""
    rows = ledger.con.execute(
        f"""select coalesce(error, '') like '%{TOKEN_LIMIT}%' from {ledger.table('llm_batch_jobs')}
            where model = ? and harvested_at is not null order by harvested_at desc, ended_at desc limit 64""",
        [ledger.model]).fetchall()
    n = 0
    for (hit,) in rows:
        if not hit:
            break
        n += 1
    return n


def void_details(ledger, jobs: list[tuple[str, BatchState]]) -> tuple[list, list]:
    """Per ended job: the reason its unanswered requests are voided with (None: the default) and the
    back-off in seconds before they may be resubmitted (None: at once)."""
    reasons, backoffs = [], []
    occurrence = consecutive_token_limits(ledger) + 1 if any(s.token_limit for _, s in jobs) else 0
    for _, state in jobs:
        if state.token_limit:
            wait = backoff_seconds(occurrence)
            reasons.append(f"{state.error} (resubmitted after a {wait // 60}-minute back-off: "
                           f"token limit hit {occurrence} time(s) in a row)")
            backoffs.append(wait)
        elif state.line_errors:
            reasons.append("the batch failed validation on other request lines; this request was not at "
                           "fault and is resubmitted")
            backoffs.append(None)
        else:
            reasons.append(None)
            backoffs.append(None)
    return reasons, backoffs


def line_errors_table(jobs: list[tuple[str, BatchState]]) -> pa.Table:
    rows = [(job_id, int(line), message) for job_id, state in jobs for line, message in state.line_errors.items()]
    return pa.table({"job_id": pa.array([r[0] for r in rows], pa.string()),
                     "line": pa.array([r[1] for r in rows], pa.int64()),
                     "message": pa.array([r[2] for r in rows], pa.string())})


def fail_named_lines(con, requests: str, max_attempts: int) -> None:
    """Fail the requests whose lines validation named (table __llm_line_errors), with its message.
    Like any failure it uses an attempt, and is final once the attempts are used up."""
    con.execute(
        f"""update {requests} r set status = 'failed', error = x.message, completed_at = now(),
              is_final = x.earlier_failures + 1 >= ?
            from (select n.custom_id, n.job_id, e.message,
                         (select count(*) from {requests} p where p.model = n.model and p.key = n.key
                            and p.fingerprint = n.fingerprint and p.status = 'failed') as earlier_failures
                  from (select custom_id, job_id, model, key, fingerprint,
                               -- ledgers before version 9 wrote request files in custom_id order
                               coalesce(file_line, row_number() over (partition by job_id order by custom_id)) as line
                        from {requests} where job_id in (select job_id from __llm_line_errors)) n
                  join __llm_line_errors e using (job_id, line)) x
            where r.custom_id = x.custom_id and r.job_id = x.job_id and r.status in ('queued', 'submitted')""",
        [max_attempts])


def log_backoffs(ledger, jobs: list[tuple[str, BatchState]]) -> None:
    for job_id, state in jobs:
        if not state.token_limit:
            continue
        n, until = ledger.con.execute(
            f"""select count(*), max(not_before) from {ledger.table('llm_batch_requests')}
                where job_id = ? and status = 'voided'""", [job_id]).fetchall()[0]
        if n:
            run_log().warning(f"{ledger.model}: a batch failed on the provider's enqueued token limit "
                              f"(token_limit_exceeded); its {n} request(s) will be resubmitted after "
                              f"{until:%Y-%m-%d %H:%M:%S %Z}")
