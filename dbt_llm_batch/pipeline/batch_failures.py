"""Batch-level failures that are not the requests' fault, or only some requests' fault.

- OpenAI validation errors that name input lines (`Batch.errors.data[].line`): the named requests
  fail with the provider's message, final at once (the same line would fail validation again, and
  fail its whole batch with it: retrying it would hold the good rows for another batch window);
  the others did nothing wrong and are voided, to be resubmitted without using an attempt. `line`
  is 1-based over the request file; each request's line is recorded in the ledger (`file_line`,
  request_files.py).
- `token_limit_exceeded` (OpenAI's enqueued-token limit): the batch's requests are voided with a
  `not_before` the planner honours: 10 min, doubling with each consecutive occurrence, at most 6 h.
- Any other failed batch (errors that name no line): nothing says whether it was the provider's
  passing trouble or something about these requests, so they are voided with the same growing
  back-off, and after GIVE_UP_AFTER such failures in a row of the same request they fail, final,
  with what the provider said and what to do (fix, then `dbt-llm-batch requeue`).
All of it runs inside outcomes.settle's transaction, so it is settled exactly once.
"""

from __future__ import annotations

import pyarrow as pa

from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, RequestStatus, sql
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import arrow_tables
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers.base import BatchState

BACKOFF_FIRST_SECONDS = 600
BACKOFF_MAX_SECONDS = 6 * 3600
TOKEN_LIMIT = "token_limit_exceeded"
GIVE_UP_AFTER = 3  # consecutive batch failures naming no request, of one (key, fingerprint)
LINE_REJECTED = (
    "not retried: the provider rejected this request line itself, which would be rejected again; "
    "fix the prompt or the model's config"
)


def backoff_seconds(occurrence: int) -> int:
    """Wait before resubmitting after the `occurrence`-th consecutive token_limit_exceeded (1, 2, ...)."""
    return min(BACKOFF_FIRST_SECONDS * 2 ** (occurrence - 1), BACKOFF_MAX_SECONDS)


def consecutive_token_limits(ledger) -> int:
    """How many of this model's most recently harvested batches failed on the token limit, in a row."""
    rows = ledger.con.execute(
        f"""select coalesce(error, '') like '%{TOKEN_LIMIT}%' from {ledger.table("llm_batch_jobs")}
            where model = ? and harvested_at is not null order by harvested_at desc, ended_at desc limit 64""",
        [ledger.model],
    ).fetchall()
    n = 0
    for (hit,) in rows:
        if not hit:
            break
        n += 1
    return n


def void_details(ledger, jobs: list[tuple[str, BatchState]]) -> tuple[list, list]:
    """Per ended job: the reason its unanswered requests are voided with (None: the default) and the
    back-off in seconds before they may be resubmitted (None: at once)."""
    reasons: list[str | None] = []
    backoffs: list[int | None] = []
    occurrence = consecutive_token_limits(ledger) + 1 if any(s.token_limit for _, s in jobs) else 0
    for _, state in jobs:
        if state.token_limit:
            wait = backoff_seconds(occurrence)
            reasons.append(
                f"{state.error} (resubmitted after a {wait // 60}-minute back-off: "
                f"token limit hit {occurrence} time(s) in a row)"
            )
            backoffs.append(wait)
        elif state.line_errors:
            reasons.append(
                "the batch failed validation on other request lines; this request was not at fault and is resubmitted"
            )
            backoffs.append(None)
        else:
            reasons.append(None)
            backoffs.append(None)
    return reasons, backoffs


def line_errors_table(con, jobs: list[tuple[str, BatchState]]) -> pa.Table:
    """The request lines the jobs' validation named: (job_id, line, message)."""
    rows = [(job_id, int(line), message) for job_id, state in jobs for line, message in state.line_errors.items()]
    return arrow_tables.from_lists(
        con,
        {
            "job_id": ("varchar", [r[0] for r in rows]),
            "line": ("bigint", [r[1] for r in rows]),
            "message": ("varchar", [r[2] for r in rows]),
        },
    )


def fail_named_lines(ledger) -> None:
    """Fail the requests whose lines validation named (table Scratch.line_errors), with its message:
    final at once, since the same line would fail validation again (and take its batch down again)."""
    ledger.fail_named_lines(Scratch.line_errors, LINE_REJECTED)


def is_plain_failure(state: BatchState) -> bool:
    """A batch that failed as a whole (`BatchState.failed`), naming no request and not on the token limit."""
    return state.failed and not state.token_limit and not state.line_errors and not state.results_gone


def settle_batch_failures(ledger, priced: bool) -> None:
    """The unanswered requests of plainly failed batches (Scratch.ended, its plain_failure): voided with a
    growing back-off, or, at the GIVE_UP_AFTER-th such failure in a row of the same (key,
    fingerprint), failed and final (until `dbt-llm-batch requeue`). Unbilled: cost $0."""
    con, requests, model = ledger.con, ledger.table("llm_batch_requests"), ledger.model
    con.execute(
        f"""create or replace temp table {Scratch.batch_failed} as
            with settling as (
                select r.custom_id, r.job_id, r.key, r.fingerprint, r.seq,
                       coalesce(e.error, 'batch ' || e.status || ' with no error given') as error
                from {requests} r join {Scratch.ended} e using (job_id)
                where r.status in {IN_FLIGHT_SQL}
                  -- validation named lines, none of them this job's requests: as good as naming none
                  and (e.plain_failure or (e.line_errors and not exists (
                          select 1 from {requests} x where x.job_id = e.job_id and x.failure_kind = 'deterministic')))),
            history as (
                select key, fingerprint, seq, failure_kind from {requests}
                where model = ? and status <> {sql(RequestStatus.DEFERRED)} and (key, fingerprint) in (select (key, fingerprint) from settling)),
            last_other as (  -- the latest earlier request that did not end in such a failure: the streak starts after it
                select s.custom_id, max(h.seq) as seq from settling s join history h using (key, fingerprint)
                where h.seq < s.seq and h.failure_kind is distinct from 'batch_failed' group by s.custom_id)
            select s.custom_id, s.job_id, s.error, 1 + count(h.seq) as occurrence
            from settling s left join last_other l using (custom_id)
                 left join history h on h.key = s.key and h.fingerprint = s.fingerprint and h.seq < s.seq
                                     and h.seq > coalesce(l.seq, -1) and h.failure_kind = 'batch_failed'
            group by all""",
        [model],
    )
    wait = f"least({BACKOFF_FIRST_SECONDS} * pow(2, f.occurrence - 1), {BACKOFF_MAX_SECONDS})::bigint"
    give_up = f"f.occurrence >= {GIVE_UP_AFTER}"
    ledger.settle_plain_failures(
        f"""(select f.custom_id, f.job_id, {give_up} as give_up,
                    case when not {give_up} then now() + to_seconds({wait}) end as not_before,
                    case when {give_up}
                      then 'the batch failed at the provider ' || f.occurrence || ' times in a row without naming a '
                           || 'request (last: ' || f.error || '); not resubmitted. Fix the cause, then run '
                           || '`dbt-llm-batch requeue --model ' || ? || '` to send these rows again'
                      else f.error || ' (the batch failed without naming a request, ' || f.occurrence || ' time(s) in a '
                           || 'row; resubmitted after a ' || ({wait} // 60) || '-minute back-off, given up after '
                           || {GIVE_UP_AFTER} || ')' end as error
             from {Scratch.batch_failed} f)""",
        [model],
        priced,
    )
    con.execute(f"drop table {Scratch.batch_failed}")


def log_backoffs(ledger, jobs: list[tuple[str, BatchState]]) -> None:
    for job_id, state in jobs:
        if is_plain_failure(state):
            _log_plain_failure(ledger, job_id, state)
        if not state.token_limit:
            continue
        n, until = ledger.con.execute(
            f"""select count(*), max(not_before) from {ledger.table("llm_batch_requests")}
                where job_id = ? and status = {sql(RequestStatus.VOIDED)}""",
            [job_id],
        ).fetchall()[0]
        if n:
            log.warning(
                f"{ledger.model}: a batch failed on the provider's enqueued token limit "
                f"(token_limit_exceeded); its {n} request(s) will be resubmitted after "
                f"{until:%Y-%m-%d %H:%M:%S %Z}"
            )


def _log_plain_failure(ledger, job_id: str, state: BatchState) -> None:
    voided_sql = sql(RequestStatus.VOIDED)
    voided, until, failed = ledger.con.execute(
        f"""select count(*) filter (where status = {voided_sql}), max(not_before) filter (where status = {voided_sql}),
                   count(*) filter (where status = {sql(RequestStatus.FAILED)} and failure_kind = 'gave_up')
            from {ledger.table("llm_batch_requests")} where job_id = ?""",
        [job_id],
    ).fetchall()[0]
    said = state.error or "no error given"
    if voided:
        log.warning(
            f"{ledger.model}: a batch failed at the provider without naming a request ({said}); its "
            f"{voided} request(s) will be resubmitted after {until:%Y-%m-%d %H:%M:%S %Z}"
        )
    if failed:
        log.warning(
            f"{ledger.model}: a batch failed at the provider {GIVE_UP_AFTER} times in a row without "
            f"naming a request ({said}): {failed} request(s) failed and are not resubmitted; fix the "
            f"cause, then run `dbt-llm-batch requeue --model {ledger.model}`"
        )
