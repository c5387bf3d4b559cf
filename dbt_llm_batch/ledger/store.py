"""The ledger: state tables in the warehouse that record every batch, request and result.

Invariants:
- a request row exists (status 'queued', with its job's intent row) before any call that could bill it;
- a result line is stored in `llm_batch_results` before the request's status changes or the row is
  merged into the model table;
- the model table is a pure function of these tables.
Schema changes are numbered migrations below; `llm_batch_meta` records the applied version. New
columns go at the end. The statuses and their allowed changes are in status.py; the writes, by table,
in requests.py, jobs.py and results.py.
"""

from __future__ import annotations

import threading

from dbt_llm_batch.errors import VersionMismatchError
from dbt_llm_batch.ledger.base import retry_on_conflict, transaction
from dbt_llm_batch.ledger.claims import ClaimWrites
from dbt_llm_batch.ledger.configured import configured_sql
from dbt_llm_batch.ledger.focus import FOCUS_VIEW
from dbt_llm_batch.ledger.jobs import JobWrites
from dbt_llm_batch.ledger.requests import RequestWrites
from dbt_llm_batch.ledger.results import ResultWrites
from dbt_llm_batch.ledger.settled import SettledWrites
from dbt_llm_batch.ledger.status import (
    IN_FLIGHT,
    IN_FLIGHT_SQL,
    LEGACY_REQUEST_STATUSES,
    JobStatus,
    RequestStatus,
    sql,
)
from dbt_llm_batch.ledger.then_commands import ThenCommandWrites
from dbt_llm_batch.ledger.variant_names import VARIANT_NAMES, shown_variant_sql
from dbt_llm_batch.sql import ident

__all__ = ["IN_FLIGHT", "MIGRATIONS", "SCHEMA_VERSION", "Ledger", "retry_on_conflict", "transaction"]

MIGRATIONS: list[tuple[int, list[str]]] = [
    # row_json and raw (a request's selected row, a result line) are large texts written once and read
    # rarely: stored with ZSTD, which writes them about 3x faster than DuckDB's default choice
    # (dictionary/FSST analysis). custom_id, key and fingerprint are short, all different, and written
    # a million at a time: stored uncompressed, which writes them about 3x faster than the default
    # (and twice as fast as ZSTD) for some more bytes. Storage only; ledgers created before keep theirs.
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
               custom_id varchar using compression uncompressed, model varchar, key varchar using compression uncompressed,
               fingerprint varchar using compression uncompressed, seq integer, job_id varchar, status varchar, is_final boolean, error varchar, finish_reason varchar,
               input_tokens bigint, output_tokens bigint, cached_tokens bigint, row_json varchar using compression zstd,
               queued_at timestamptz, completed_at timestamptz, emitted varchar, answer varchar)""",
            """create table if not exists {s}.llm_batch_results (
               custom_id varchar using compression uncompressed, model varchar, job_id varchar, source varchar,
               raw varchar using compression zstd,
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
        ],
    ),
    # Version 4 added the reporting views; they are derived, not state, so VIEWS below defines them
    # once, as they are now, and every migration recreates them.
    (4, []),
    # In-flight caps count estimated input tokens; 'deferred' requests (over a cap) wait here, unsent.
    (5, ["alter table {s}.llm_batch_requests add column estimated_input_tokens bigint"]),
    # The realtime path: each request's route ('batch', or 'realtime': a provider's realtime endpoint
    # or a self-hosted engine; NULL in older ledgers means 'batch'), and the split in the cost view.
    (
        6,
        [
            "alter table {s}.llm_batch_requests add column route varchar",
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
        ],
    ),
]
MIGRATIONS += [
    # One in-flight status: ledgers before this version also wrote 'submitted' for 'queued'
    # (status.LEGACY_REQUEST_STATUSES); rewritten here, so no predicate carries it.
    (
        13,
        [
            *(
                f"update {{s}}.llm_batch_requests set status = {sql(new)} where status = {sql(old)}"
                for old, new in LEGACY_REQUEST_STATUSES.items()
            ),
        ],
    ),
]
MIGRATIONS += [
    # Rows and requests apart (plan.py, "Deduplication" in docs/costs.md): a row answer (model, key,
    # variant) points at the request (custom_id) that answers it; identical requests are sent once
    # and answer many rows. `reused`: mapped after its request was harvested (answered from the
    # ledger, cost $0). `row_json`: the row as selected, when it is not the request's own stored row
    # (NULL: read the request's). `emitted`: what the merge did with it (formerly the request's).
    # Existing requests each answer their own key, so a ledger of an earlier version merges the same
    # rows and asks nothing again. `variant` is '' (reserved for evaluation variants).
    (
        14,
        [
            """create table if not exists {s}.llm_batch_row_answers (
               model varchar, key varchar using compression uncompressed, variant varchar default '',
               fingerprint varchar using compression uncompressed, custom_id varchar using compression uncompressed,
               reused boolean, created_at timestamptz, row_json varchar using compression zstd, emitted varchar)""",
            f"""insert into {{s}}.llm_batch_row_answers
               select model, key, '', fingerprint, custom_id, false, coalesce(queued_at, now()), null, emitted
               from {{s}}.llm_batch_requests where status <> {sql(RequestStatus.DEFERRED)}""",
        ],
    ),
    # What settling a model's results needs of its config (config.settle_snapshot: output columns,
    # provider and model, prices, attempts; never a secret, nor a prompt), as of its last run: the
    # poller (ops/poller.py) harvests without a dbt project. NULL until the model runs once with it.
    (15, ["alter table {s}.llm_batch_models add column config_snapshot varchar"]),
]
MIGRATIONS += [
    # Evaluation variants (pipeline/variants.py): the variant whose pass planned a request or a job
    # ('' for the default variant and for everything written before): a variant's deferred requests
    # wait for that variant's pass, and the views report per variant. `if not exists`: a ledger whose
    # recorded version was set back (by hand, or a test building an older ledger) migrates again.
    (
        16,
        [
            "alter table {s}.llm_batch_requests add column if not exists variant varchar default ''",
            "alter table {s}.llm_batch_jobs add column if not exists variant varchar default ''",
        ],
    ),
    # A fast hash (DuckDB's hash()) of the text a row answer's fingerprint is the md5 of (the
    # fingerprint's prefix and the prompt): a run takes the stored fingerprint of a row whose hash
    # matches for the same key and computes md5 only for the others (plan.build_desired). NULL in
    # earlier ledgers, and filled by the next run (Ledger.remember_prompt_hashes); fingerprints and
    # custom_ids do not change. Version 16 is another branch's; versions only need to increase.
    (17, ["alter table {s}.llm_batch_row_answers add column if not exists prompt_hash ubigint"]),
    # output_schema: the llm_output schema a job's requests were asked with (canonical JSON; 'null'
    # for free text; NULL for jobs written before): an answer is checked against the schema it was
    # asked for, not one the model was given while it was in flight (outcomes.settle). The views
    # changed too (llm_batch_progress lists a model whose rows are all answered by other models'
    # requests): they are recreated on reaching this version.
    (18, ["alter table {s}.llm_batch_jobs add column if not exists output_schema varchar"]),
]
MIGRATIONS += [
    # `dbt-llm-batch poll --then` commands owed (then_commands.py): per model, what was run, when,
    # its exit code and how many times; the next poll with --then runs it again until it succeeds.
    (
        19,
        [
            """create table if not exists {s}.llm_batch_then_commands (
               model varchar, dbt_name varchar, command varchar, exit_code integer,
               first_failed_at timestamptz, failed_at timestamptz, attempts integer, succeeded_at timestamptz)"""
        ],
    ),
    # Project-wide claims of models running at once (dbt threads; ledger/claims.py): the project
    # budget each run has reserved and not yet recorded as requests, the shared requests (llm_dedup =
    # 'ledger') a run is about to send, and the one row every such claim updates first, so that two
    # claims conflict in DuckDB and one of them is retried after the other (no write skew).
    (
        20,
        [
            """create table if not exists {s}.llm_batch_reservations (
               owner varchar, model varchar, reserved_usd decimal(18, 9), reserved_at timestamptz)""",
            """create table if not exists {s}.llm_batch_request_claims (
               fingerprint varchar, custom_id varchar, model varchar, owner varchar, claimed_at timestamptz)""",
            "create table if not exists {s}.llm_batch_claim_turn (turn bigint)",
            "insert into {s}.llm_batch_claim_turn select 0 where not exists (select 1 from {s}.llm_batch_claim_turn)",
        ],
    ),
    # The views changed: llm_batch_pending_rows (each row still waiting for its answer, whichever
    # model's request asks it) and llm_batch_progress.rows_pending over it, so a model whose rows wait
    # on another model's request shows them pending (llm_dedup = 'ledger'), and the min_accuracy test
    # tells rows not answered yet from rows measured. No table changes.
    (21, []),
]
MIGRATIONS += [
    # The report (ops/report.py) splits the saving by lever: `uncached_cost_usd` is what a request would
    # have cost without prompt caching, at its route's prices (costs.uncached_cost_sql; NULL for requests
    # settled before: no caching saving is claimed for them). The views changed: llm_batch_costs has
    # cache_saved_usd, llm_batch_failures counts failed requests by kind, and llm_batch_focus is the
    # FOCUS cost dataset (ledger/focus.py).
    (22, ["alter table {s}.llm_batch_requests add column if not exists uncached_cost_usd decimal(18, 9)"]),
]
MIGRATIONS += [
    # The views changed: they name the default variant as the model's table does (llm_default_variant,
    # from the model's config snapshot; '' stays '' for a model without variants), and llm_batch_costs
    # counts rows (rows_succeeded, rows_failed) apart from requests (requests_succeeded, requests_failed).
    # No table changes.
    (23, []),
]
MIGRATIONS += [
    # An embedding request's answer is its vector, stored typed (`vector`, FLOAT[]; `answer` stays NULL):
    # settled from the result line's numbers without a round trip through JSON text, and merged into
    # the table's FLOAT[n] column by a cast of the list, about a quarter of the bytes of its text.
    # (The JSON-text vectors of the first embeddings build were never released: nothing to convert.)
    (24, ["alter table {s}.llm_batch_requests add column if not exists vector float[]"]),
]
MIGRATIONS += [
    # The views changed: llm_batch_costs.rows_answered counts rows whose current answer succeeded (it
    # counted every row a request was mapped to: in flight, failed or superseded too); llm_batch_progress
    # names each model's provider and llm_model (configured.py), and llm_batch_costs names them for
    # requests not sent yet. No table changes.
    (25, []),
]
MIGRATIONS += [
    # base_custom_id: a row answer made of two requests (pipeline/added_fields.py): its own request
    # answers the output fields added since the request named here, which answers the others.
    (26, ["alter table {s}.llm_batch_row_answers add column if not exists base_custom_id varchar"]),
]
MIGRATIONS += [
    # base_custom_ids: a row answer made of several requests (pipeline/added_fields.py): the earlier
    # parts, oldest first, each answering some of the fields; its own request is the newest part.
    # Replaces base_custom_id (one earlier part), whose value becomes the list's only element.
    (
        27,
        [
            "alter table {s}.llm_batch_row_answers add column if not exists base_custom_ids varchar[]",
            "update {s}.llm_batch_row_answers set base_custom_ids = [base_custom_id] where base_custom_id is not null",
            "alter table {s}.llm_batch_row_answers drop column if exists base_custom_id",
        ],
    ),
]
MIGRATIONS += [
    # llm_batch_settled: per model, the selection a run left complete (pipeline/settled.py, llm_updated_at):
    # the hash of its config, SQL, columns and plugin version, and its rows' count and order-independent
    # hash of (key columns, updated_at). A run whose selection still has them skips; any other run
    # deletes the model's row before it writes anything.
    (
        28,
        [
            """create table if not exists {s}.llm_batch_settled (
               model varchar, config_signature varchar, row_count bigint, rows_hash hugeint,
               updated_at_column varchar, recorded_at timestamptz)""",
        ],
    ),
]
MIGRATIONS += [
    # The views changed: a row (model, variant, key) is counted once, by its current answer
    # (_CURRENT_ANSWERS): llm_batch_costs.rows_succeeded / rows_failed / rows_reused counted it once per
    # request that ever answered it (each part of a combined answer, each prompt's answer), and
    # llm_batch_progress.rows_mapped / rows_reused / keys_* counted superseded answers. No table changes.
    (29, []),
    # The views changed: llm_batch_costs.rows_pending and rows_without_price counted requests; a
    # request shared by several rows (llm_dedup) now counts each row it answers (its row answers; a
    # request without any, written before row answers existed, counts one). No table changes.
    (30, []),
    # llm_batch_costs.rows_pending counted a row re-asked after a prompt edit, with its old request
    # still in flight, once per request; it now counts it once, by its newest request. Views only.
    (31, []),
]
MIGRATIONS += [
    # A request claim names the route its request is sent by ('realtime' for an urgent row, NULL for a
    # batch): another run's claim of a request for a batch does not answer an urgent row, as its
    # recorded request in a batch does not (claims.claim_requests). Claims last as long as their run:
    # the ones a live run holds while this runs are taken as batch claims.
    (32, ["alter table {s}.llm_batch_request_claims add column if not exists route varchar"]),
    # The table a model's last merge wrote (runner.py): the row answers' `emitted` marks say what that
    # table shows. A model renamed back to a name whose table dbt left in place finds another table's
    # name here, and rebuilds its table from the ledger instead of trusting the marks. NULL (a ledger
    # from before): the marks are trusted, as they were.
    (33, ["alter table {s}.llm_batch_models add column if not exists merged_into varchar"]),
    # The provider's own keys a job was sent with (ModelConfig.options as JSON: a host's URL, the NAME
    # of its key's variable, a region, never a key): a batch in flight is polled, harvested, cancelled
    # and cleaned up where it was sent, after the model moved to another host (llm_base_url). NULL (a
    # job from before): the model's current keys, as before.
    (34, ["alter table {s}.llm_batch_jobs add column if not exists provider_options varchar"]),
    # The views changed: llm_batch_pending_rows (and llm_batch_progress.rows_pending over it) lists a
    # row answered by another model's request that its model has not merged yet (llm_dedup = 'ledger':
    # that model's run harvested it while this one ran). No table changes.
    (35, []),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]

# The reporting views (what `dbt-llm-batch status`, `dbt run-operation dbt_llm_batch.status` and users
# read): derived from the tables, so defined once, as they are now, and (re)created whenever a ledger
# reaches this version, rather than restated by each migration that changes them.
_QUEUED, _SUCCEEDED, _FAILED = sql(RequestStatus.QUEUED), sql(RequestStatus.SUCCEEDED), sql(RequestStatus.FAILED)
_WAITING = f"{sql(RequestStatus.DEFERRED)}, {sql(RequestStatus.HELD)}"
# Each row's (model, variant, key) current answer: of its row answers with a final outcome (succeeded,
# or failed for good) and not superseded (a later answer replaced it: another prompt, or an earlier
# part of a combined answer once the combined one is merged), the one the table shows ('merged'), else
# the newest (final, not merged yet). A row is counted once, through it: never once per request that
# answered it (each part of a combined answer, each prompt's answer), whichever row answers a key has.
_CURRENT_ANSWERS = f"""(select a.model, a.variant, a.key, a.custom_id, a.reused, r.status
    from {{s}}.llm_batch_row_answers a join {{s}}.llm_batch_requests r using (custom_id)
    where a.emitted is distinct from 'superseded' and r.is_final and r.status in ({_SUCCEEDED}, {_FAILED})
    qualify row_number() over (partition by a.model, a.variant, a.key
                               order by a.emitted is not distinct from 'merged' desc, a.created_at desc, a.custom_id desc) = 1)"""

# Each row's (model, variant, key) newest row answer, where it is a request in flight: the request the
# row now waits for. Read only for the rows that have a row answer in flight (the semi join), so a
# large ledger's finished rows are not ranked. A row answered earlier and re-asked after a prompt edit
# waits for the new request only; its old request, still in flight, answers the previous prompt.
_PENDING_ANSWERS = f"""(select a.custom_id
    from {{s}}.llm_batch_row_answers a join {{s}}.llm_batch_requests r using (custom_id)
         semi join (select w.model, w.variant, w.key from {{s}}.llm_batch_row_answers w
                    join {{s}}.llm_batch_requests q using (custom_id) where q.status = {_QUEUED}) w
              on w.model = a.model and w.variant = a.variant and w.key = a.key
    qualify row_number() over (partition by a.model, a.variant, a.key order by a.created_at desc, a.custom_id desc) = 1
        and r.status = {_QUEUED})"""


VIEWS = [
    # One row per row of a model (model, variant, key) and the fingerprint it waits for an answer to:
    # a row answer whose request is in flight or held, of this model or another (llm_dedup = 'ledger':
    # `asked_by` is that model), and the model's own requests waiting unsent (over a cap, in a
    # back-off) or held. A key may appear more than once (count distinct keys). Also a row answered by
    # another model's request that is not in this model's table yet (that model's run or the poller
    # harvested it after this model's last merge, dbt's threads): its status is the request's outcome,
    # and the model's next run merges it. Not the rows kept aside by a unique_key change (identity.py):
    # never merged under that name.
    f"""create or replace view {{s}}.llm_batch_pending_rows as
    select a.model, a.variant, a.key, a.fingerprint, r.model as asked_by, r.status
    from {{s}}.llm_batch_row_answers a join {{s}}.llm_batch_requests r using (custom_id)
    where r.status in ({_QUEUED}, {sql(RequestStatus.HELD)})
       or (a.emitted is null and r.is_final and r.model <> a.model and not contains(a.model, ' (unique_key '))
    union all
    select model, variant, key, fingerprint, model as asked_by, status from {{s}}.llm_batch_requests
    where status in ({_WAITING}) or (status = {sql(RequestStatus.VOIDED)} and not_before > now())""",
    f"""create or replace view {{s}}.llm_batch_in_flight as
    select model, provider, llm_model, batch_id, status, request_count, submitted_at,
           date_trunc('second', now() - coalesce(submitted_at, created_at)) as age, {shown_variant_sql("variant")} as variant
    from {{s}}.llm_batch_jobs left join {VARIANT_NAMES} n using (model)
    where harvested_at is null and status <> {sql(JobStatus.VOIDED)}""",
    f"""create or replace view {{s}}.llm_batch_costs as
    select r.model,
           -- the job's; for requests not sent yet (no job), what the model's config names
           coalesce(j.provider, {configured_sql("llm_provider", "r.variant")}, '') as provider,
           coalesce(j.llm_model, {configured_sql("llm_model", "r.variant")}, '') as llm_model,
           cast(coalesce(r.completed_at, r.queued_at) as date) as day,
           -- rows apart from requests: the rows (model, variant, key) whose current answer is one of these
           -- requests, succeeded or failed for good, each row once (summed: the rows the models have)
           coalesce(sum(c.rows_succeeded), 0) as rows_succeeded,
           coalesce(sum(c.rows_failed), 0) as rows_failed,
           -- rows waiting for a request in flight: each row it will answer whose newest row answer it is
           -- (_PENDING_ANSWERS: a row re-asked after a prompt edit counts once, by the new request); one
           -- for a request without row answers, from a ledger older than them
           coalesce(sum(case when a.row_answers is null then 1 else coalesce(p.rows_pending, 0) end)
                    filter (where r.status = {_QUEUED}), 0) as rows_pending,
           sum(r.input_tokens) as input_tokens, sum(r.output_tokens) as output_tokens,
           sum(r.cached_tokens) as cache_read_tokens, sum(r.cache_write_tokens) as cache_write_tokens,
           sum(r.cost_usd) as cost_usd, sum(r.realtime_cost_usd) as realtime_cost_usd,
           sum(r.realtime_cost_usd) - sum(r.cost_usd) as savings_usd,
           coalesce(sum(r.estimated_cost_usd) filter (where r.status = {_QUEUED}), 0) as committed_not_billed_usd,
           -- rows whose current answer is a request sent without a known price (counted as rows_succeeded
           -- and rows_failed count them; one for a request without row answers, as above)
           coalesce(sum(case when a.row_answers is null then 1
                             else coalesce(c.rows_succeeded, 0) + coalesce(c.rows_failed, 0) end)
                    filter (where r.status in ({_SUCCEEDED}, {_FAILED}) and r.job_id is not null
                            and r.cost_usd is null), 0) as rows_without_price,
           coalesce(r.route, 'batch') as route,
           coalesce(sum(r.possibly_billed), 0) as possibly_billed,
           sum(r.cache_write_1h_tokens) as cache_write_1h_tokens,
           -- rows whose current answer is a succeeded request (not one in flight, nor one a later answer
           -- superseded: rows_succeeded), rows whose current answer came from the ledger (reused, no
           -- call), and what sharing saved: each row a billed request answered beyond its first would
           -- have been a request of its own (every row it answered, as savings_usd counts every request)
           coalesce(sum(c.rows_succeeded), 0) as rows_answered,
           coalesce(sum(c.rows_reused), 0) as rows_reused,
           coalesce(sum(r.cost_usd * (a.row_answers - 1)) filter (where a.row_answers > 1), 0) as dedup_saved_usd,
           {shown_variant_sql("r.variant")} as variant,  -- the evaluation variant that asked it, as the table names it
           -- what prompt caching saved: the same requests with every input token at the input rate
           coalesce(sum(coalesce(r.uncached_cost_usd, r.cost_usd)) - sum(r.cost_usd), 0) as cache_saved_usd,
           count(*) filter (where r.status = {_SUCCEEDED}) as requests_succeeded,
           count(*) filter (where r.status = {_FAILED}) as requests_failed
    from {{s}}.llm_batch_requests r left join {{s}}.llm_batch_jobs j using (job_id)
         left join {VARIANT_NAMES} n on n.model = r.model
         left join (select custom_id, count(*) as row_answers from {{s}}.llm_batch_row_answers
                    group by custom_id) a using (custom_id)
         left join (select custom_id, count(*) filter (where status = {_SUCCEEDED}) as rows_succeeded,
                           count(*) filter (where status = {_FAILED}) as rows_failed,
                           count(*) filter (where reused) as rows_reused
                    from {_CURRENT_ANSWERS} group by custom_id) c using (custom_id)
         left join (select custom_id, count(*) as rows_pending from {_PENDING_ANSWERS} group by custom_id) p
              using (custom_id)
    group by all""",
    f"""create or replace view {{s}}.llm_batch_progress as
    select model,
           -- keys: the rows whose current answer succeeded or failed for good (_CURRENT_ANSWERS; with
           -- llm_dedup a request answers several), as llm_batch_costs.rows_succeeded / rows_failed count them
           coalesce(max(c.keys_succeeded), 0) as keys_succeeded, coalesce(max(c.keys_failed), 0) as keys_failed,
           count(*) filter (where status = {_QUEUED}) as requests_pending,
           count(*) filter (where status = {sql(RequestStatus.DEFERRED)}
                               or (status = {sql(RequestStatus.VOIDED)} and not_before > now())) as requests_waiting,
           count(*) filter (where status = {sql(RequestStatus.HELD)}) as requests_held,
           count(*) filter (where status = {_FAILED} and not is_final) as failed_will_retry,
           date_trunc('second', now() - min(queued_at) filter (where status = {_QUEUED})) as oldest_pending_age,
           coalesce(sum(estimated_cost_usd) filter (where status = {_QUEUED}), 0) as committed_not_billed_usd,
           sum(cost_usd) as cost_usd, sum(realtime_cost_usd) as realtime_cost_usd,
           coalesce(sum(possibly_billed), 0) as possibly_billed,
           -- requests and rows apart: the rows mapped to a request (answered or in flight; each key once,
           -- superseded answers left out), the rows whose current answer came without a request (reused),
           -- and what sharing saved (dedup_saved_usd, as in llm_batch_costs)
           count(*) filter (where job_id is not null) as requests_sent,
           coalesce(max(a.rows_mapped), 0) as rows_mapped,
           coalesce(max(c.rows_reused), 0) as rows_reused,
           coalesce(max(a.dedup_saved_usd), 0) as dedup_saved_usd,
           {shown_variant_sql("variant")} as variant,  -- per evaluation variant, as the table names it ('': no variants)
           -- rows (keys) still waiting for an answer, whichever model's request asks it: a model whose
           -- rows share another model's request in flight (llm_dedup = 'ledger') has them pending too
           coalesce(max(w.rows_pending), 0) as rows_pending,
           -- what the model (its variant) is configured to ask, even before anything is sent; a ledger
           -- written before config snapshots: its last job's
           coalesce(any_value({configured_sql("llm_provider", "m.variant")}), any_value(j.provider), '') as provider,
           coalesce(any_value({configured_sql("llm_model", "m.variant")}), any_value(j.llm_model), '') as llm_model
    -- every model (and variant) with a request or a row answer: under llm_dedup = 'ledger' a model whose
    -- rows all share other models' requests has no request of its own, and still has rows to show
    from (select model, variant from {{s}}.llm_batch_requests
          union select model, variant from {{s}}.llm_batch_row_answers) m
         left join {{s}}.llm_batch_requests using (model, variant)
         left join (select a.model, a.variant,
                           count(distinct a.key) filter (where a.emitted is distinct from 'superseded') as rows_mapped,
                           cast(sum(r.cost_usd) - coalesce(sum(r.cost_usd / a.sharing) filter (where not a.reused), 0)
                                as decimal(18, 9)) as dedup_saved_usd
                    from (select *, count(*) filter (where not reused) over (partition by custom_id) as sharing
                          from {{s}}.llm_batch_row_answers) a
                         join {{s}}.llm_batch_requests r using (custom_id)
                    group by a.model, a.variant) a using (model, variant)
         left join (select model, variant, count(*) filter (where status = {_SUCCEEDED}) as keys_succeeded,
                           count(*) filter (where status = {_FAILED}) as keys_failed,
                           count(*) filter (where reused) as rows_reused
                    from {_CURRENT_ANSWERS} group by model, variant) c using (model, variant)
         left join (select model, variant, count(distinct key) as rows_pending from {{s}}.llm_batch_pending_rows
                    group by model, variant) w using (model, variant)
         left join {VARIANT_NAMES} n using (model)
         left join (select model, arg_max(provider, created_at) as provider, arg_max(llm_model, created_at) as llm_model
                    from {{s}}.llm_batch_jobs group by model) j using (model)
    group by model, variant, n.has_variants, n.default_name""",
    # Failed requests by why they failed (failure_kind: batch_failures.py; NULL: the answer or its error
    # line failed, and it is retried up to llm_max_attempts), final or to be retried.
    f"""create or replace view {{s}}.llm_batch_failures as
    select model, variant, coalesce(failure_kind, 'answer') as failure_kind,
           count(*) filter (where is_final) as requests_final, count(*) filter (where not is_final) as requests_retried
    from {{s}}.llm_batch_requests where status = {_FAILED}
    group by all""",
    FOCUS_VIEW,
]

# dbt runs models in threads of one process; DuckDB rejects concurrent DDL on one catalog
# ("Catalog write-write conflict"), so migrations are serialised here and retried across processes.
_MIGRATION_LOCK = threading.Lock()

VOIDED, DEFERRED, HELD = sql(RequestStatus.VOIDED), sql(RequestStatus.DEFERRED), sql(RequestStatus.HELD)


class Ledger(RequestWrites, JobWrites, ResultWrites, ThenCommandWrites, ClaimWrites, SettledWrites):
    """The state tables of one schema, seen from one dbt model: the only code that writes them."""

    def migrate(self, up_to: int = SCHEMA_VERSION) -> None:
        """Create or upgrade the state tables to SCHEMA_VERSION (idempotent); `up_to` stops at an
        earlier version (tests build the ledger an older release left)."""
        with _MIGRATION_LOCK:
            retry_on_conflict(lambda: self._migrate_once(up_to))

    def _migrate_once(self, up_to: int = SCHEMA_VERSION) -> None:
        s = ident(self.schema)
        self.con.execute(f"create schema if not exists {s}")
        self.con.execute(MIGRATIONS[0][1][0].format(s=s))
        current = self.con.execute(f"select coalesce(max(schema_version), 0) from {s}.llm_batch_meta").fetchall()[0][0]
        if current > SCHEMA_VERSION:
            # A teammate's newer dbt-llm-batch migrated it: an older one must not write to it.
            raise VersionMismatchError(
                f"the ledger in schema {self.schema} was written by a newer dbt-llm-batch (ledger version "
                f"{current}; this installation reads up to {SCHEMA_VERSION}): upgrade dbt-llm-batch "
                "(the Python package and the dbt package, to the same version); nothing was changed"
            )
        for version, statements in MIGRATIONS:
            if version <= current or version > up_to:
                continue
            with transaction(self.con):
                for statement in statements:
                    self.con.execute(statement.format(s=s))
                if version == SCHEMA_VERSION:  # the views need the current tables' columns
                    for view in VIEWS:
                        self.con.execute(view.format(s=s))
                self.con.execute(f"insert into {s}.llm_batch_meta values (?, now())", [version])

    # --- reads ---------------------------------------------------------------------------------

    def backed_off(self) -> tuple[int, object]:
        """(keys waiting for a back-off, when the last of them may go) of this model."""
        return self.con.execute(
            f"""select count(distinct (key, fingerprint)), max(not_before) from {self.table("llm_batch_requests")}
                where model = ? and status = {VOIDED} and not_before > now()""",
            [self.model],
        ).fetchall()[0]

    def deferred_count(self) -> int:
        return self.con.execute(
            f"select count(*) from {self.table('llm_batch_requests')} where model = ? and status = {DEFERRED}",
            [self.model],
        ).fetchall()[0][0]

    def has_deferred(self) -> bool:
        return self.deferred_count() > 0

    def deferred_by_variant(self) -> dict[str, int]:
        """This model's deferred requests per evaluation variant ('': the default variant)."""
        rows = self.con.execute(
            f"""select variant, count(*) from {self.table("llm_batch_requests")}
                where model = ? and status = {DEFERRED} group by variant""",
            [self.model],
        ).fetchall()
        return {r[0]: r[1] for r in rows}

    def in_flight(self) -> tuple[int, int, int]:
        """(open batches, requests in flight, estimated input tokens in flight) of this model."""
        jobs = len(self.open_jobs())
        requests, tokens = self.con.execute(
            f"""select count(*), coalesce(sum(estimated_input_tokens), 0) from {self.table("llm_batch_requests")}
                where model = ? and status in {IN_FLIGHT_SQL}""",
            [self.model],
        ).fetchall()[0]
        return jobs, requests, int(tokens)

    def committed_usd(self, all_models: bool = False):
        """Estimated cost of requests in flight (submitted, not yet billed): this model's, or all."""
        scope = "" if all_models else "and model = ?"
        return self.con.execute(
            f"""select coalesce(sum(estimated_cost_usd), 0) from {self.table("llm_batch_requests")}
                where status in {IN_FLIGHT_SQL} {scope}""",
            [] if all_models else [self.model],
        ).fetchall()[0][0]

    def waiting_counts(self) -> tuple[int, int]:
        """(requests waiting for a back-off, requests held after a cancel) of this model."""
        return tuple(
            self.con.execute(
                f"""select count(*) filter (where status = {VOIDED} and not_before > now()),
                       count(*) filter (where status = {HELD})
                from {self.table("llm_batch_requests")} where model = ?""",
                [self.model],
            ).fetchall()[0]
        )

    def prompt_hash_count(self) -> int:
        """How many row answers of this model have a prompt_hash (plan.build_desired)."""
        answers = self.table("llm_batch_row_answers")
        return self.con.execute(f"select count(prompt_hash) from {answers} where model = ?", [self.model]).fetchall()[
            0
        ][0]

    def prompt_fingerprints(self, distinct: bool = True) -> str:
        """SQL (parameters $model, $variant): the stored fingerprint of each (key, prompt_hash) of this
        model, and `answer_id`, the custom_id of the row answer it was read from when that row answer
        is the pass's variant's (else NULL: plan.build_plan's candidates read it); with `distinct`
        False, of each of its row answers with a prompt_hash (one (key, prompt_hash) may then come
        more than once: plan.build_desired checks). Grouped, a row answer of the pass's variant is
        preferred, and the fingerprint and answer_id are the same row answer's."""
        answers = self.table("llm_batch_row_answers")
        if not distinct:
            return f"""select key, prompt_hash, fingerprint, case when variant = $variant then custom_id end as answer_id
                       from {answers} where model = $model and prompt_hash is not null"""
        return f"""select key, prompt_hash, struct_extract(m, 'fingerprint') as fingerprint,
                          struct_extract(m, 'answer_id') as answer_id
                   from (select key, prompt_hash,
                                arg_max({{'fingerprint': fingerprint,
                                          'answer_id': case when variant = $variant then custom_id end}},
                                        variant = $variant) as m
                         from {answers} where model = $model and prompt_hash is not null
                         group by key, prompt_hash)"""

    def has_retries(self) -> bool:
        """Whether a request of this model was tried more than once (an attempt after the first)."""
        return self.con.execute(
            f"select exists (select 1 from {self.table('llm_batch_requests')} where model = ? and seq > 0)",
            [self.model],
        ).fetchall()[0][0]

    def pending_count(self) -> int:
        return self.con.execute(
            f"select count(*) from {self.table('llm_batch_requests')} where model = ? and status in {IN_FLIGHT_SQL}",
            [self.model],
        ).fetchall()[0][0]
