"""Harvest: poll a model's open batches, store their result lines, and settle each request.

Order matters for "nothing paid for is lost": raw result lines are stored in `llm_batch_results`
(one transaction for all the batches that ended) before any request changes status, and a job is
marked harvested only in the same transaction that settles its requests. A run that dies in between downloads nothing twice:
the next run finds the stored lines and settles from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jsonschema
import pyarrow as pa

from dbt_llm_batch import output_schema
from dbt_llm_batch.config import ModelConfig
from dbt_llm_batch.ledger import Ledger, retry_on_conflict, transaction
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, JobStatus, RequestStatus, sql
from dbt_llm_batch.log import log
from dbt_llm_batch.pipeline import batch_failures, costs, crashpoints, tempdirs
from dbt_llm_batch.pipeline.scratch import Scratch
from dbt_llm_batch.providers.base import BatchProvider, BatchState, Provider
from dbt_llm_batch.providers.calls import ProviderUnavailable, status_of
from dbt_llm_batch.sql import in_list, literal

RETENTION_ENDED = "results no longer retrievable at the provider (retention ended); resubmitted"
# A batch the provider says does not exist is taken as deleted only once it must have ended (24 h)
# plus an hour: a younger one means a key for another organisation or workspace, not a lost batch.
GONE_AFTER_SECONDS = 25 * 3600


def answer_problem_sql(config: ModelConfig) -> str:
    """SQL giving why an 'ok' answer is unusable (or NULL): cut off, not JSON, wrong field types.
    A cut-off answer is final at once (settle): the same request would be cut off again."""
    if config.max_tokens is None:
        limit, fix = "the model''s output limit", "Set llm_max_tokens higher (that asks again), or shorten the prompt"
    else:
        limit, fix = f"llm_max_tokens={config.max_tokens}", "Raise llm_max_tokens (that asks again)"
    checks = [
        (
            "truncated",
            f"'answer was cut off at {limit} (finish reason ' || finish_reason || '); not retried: the same "
            f"request would be cut off again. {fix}'",
        )
    ]
    if config.structured:
        checks += [
            ("not coalesce(json_valid(answer), false)", "'answer is not valid JSON'"),
            ("json_type(answer) <> 'OBJECT'", "'answer is not a JSON object'"),
        ]
        for col in config.output_columns:
            if not output_schema.is_flat(col.json_schema):
                continue  # checked against the schema by jsonschema (schema_problems), value by value
            path = literal("$." + col.name)
            jtype = f"json_type(answer, {path})"
            if col.enum:
                cond = f"{jtype} is distinct from 'VARCHAR' or json_extract_string(answer, {path}) not in {in_list(col.enum)}"
                why = f"field '{col.name}' is not one of {list(col.enum)}"
            else:
                expected = {
                    "VARCHAR": "('VARCHAR')",
                    "BIGINT": "('BIGINT', 'UBIGINT')",
                    "DOUBLE": "('BIGINT', 'UBIGINT', 'DOUBLE')",
                    "BOOLEAN": "('BOOLEAN')",
                }[col.duckdb_type]
                cond = f"coalesce({jtype}, 'NULL') not in {expected}"
                why = f"field '{col.name}' is missing or not of type {col.json_schema['type']}"
            checks.append((cond, literal(why)))
    cases = " ".join(f"when {cond} then {why}" for cond, why in checks)
    return f"case {cases} end"


def asked_schema(config: ModelConfig) -> str:
    """The llm_output schema requests are asked with, as recorded on their job (canonical JSON; 'null'
    for free text): harvest checks each answer against the schema it was asked for."""
    return json.dumps(config.output_json_schema(), sort_keys=True)


def schema_problems(con, config: ModelConfig, table: str, skip_jobs=()) -> int:
    """Check each 'ok' answer in `table` (an outcomes table) that the bulk SQL checks passed against
    the output schema with `jsonschema`, when the schema has more than flat columns (objects, lists,
    dates, optional fields, ...): a failing answer gets the validator's message as its `problem`
    (the field's path and the rule), and is a failed attempt like any other. Answers of `skip_jobs`
    are left alone. Returns how many failed."""
    schema = config.output_json_schema()
    if schema is None or all(output_schema.is_flat(c.json_schema) for c in config.output_columns):
        return 0
    return _validate(con, table, schema, f"job_id not in {in_list(skip_jobs)}" if skip_jobs else "true")


def _validate(con, table: str, schema: dict, where: str) -> int:
    """schema_problems against `schema`, for the answers of `table` that `where` (SQL) selects."""
    validator = jsonschema.Draft202012Validator(
        output_schema.validation_schema(schema),
        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
    )
    failed: dict[str, list] = {"custom_id": [], "job_id": [], "problem": []}
    # Streamed in chunks (the answers are never all in memory); the table is updated once it is read.
    reader = con.sql(
        f"select custom_id, job_id, answer from {table} where outcome = 'ok' and problem is null and ({where})"
    ).to_arrow_reader(10_000)
    for chunk in reader:
        for custom_id, job_id, answer in zip(*(chunk.column(i).to_pylist() for i in range(3)), strict=True):
            problem = answer_schema_problem(validator, answer)
            if problem:
                failed["custom_id"].append(custom_id)
                failed["job_id"].append(job_id)
                failed["problem"].append(problem)
    if failed["custom_id"]:
        con.register(Scratch.schema_failures, pa.table(failed))
        try:
            con.execute(
                f"""update {table} t set problem = f.problem from {Scratch.schema_failures} f
                    where t.custom_id = f.custom_id and t.job_id = f.job_id"""
            )
        finally:
            con.unregister(Scratch.schema_failures)
    return len(failed["custom_id"])


def answer_schema_problem(validator, answer: str) -> str | None:
    """The validator's message for an answer that does not match the schema (None if it does)."""
    try:
        value = json.loads(answer)
    except ValueError:  # the bulk checks catch this first, except for an earlier schema's answers
        return "answer is not valid JSON"
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return f"answer does not match llm_output at ${path}: {error.message} (rule '{error.validator}')"


def poll_and_harvest(
    ledger: Ledger, provider: BatchProvider, config: ModelConfig, jobs: list[dict], price: dict | None
) -> dict:
    """Poll each open job once; store the results of those that ended, then settle them together.
    Returns counts for the run summary."""
    stats = {"harvested_jobs": 0, "still_pending_jobs": 0, "unknown_results": 0}
    with tempdirs.private_dir() as directory:
        fetched = fetch(ledger.model, provider, jobs, directory, lambda job_id: is_stored(ledger, job_id))
        for job_id, status in fetched.pending:
            ledger.record_provider_status(job_id, status)
        stats["still_pending_jobs"] = len(fetched.pending) + fetched.not_polled
        crashpoints.reach("after_download")
        store_lines(ledger, fetched.downloads)
        crashpoints.reach("after_store")
    if fetched.ended:
        stats["unknown_results"] = settle(ledger, provider, config, fetched.ended, price)
        stats["harvested_jobs"] = len(fetched.ended)
    return stats


@dataclasses.dataclass
class Fetched:
    """What polling a model's open jobs found: the ended ones with their state, their downloaded
    result files [(job id, source, path)], the status word of those still running, and how many
    were not polled (pending without a word, or skipped once the provider stayed unavailable)."""

    ended: list[tuple[str, BatchState]] = dataclasses.field(default_factory=list)
    downloads: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    pending: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    pending_done: int = 0  # requests the provider finished in the batches still running (progress)
    not_polled: int = 0
    unavailable: bool = False


def fetch(model: str, provider: BatchProvider, jobs: list[dict], directory: str, stored) -> Fetched:
    """The network half of a harvest, which writes nothing to the ledger: poll each job once and
    download the results of those that ended into `directory` (unless `stored(job_id)`: an
    interrupted harvest stored them already). The poller runs it without holding the database file."""
    fetched = Fetched()
    for i, job in enumerate(jobs):
        try:
            state = _poll(model, provider, job)
            if state is None or not state.ended:
                if state is None:
                    fetched.not_polled += 1
                else:
                    fetched.pending.append((job["job_id"], state.status))
                    fetched.pending_done += state.requests_done or 0
                continue
            if not stored(job["job_id"]):
                files = provider.download_results(state, job["batch_id"], directory)
                fetched.downloads += [(job["job_id"], source, path) for source, path in files]
        except ProviderUnavailable:
            # The retry budget is spent: this job and the rest stay pending (the caller says so).
            fetched.unavailable = True
            fetched.not_polled += len(jobs) - i
            break
        if state.results_gone:
            state.error = RETENTION_ENDED
            log.warning(f"{model}: batch {job['batch_id']}: {RETENTION_ENDED} (results already stored are kept)")
        fetched.ended.append((job["job_id"], state))
    return fetched


def _poll(model: str, provider: BatchProvider, job: dict) -> BatchState | None:
    """The job's state; for a batch the provider no longer knows, an ended state without results
    once it must have ended (GONE_AFTER_SECONDS), else None (left pending, with a warning)."""
    try:
        return provider.poll(job["batch_id"])
    except Exception as exc:
        if status_of(exc) != 404:
            raise
    if time.time() - job["created_at"].timestamp() > GONE_AFTER_SECONDS:
        return BatchState(status=JobStatus.GONE, ended=True, results_gone=True)
    log.warning(
        f"{model}: the provider says batch {job['batch_id']} does not exist; it was created less than a "
        f"day ago, so it is left pending: check that {provider.key_env_var} is the key of the organisation or "
        "workspace that created it"
    )
    return None


def is_stored(ledger: Ledger, job_id: str) -> bool:
    """Whether the job's result lines are stored (an interrupted harvest, or another process, stored them)."""
    return (
        ledger.con.execute(
            f"select count(*) from {ledger.table('llm_batch_results')} where job_id = ?", [job_id]
        ).fetchall()[0][0]
        > 0
    )


def store_lines(ledger: Ledger, downloads: list[tuple[str, str, str]]) -> None:
    """Store downloaded result files [(job id, source, path)] in one transaction: a cut-off
    download stores nothing (and is fetched again next run); one large append is written straight
    to the database file rather than through DuckDB's log."""
    con = ledger.con
    results = ledger.table("llm_batch_results")
    files = pa.table(
        {
            "path": [p for _, _, p in downloads],
            "job_id": [j for j, _, _ in downloads],
            "source": [s for _, s, _ in downloads],
            "has_lines": [os.path.getsize(p) > 0 for _, _, p in downloads],
        }
    )

    def write():  # one statement for all files, which DuckDB reads in parallel
        con.register(Scratch.downloads, files)
        try:
            with transaction(con):
                ledger.store_result_files(Scratch.downloads, files.column("path").to_pylist())
                # Lines are matched to their file by the name DuckDB reports; a file whose lines all went
                # unmatched would look like a batch without results: refuse, and store nothing.
                lost = con.execute(f"""select path from {Scratch.downloads} d where has_lines and not exists
                                       (select 1 from {results} r where r.job_id = d.job_id and r.source = d.source)""").fetchall()
                if lost:
                    raise RuntimeError(
                        f"dbt-llm-batch bug: the result lines of {lost[0][0]} could not be matched to "
                        f"their batch; nothing was stored, and the next run downloads them again"
                    )
        finally:
            con.unregister(Scratch.downloads)

    if downloads:
        retry_on_conflict(write)


def asked_earlier(ledger: Ledger, config: ModelConfig) -> dict[str, dict | None]:
    """{job id: its llm_output schema} of the ended jobs (Scratch.ended) asked with another schema than
    `config`'s: llm_output changed while they were in flight (jobs written before schemas were
    recorded count as asked with the current one)."""
    rows = ledger.con.execute(
        f"""select job_id, output_schema from {ledger.table("llm_batch_jobs")}
            where job_id in (select job_id from {Scratch.ended}) and output_schema is distinct from ?
              and output_schema is not null""",
        [asked_schema(config)],
    ).fetchall()
    return {job_id: json.loads(schema) for job_id, schema in rows}


def recheck(con, config: ModelConfig, table: str, job_id: str, schema: dict | None) -> None:
    """The answers of a job asked with an earlier llm_output (`schema`) are answers to that request
    (its fingerprint), checked against that schema: the current one's field checks would fail a good
    answer for lacking a field it was never asked for, as a billed attempt, and a change back would
    ask it again. It is kept, and shown only until the current request's answer is final (merge). What
    no schema changes is kept: a cut-off answer, and with structured output a JSON object."""
    structured = "coalesce(json_valid(answer), false) and json_type(answer) = 'OBJECT'" if config.structured else "true"
    con.execute(
        f"""update {table} set problem = null
            where job_id = ? and outcome = 'ok' and problem is not null and not coalesce(truncated, false)
              and {structured}""",
        [job_id],
    )
    if schema is not None:
        _validate(con, table, schema, f"job_id = {literal(job_id)}")


def settle(
    ledger: Ledger,
    provider: Provider,
    config: ModelConfig,
    jobs: list[tuple[str, BatchState]],
    price: dict | None,
    source: str | None = None,
) -> int:
    """Turn ended jobs' stored lines into request statuses, usage and cost, atomically with marking the
    jobs harvested (one transaction for all of them: the ledger is rewritten once, not once per job).
    Returns the number of result lines for custom_ids their job never sent (ignored, never merged).

    With `source`, only that group of a running realtime job's lines is settled: the job stays open
    and its other requests untouched (see realtime.py)."""
    con = ledger.con
    requests, results = ledger.table("llm_batch_requests"), ledger.table("llm_batch_results")
    reasons, backoffs = batch_failures.void_details(ledger, jobs)
    ended = pa.table(
        {
            "job_id": [j for j, _ in jobs],
            "status": [s.status for _, s in jobs],
            "error": [s.error for _, s in jobs],
            "plain_failure": [batch_failures.is_plain_failure(s) for _, s in jobs],
            "line_errors": [bool(s.line_errors) for _, s in jobs],
            "output_file_id": [s.output_file_id for _, s in jobs],
            "error_file_id": [s.error_file_id for _, s in jobs],
            "void_reason": pa.array(reasons, pa.string()),
            "backoff_seconds": pa.array(backoffs, pa.int64()),
        }
    )
    con.register(Scratch.ended, ended)
    con.register(Scratch.line_errors, batch_failures.line_errors_table(jobs))
    scope = f"job_id in (select job_id from {Scratch.ended}) {'and source = ?' if source else ''}"
    # A duplicated line must not settle a request twice (prefer a success). Duplicates are rare and
    # cheap to rule out on the stored custom_ids; ranking every line is not. Distinct custom_ids alone
    # rule them out faster than (job, custom_id) pairs; ranking a line that has no twin changes nothing.
    lines, duplicated = con.execute(
        f"select count(*), count(*) > count(distinct custom_id) from {results} where {scope}",
        [source] if source else [],
    ).fetchall()[0]
    one_per_id = "select * from lines"
    if duplicated:
        one_per_id += (
            " qualify row_number() over (partition by job_id, custom_id order by (outcome = 'ok') desc, source) = 1"
        )
    # Earlier failed attempts of the same (key, fingerprint) count towards llm_max_attempts. A model
    # with no failed request has none: its lines are not joined to their requests here (a third of
    # this statement on a million lines); settle_outcomes matches each to its queued request.
    failed_before = con.execute(
        f"select exists (select 1 from {requests} where model = ? and status = {sql(RequestStatus.FAILED)})",
        [ledger.model],
    ).fetchall()[0][0]
    outcomes = "\n            select *, 0 as earlier_failures from checked"
    if failed_before:
        outcomes = f""",
            settling as (
                select key, fingerprint, custom_id, job_id from {requests}
                where job_id in (select job_id from {Scratch.ended}) and status in {IN_FLIGHT_SQL}),
            failures as (  -- earlier failed attempts of the same (key, fingerprint)
                select p.key, p.fingerprint, count(*) as n from {requests} p
                where p.model = ? and p.status = {sql(RequestStatus.FAILED)} and (p.key, p.fingerprint) in
                      (select (key, fingerprint) from settling)
                group by all)
            select s.custom_id, s.job_id, c.* exclude (custom_id, job_id), coalesce(f.n, 0) as earlier_failures
            from settling s join checked c using (custom_id, job_id)
                 left join failures f using (key, fingerprint)"""
    con.execute(
        f"""create or replace temp table {Scratch.outcomes} as
            with parsed as (
                select json_transform(raw, '{json.dumps(provider.result_structure)}') as r, source, job_id
                from {results} where {scope}),
            lines as (select {provider.outcomes_sql("r")}, source, job_id from parsed),
            one_per_id as ({one_per_id}),
            checked as (
                select *, case when outcome = 'ok' then {answer_problem_sql(config)} end as problem,
                       -- the same request would fail the same way: final at once, never planned again.
                       -- Not JSON / off-schema answers are not among them: sampled again (temperature,
                       -- provider nondeterminism) they usually parse, so they keep llm_max_attempts.
                       coalesce((outcome = 'ok' and truncated) or (outcome = 'error' and not_retried is not null),
                                false) as permanent
                from one_per_id){outcomes}""",
        ([source] if source else []) + ([ledger.model] if failed_before else []),
    )
    earlier = asked_earlier(ledger, config)
    schema_problems(con, config, Scratch.outcomes, skip_jobs=list(earlier))
    for job_id, schema in earlier.items():
        recheck(con, config, Scratch.outcomes, job_id, schema)
    # Without a price, cost stays NULL: unknown, never $0. Unbilled outcomes (errors, expiries) have no usage: $0.
    cost = costs.cost_columns_sql(price, provider.self_hosted, "r.route", "o.") if price is not None else ""

    settled = [0]

    def write():
        with transaction(con):
            settled[0] = ledger.settle_outcomes(Scratch.outcomes, config.max_attempts, cost)
            if source:
                return
            batch_failures.fail_named_lines(ledger)
            batch_failures.settle_batch_failures(ledger, price is not None)
            # Requests a batch ended without answering (batch-level failure, lost lines) were never
            # settled by the provider: they go back to the queue without using up an attempt.
            ledger.void_unanswered(Scratch.ended, priced=price is not None)
            ledger.mark_harvested(Scratch.ended)

    try:
        retry_on_conflict(write)
        # Every line settling a queued request of its job (as many settled as lines, none duplicated)
        # leaves no unknown line: the anti-join over all lines is only needed when the counts differ.
        unknown = (
            0
            if source or (not duplicated and settled[0] == lines)
            else con.execute(
                f"""select count(distinct custom_id) from {results} l
                where job_id in (select job_id from {Scratch.ended}) and not exists
                      (select 1 from {requests} r where r.custom_id = l.custom_id and r.job_id = l.job_id)"""
            ).fetchall()[0][0]
        )
    finally:
        con.unregister(Scratch.ended)
        con.unregister(Scratch.line_errors)
        con.execute(f"drop table if exists {Scratch.outcomes}")
    batch_failures.log_backoffs(ledger, jobs)
    if unknown:
        log.warning(f"{ledger.model}: {unknown} result line(s) for custom_ids their batch never sent were ignored")
    return unknown
