"""The ledger: state tables in the warehouse that record every batch, request and result.

Invariants:
- a request row exists (status 'queued', with its job's intent row) before any call that could bill it;
- a result line is stored in `llm_batch_results` before the request's status changes or the row is
  merged into the model table;
- the model table is a pure function of these tables.
Schema changes are numbered migrations below; `llm_batch_meta` records the applied version. New
columns go at the end.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager

import duckdb

from dbt_llm_batch.sql import ident, list_literal

# Request statuses. 'queued' is in flight (whether its job reached the provider is the job's batch_id;
# 'submitted' is the same state as written by ledgers before schema version 5); 'voided' means the request never produced
# an outcome of its own (batch-level failure, expiry, intent that never reached the provider): it
# does not use up an attempt and is planned again.
IN_FLIGHT = ("queued", "submitted")
# Provider batch statuses after which nothing more will happen to a job.
JOB_TERMINAL = ("completed", "failed", "expired", "cancelled")

MIGRATIONS: list[tuple[int, list[str]]] = [
    # row_json and raw (a request's selected row, a result line) are large texts written once and read
    # rarely: stored with ZSTD, which writes them about 3x faster than DuckDB's default choice
    # (dictionary/FSST analysis). Storage only; ledgers created before keep their compression.
    (
        1,
        [
            """create table if not exists {s}.llm_batch_meta (
               schema_version integer, applied_at timestamptz)""",
            """create table if not exists {s}.llm_batch_jobs (
               job_id varchar, model varchar, provider varchar, llm_model varchar,
               batch_id varchar, status varchar, request_count bigint,
               input_file_id varchar, output_file_id varchar, error_file_id varchar, error varchar,
               created_at timestamptz, submitted_at timestamptz, ended_at timestamptz,
               harvested_at timestamptz, updated_at timestamptz)""",
            """create table if not exists {s}.llm_batch_requests (
               custom_id varchar, model varchar, key varchar, fingerprint varchar, seq integer,
               job_id varchar, status varchar, is_final boolean, error varchar, finish_reason varchar,
               input_tokens bigint, output_tokens bigint, cached_tokens bigint, row_json varchar using compression zstd,
               queued_at timestamptz, completed_at timestamptz, emitted varchar, answer varchar)""",
            """create table if not exists {s}.llm_batch_results (
               custom_id varchar, model varchar, job_id varchar, source varchar, raw varchar using compression zstd,
               stored_at timestamptz)""",
        ],
    ),
    # Usage is normalised across providers: input_tokens counts all input (cached included),
    # cached_tokens the cache reads, cache_write_tokens the cache writes.
    (2, ["alter table {s}.llm_batch_requests add column cache_write_tokens bigint"]),
    # Money, as exact decimals: the estimate made before submission (what is committed while the
    # request is in flight), and at harvest the cost at batch prices and the realtime counterfactual.
    (
        3,
        [
            "alter table {s}.llm_batch_requests add column estimated_cost_usd decimal(18, 9)",
            "alter table {s}.llm_batch_requests add column cost_usd decimal(18, 9)",
            "alter table {s}.llm_batch_requests add column realtime_cost_usd decimal(18, 9)",
            """create or replace view {s}.llm_batch_costs as
            select r.model, j.provider, coalesce(j.llm_model, '') as llm_model,
                   cast(coalesce(r.completed_at, r.queued_at) as date) as day,
                   count(*) filter (where r.status = 'succeeded') as rows_succeeded,
                   count(*) filter (where r.status = 'failed') as rows_failed,
                   count(*) filter (where r.status in ('queued', 'submitted')) as rows_pending,
                   sum(r.input_tokens) as input_tokens, sum(r.output_tokens) as output_tokens,
                   sum(r.cached_tokens) as cache_read_tokens, sum(r.cache_write_tokens) as cache_write_tokens,
                   sum(r.cost_usd) as cost_usd, sum(r.realtime_cost_usd) as realtime_cost_usd,
                   sum(r.realtime_cost_usd) - sum(r.cost_usd) as savings_usd,
                   coalesce(sum(r.estimated_cost_usd) filter (where r.status in ('queued', 'submitted')), 0)
                       as committed_not_billed_usd,
                   count(*) filter (where r.status in ('succeeded', 'failed') and r.job_id is not null
                                    and r.cost_usd is null) as rows_without_price
            from {s}.llm_batch_requests r left join {s}.llm_batch_jobs j using (job_id)
            group by all""",
        ],
    ),
    # What `dbt-llm-batch status` and `dbt run-operation dbt_llm_batch.status` show.
    (
        4,
        [
            """create or replace view {s}.llm_batch_in_flight as
            select model, provider, llm_model, batch_id, status, request_count, submitted_at,
                   date_trunc('second', now() - coalesce(submitted_at, created_at)) as age
            from {s}.llm_batch_jobs where harvested_at is null and status <> 'voided'""",
            """create or replace view {s}.llm_batch_progress as
            select model,
                   count(distinct key) filter (where is_final and status = 'succeeded') as keys_succeeded,
                   count(distinct key) filter (where is_final and status = 'failed') as keys_failed,
                   count(*) filter (where status in ('queued', 'submitted')) as requests_pending,
                   count(*) filter (where status = 'failed' and not is_final) as failed_will_retry,
                   date_trunc('second', now() - min(queued_at) filter (where status in ('queued', 'submitted')))
                       as oldest_pending_age,
                   coalesce(sum(estimated_cost_usd) filter (where status in ('queued', 'submitted')), 0)
                       as committed_not_billed_usd,
                   sum(cost_usd) as cost_usd, sum(realtime_cost_usd) as realtime_cost_usd
            from {s}.llm_batch_requests group by model""",
        ],
    ),
    # In-flight caps count estimated input tokens; 'deferred' requests (over a cap) wait here, unsent.
    (5, ["alter table {s}.llm_batch_requests add column estimated_input_tokens bigint"]),
    # The realtime path: each request's route ('batch', or 'realtime': a provider's realtime endpoint
    # or a self-hosted engine; NULL in older ledgers means 'batch'), and the split in the cost view.
    (
        6,
        [
            "alter table {s}.llm_batch_requests add column route varchar",
            """create or replace view {s}.llm_batch_costs as
            select r.model, j.provider, coalesce(j.llm_model, '') as llm_model,
                   cast(coalesce(r.completed_at, r.queued_at) as date) as day,
                   count(*) filter (where r.status = 'succeeded') as rows_succeeded,
                   count(*) filter (where r.status = 'failed') as rows_failed,
                   count(*) filter (where r.status in ('queued', 'submitted')) as rows_pending,
                   sum(r.input_tokens) as input_tokens, sum(r.output_tokens) as output_tokens,
                   sum(r.cached_tokens) as cache_read_tokens, sum(r.cache_write_tokens) as cache_write_tokens,
                   sum(r.cost_usd) as cost_usd, sum(r.realtime_cost_usd) as realtime_cost_usd,
                   sum(r.realtime_cost_usd) - sum(r.cost_usd) as savings_usd,
                   coalesce(sum(r.estimated_cost_usd) filter (where r.status in ('queued', 'submitted')), 0)
                       as committed_not_billed_usd,
                   count(*) filter (where r.status in ('succeeded', 'failed') and r.job_id is not null
                                    and r.cost_usd is null) as rows_without_price,
                   coalesce(r.route, 'batch') as route
            from {s}.llm_batch_requests r left join {s}.llm_batch_jobs j using (job_id)
            group by all""",
        ],
    ),
    # A voided request is not planned again before `not_before` (the back-off after the provider's
    # token_limit_exceeded). Version 6 is another branch's; versions only need to increase.
    (7, ["alter table {s}.llm_batch_requests add column not_before timestamptz"]),
    # One writer per model (locks.py); operator controls (operator.py): who cancelled a job and when,
    # and whether its files at the provider were deleted once its results were stored.
    (
        8,
        [
            """create table if not exists {s}.llm_batch_locks (
               model varchar primary key, owner varchar, acquired_at timestamptz, heartbeat_at timestamptz)""",
            "alter table {s}.llm_batch_jobs add column cancel_requested_at timestamptz",
            "alter table {s}.llm_batch_jobs add column cancelled_by varchar",
            "alter table {s}.llm_batch_jobs add column files_deleted_at timestamptz",
            "alter table {s}.llm_batch_jobs add column files_delete_error varchar",
        ],
    ),
    # A request's line (1-based) in its job's request file, which OpenAI validation errors name
    # (batch_failures.py); NULL for requests written before version 9 (custom_id order) and realtime ones.
    (9, ["alter table {s}.llm_batch_requests add column file_line integer"]),
    # Each model's key columns and fingerprint prefix as of its last run (identity.py): a changed
    # unique_key re-keys the stored requests instead of asking every row again, and fingerprints of
    # earlier versions are renamed once per prefix.
    (
        10,
        [
            """create table if not exists {s}.llm_batch_models (
               model varchar primary key, key_columns varchar, updated_at timestamptz,
               fingerprint_prefix varchar)"""
        ],
    ),
    # Why a failure is not retried like the others (batch_failures.py): 'deterministic' (the same
    # request would fail the same way: final at once), 'batch_failed' (voided by a batch failure that
    # named no request: counts towards giving up), 'gave_up' (failed after too many of those).
    # Keys with a 'deterministic' or 'gave_up' failure are not planned again for that fingerprint.
    (11, ["alter table {s}.llm_batch_requests add column failure_kind varchar"]),
    # possibly_billed: sends of a realtime request whose reply was lost after it went out (each may
    # have been billed without an answer: the realtime endpoints take no idempotency key; realtime.py).
    # cache_write_1h_tokens: the part of cache_write_tokens written with the 1 h TTL (Anthropic bills
    # it at a higher rate than the 5 min writes; costs.py). Both counted in the views. Progress also
    # shows what waits besides what is in flight: requests over an in-flight cap or in a back-off
    # (deferred, or voided until not_before), and requests held after a cancel.
    (
        12,
        [
            "alter table {s}.llm_batch_requests add column possibly_billed integer",
            "alter table {s}.llm_batch_requests add column cache_write_1h_tokens bigint",
            """create or replace view {s}.llm_batch_costs as
            select r.model, j.provider, coalesce(j.llm_model, '') as llm_model,
                   cast(coalesce(r.completed_at, r.queued_at) as date) as day,
                   count(*) filter (where r.status = 'succeeded') as rows_succeeded,
                   count(*) filter (where r.status = 'failed') as rows_failed,
                   count(*) filter (where r.status in ('queued', 'submitted')) as rows_pending,
                   sum(r.input_tokens) as input_tokens, sum(r.output_tokens) as output_tokens,
                   sum(r.cached_tokens) as cache_read_tokens, sum(r.cache_write_tokens) as cache_write_tokens,
                   sum(r.cost_usd) as cost_usd, sum(r.realtime_cost_usd) as realtime_cost_usd,
                   sum(r.realtime_cost_usd) - sum(r.cost_usd) as savings_usd,
                   coalesce(sum(r.estimated_cost_usd) filter (where r.status in ('queued', 'submitted')), 0)
                       as committed_not_billed_usd,
                   count(*) filter (where r.status in ('succeeded', 'failed') and r.job_id is not null
                                    and r.cost_usd is null) as rows_without_price,
                   coalesce(r.route, 'batch') as route,
                   coalesce(sum(r.possibly_billed), 0) as possibly_billed,
                   sum(r.cache_write_1h_tokens) as cache_write_1h_tokens
            from {s}.llm_batch_requests r left join {s}.llm_batch_jobs j using (job_id)
            group by all""",
            """create or replace view {s}.llm_batch_progress as
            select model,
                   count(distinct key) filter (where is_final and status = 'succeeded') as keys_succeeded,
                   count(distinct key) filter (where is_final and status = 'failed') as keys_failed,
                   count(*) filter (where status in ('queued', 'submitted')) as requests_pending,
                   count(*) filter (where status = 'deferred'
                                       or (status = 'voided' and not_before > now())) as requests_waiting,
                   count(*) filter (where status = 'held') as requests_held,
                   count(*) filter (where status = 'failed' and not is_final) as failed_will_retry,
                   date_trunc('second', now() - min(queued_at) filter (where status in ('queued', 'submitted')))
                       as oldest_pending_age,
                   coalesce(sum(estimated_cost_usd) filter (where status in ('queued', 'submitted')), 0)
                       as committed_not_billed_usd,
                   sum(cost_usd) as cost_usd, sum(realtime_cost_usd) as realtime_cost_usd,
                   coalesce(sum(possibly_billed), 0) as possibly_billed
            from {s}.llm_batch_requests group by model""",
        ],
    ),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]

# dbt runs models in threads of one process; DuckDB rejects concurrent DDL on one catalog
# ("Catalog write-write conflict"), so migrations are serialised here and retried across processes.
_MIGRATION_LOCK = threading.Lock()


@contextmanager
def transaction(con):
    """One DuckDB transaction: committed if the block succeeds, rolled back (if still open) if not."""
    con.execute("begin transaction")
    try:
        yield
        con.execute("commit")
    except BaseException:
        try:
            con.execute("rollback")
        except duckdb.TransactionException:
            pass  # a failed COMMIT has already ended the transaction; keep the original error
        raise


def retry_on_conflict(fn, attempts: int = 20):
    """Run fn(), retrying DuckDB transaction conflicts between concurrent model threads."""
    for i in range(attempts):
        try:
            return fn()
        except duckdb.TransactionException as exc:
            if "conflict" not in str(exc).lower() or i == attempts - 1:
                raise
            time.sleep(0.05 * (i + 1))


class Ledger:
    """The state tables of one schema, seen from one dbt model."""

    def __init__(self, con, schema: str, model: str):
        self.con = con
        self.schema = schema
        self.model = model

    def table(self, name: str) -> str:
        return f"{ident(self.schema)}.{name}"

    def migrate(self) -> None:
        """Create or upgrade the state tables to SCHEMA_VERSION (idempotent)."""
        with _MIGRATION_LOCK:
            retry_on_conflict(self._migrate_once)

    def _migrate_once(self) -> None:
        s = ident(self.schema)
        self.con.execute(f"create schema if not exists {s}")
        self.con.execute(MIGRATIONS[0][1][0].format(s=s))
        current = self.con.execute(f"select coalesce(max(schema_version), 0) from {s}.llm_batch_meta").fetchall()[0][0]
        if current > SCHEMA_VERSION:
            raise RuntimeError(
                f"ledger in schema {self.schema} has version {current}, newer than this "
                f"dbt-llm-batch ({SCHEMA_VERSION}): upgrade the package"
            )
        for version, statements in MIGRATIONS:
            if version <= current:
                continue
            with transaction(self.con):
                for sql in statements:
                    self.con.execute(sql.format(s=s))
                self.con.execute(f"insert into {s}.llm_batch_meta values (?, now())", [version])

    def execute(self, sql: str, params=None):
        """Execute one statement (autocommit), retrying write conflicts with other model threads."""
        return retry_on_conflict(lambda: self.con.execute(sql, params or []))

    # --- jobs -------------------------------------------------------------------------------

    def open_jobs(self) -> list[dict]:
        """Jobs of this model that may still yield results: intents and unharvested batches."""
        rows = self.con.execute(
            f"""select job_id, batch_id, status, provider, created_at, llm_model from {self.table("llm_batch_jobs")}
                where model = ? and harvested_at is null and status <> 'voided'
                order by created_at""",
            [self.model],
        ).fetchall()
        return [
            dict(zip(("job_id", "batch_id", "status", "provider", "created_at", "llm_model"), r, strict=True))
            for r in rows
        ]

    def write_intents(
        self, provider: str, llm_model: str, plan_rows: str, chunks: list[int], status: str = "intent"
    ) -> dict[int, str]:
        """Record one job intent per chunk and every request ('queued') in one transaction, before the
        provider is contacted; returns {chunk: job id}. `plan_rows` has each request's `chunk` and
        its `line` in the chunk's request file (NULL when there is no file: realtime).

        A crash after this point leaves a trace reconciliation can follow, and nothing is ever sent
        that the ledger does not know about. One transaction for the whole plan also lets DuckDB
        write large plans straight to the database file instead of through its log.
        """
        job_ids = {chunk: "job_" + uuid.uuid4().hex for chunk in chunks}
        # {chunk: job id} as a relation in the statements (a few rows: one per request file)
        chunk_list, job_id_list = list_literal(map(str, job_ids)), list_literal(job_ids.values())
        mapping = f"(select unnest({chunk_list})::bigint as chunk, unnest({job_id_list}) as job_id)"
        requests = self.table("llm_batch_requests")

        def write():
            with transaction(self.con):
                self.con.execute(
                    f"""insert into {self.table("llm_batch_jobs")} (job_id, model, provider, llm_model,
                          status, request_count, created_at, updated_at)
                        select m.job_id, ?, ?, ?, ?, count(*), now(), now()
                        from {plan_rows} p join {mapping} m using (chunk) group by m.job_id""",
                    [self.model, provider, llm_model, status],
                )
                self.con.execute(  # a deferred request being sent now becomes a queued one
                    f"""delete from {requests} where model = ? and status = 'deferred' and custom_id in
                        (select custom_id from {plan_rows} join {mapping} using (chunk))""",
                    [self.model],
                )
                self.con.execute(
                    f"""insert into {requests} (custom_id, model, key, fingerprint, seq, job_id, status,
                          row_json, queued_at, estimated_cost_usd, estimated_input_tokens, route, file_line)
                        select p.custom_id, ?, p.key, p.fingerprint, p.seq, m.job_id, 'queued', p.row_json, now(),
                               p.estimated_cost_usd, p.estimated_input_tokens, p.route, p.line
                        from {plan_rows} p join {mapping} m using (chunk)""",
                    [self.model],
                )

        retry_on_conflict(write)
        return job_ids

    def record_submission(self, job_id: str, batch_id: str, input_file_id: str | None, status: str) -> None:
        self.execute(
            f"""update {self.table("llm_batch_jobs")} set batch_id = ?, input_file_id = ?, status = ?,
                  submitted_at = now(), updated_at = now() where job_id = ?""",
            [batch_id, input_file_id, status, job_id],
        )

    def update_job(self, job_id: str, **fields) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.execute(
            f"update {self.table('llm_batch_jobs')} set {sets}, updated_at = now() where job_id = ?",
            [*fields.values(), job_id],
        )

    def void_job(self, job_id: str, reason: str) -> None:
        """The job produced no per-request outcome: its unresolved requests go back to the queue
        without using up an attempt."""
        self.execute(
            f"""update {self.table("llm_batch_requests")} set status = 'voided', error = ?, completed_at = now()
                where job_id = ? and status in ('queued', 'submitted')""",
            [reason, job_id],
        )

    # --- summary ----------------------------------------------------------------------------

    def defer(self, plan_rows: str | None) -> None:
        """Replace this model's deferred requests with `plan_rows`, the plan's requests not sent (None:
        none): over an in-flight cap, they wait here (with their row) for a later run, which sends them
        even if it no longer selects them. Deferred requests superseded by this run's plan are dropped."""

        def write():
            with transaction(self.con):
                self.con.execute(
                    f"delete from {self.table('llm_batch_requests')} where model = ? and status = 'deferred'",
                    [self.model],
                )
                if plan_rows is None:
                    return
                self.con.execute(
                    f"""insert into {self.table("llm_batch_requests")} (custom_id, model, key, fingerprint, seq,
                          status, row_json, queued_at, estimated_cost_usd, estimated_input_tokens)
                        select custom_id, ?, key, fingerprint, seq, 'deferred', row_json, now(), estimated_cost_usd,
                               estimated_input_tokens
                        from {plan_rows}""",
                    [self.model],
                )

        retry_on_conflict(write)

    def finalize_exhausted(self, max_attempts: int) -> None:
        """Failures that reached the current llm_max_attempts are final (the limit may have been
        lowered since they were harvested); without this such a key would be neither sent nor merged."""
        requests = self.table("llm_batch_requests")
        self.execute(
            f"""update {requests} r set is_final = true
                from (select key, fingerprint from {requests} where model = ? and status = 'failed'
                      group by key, fingerprint having count(*) >= ?) x
                where r.model = ? and r.status = 'failed' and not r.is_final
                  and r.key = x.key and r.fingerprint = x.fingerprint""",
            [self.model, max_attempts, self.model],
        )

    def return_to_deferred(self, job_ids: list[str]) -> None:
        """Jobs whose intents were written but whose upload was never attempted (an earlier chunk's
        submission failed): their requests wait as deferred again, and the intents go."""

        def write():
            with transaction(self.con):
                for job_id in job_ids:
                    self.con.execute(
                        f"""update {self.table("llm_batch_requests")} set status = 'deferred', job_id = null
                                         where job_id = ? and status = 'queued'""",
                        [job_id],
                    )
                    self.con.execute(f"delete from {self.table('llm_batch_jobs')} where job_id = ?", [job_id])

        retry_on_conflict(write)

    def backed_off(self) -> tuple[int, object]:
        """(keys waiting for a back-off, when the last of them may go) of this model."""
        return self.con.execute(
            f"""select count(distinct (key, fingerprint)), max(not_before) from {self.table("llm_batch_requests")}
                where model = ? and status = 'voided' and not_before > now()""",
            [self.model],
        ).fetchall()[0]

    def deferred_count(self) -> int:
        return self.con.execute(
            f"select count(*) from {self.table('llm_batch_requests')} where model = ? and status = 'deferred'",
            [self.model],
        ).fetchall()[0][0]

    def has_deferred(self) -> bool:
        return self.deferred_count() > 0

    def in_flight(self) -> tuple[int, int, int]:
        """(open batches, requests in flight, estimated input tokens in flight) of this model."""
        jobs = len(self.open_jobs())
        requests, tokens = self.con.execute(
            f"""select count(*), coalesce(sum(estimated_input_tokens), 0) from {self.table("llm_batch_requests")}
                where model = ? and status in ('queued', 'submitted')""",
            [self.model],
        ).fetchall()[0]
        return jobs, requests, int(tokens)

    def committed_usd(self, all_models: bool = False):
        """Estimated cost of requests in flight (submitted, not yet billed): this model's, or all."""
        scope = "" if all_models else "and model = ?"
        return self.con.execute(
            f"""select coalesce(sum(estimated_cost_usd), 0) from {self.table("llm_batch_requests")}
                where status in ('queued', 'submitted') {scope}""",
            [] if all_models else [self.model],
        ).fetchall()[0][0]

    def waiting_counts(self) -> tuple[int, int]:
        """(requests waiting for a back-off, requests held after a cancel) of this model."""
        return tuple(
            self.con.execute(
                f"""select count(*) filter (where status = 'voided' and not_before > now()),
                       count(*) filter (where status = 'held')
                from {self.table("llm_batch_requests")} where model = ?""",
                [self.model],
            ).fetchall()[0]
        )

    def pending_count(self) -> int:
        return self.con.execute(
            f"select count(*) from {self.table('llm_batch_requests')} where model = ? and status in ('queued', 'submitted')",
            [self.model],
        ).fetchall()[0][0]
