"""One round of a poll: read the open work (file open), poll and download (file closed), store and
settle what ended (file open, under each model's lock), then delete the provider's files.

The DuckDB file is shared politely: DuckDB lets one process at a time open a file for writing, and a
`dbt run` holds it for its whole run. A round opens it only to read and, later, to store and settle
(seconds); polling and downloading happen with the file closed. While another process holds the file,
`open_shared` waits and retries with back-off until the caller's deadline, saying so once. Under the
file it re-reads which batches are still open and which have stored lines, so a batch a `dbt run`
harvested meanwhile is neither stored nor settled twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

import duckdb

from dbt_llm_batch.config import ModelConfig, parse_config
from dbt_llm_batch.errors import ConfigError, PollError
from dbt_llm_batch.ledger import Ledger
from dbt_llm_batch.ledger.locks import HOLDER, LockHeldError, ModelLock, is_lock_conflict
from dbt_llm_batch.ledger.status import IN_FLIGHT_SQL, PRE_SUBMISSION, JobStatus, RequestStatus, sql, sql_in
from dbt_llm_batch.log import log
from dbt_llm_batch.ops.poll_report import ModelPoll
from dbt_llm_batch.pipeline import costs, crashpoints, harvest, outcomes, pool, tempdirs
from dbt_llm_batch.providers import BatchProvider, calls, get_provider

FILE_WAIT_SECONDS = 60.0  # least wait for a DuckDB file another process holds (longer with a longer --wait)
NO_SNAPSHOT = (
    "cannot poll: its ledger does not yet say what settling it needs (it was last run by an earlier "
    "dbt-llm-batch); run it once with dbt first"
)


@dataclass
class _Target:
    """A model with open work (or an owed --then), as read from its ledger."""

    report: ModelPoll
    config: ModelConfig | None = None
    jobs: list[dict] = field(default_factory=list)
    stored: set[str] = field(default_factory=set)  # job ids with result lines already stored
    fetched: list[tuple[BatchProvider, harvest.Fetched]] = field(default_factory=list)
    # Harvested batches whose files the provider still keeps: (client, job id, batch id, file ids).
    to_delete: list[tuple[BatchProvider, str, str, list[str]]] = field(default_factory=list)
    # Other models of the ledger whose rows the batches this round settled answered (llm_dedup = 'ledger').
    sharers: list[ModelPoll] = field(default_factory=list)


def poll_once(
    database: str, schema: str | None, model: str | None, file_until: float, retry_budget: float, owe_then: bool
):
    """One round over every model; returns (model reports, the provider's error if it stayed
    unavailable, requests pending before this round). With `owe_then` (a poll with --then), each model
    whose rows it completed is recorded as owed the then-command. Raises PollError when it cannot poll."""
    con = open_shared(database, file_until)
    try:
        targets = _read(con, database, schema, model)
    finally:
        con.close()
    pending_before = sum(t.report.pending_requests for t in targets)
    unavailable = None
    with tempdirs.private_dir() as directory:
        for target in targets:
            unavailable = _fetch(target, directory, retry_budget) or unavailable
        crashpoints.reach("after_download")  # the results are on disk only: a kill here stores nothing
        if any(f.ended or f.pending for t in targets for _, f in t.fetched):
            con = open_shared(database, file_until)
            try:
                for target in targets:
                    if target.fetched:
                        _store(con, target)
                if owe_then:
                    _owe_then(con, targets)
                for target in targets:
                    _describe(con, target.report)
            finally:
                con.close()
    _delete_files(database, targets, file_until)
    reports = {(t.report.schema, t.report.model): t.report for t in targets}
    for sharer in (s for t in targets for s in t.sharers):
        report = reports.setdefault((sharer.schema, sharer.model), sharer)
        if report is not sharer:
            report.shared_rows += sharer.shared_rows
    return list(reports.values()), unavailable, pending_before


def open_shared(database: str, until: float):
    """A connection to the DuckDB file, waiting (with back-off, until `until`) while another process
    holds it; says once that it waits and for whom. Raises PollError if it stays held or cannot be read."""
    delay, said = 0.2, False
    while True:
        try:
            return duckdb.connect(database)
        except duckdb.IOException as exc:
            if not is_lock_conflict(exc):
                raise PollError(
                    f"cannot open the DuckDB file {database} ({exc}): pass the file your dbt profile writes (its `path`)"
                ) from None
            m = HOLDER.search(str(exc))
            holder = f"{m['program']} (PID {m['pid']})" if m else "another process"
            left = until - time.monotonic()
            if left <= 0:
                raise PollError(
                    f"the DuckDB file {database} stayed in use by {holder} (a dbt run holds it for its whole run); "
                    f"nothing was stored. Poll again once it ends, or give --wait a longer time"
                ) from None
            if not said:
                log.info(f"poll: {database} is in use by {holder}; waiting for it (up to {int(left)} s)")
                said = True
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)
        except duckdb.Error as exc:  # not a DuckDB file, a newer storage version, ...
            raise PollError(
                f"cannot open the DuckDB file {database} ({exc}): pass the file your dbt profile writes (its `path`)"
            ) from None


def _read(con, database: str, schema: str | None, model: str | None) -> list[_Target]:
    """The models with open work: batches not harvested, submissions not reconciled, a --then owed."""
    schemas = [
        r[0]
        for r in con.execute(
            "select distinct table_schema from information_schema.tables where table_name = 'llm_batch_jobs'"
            + (" and table_schema = ?" if schema else "")
            + " order by 1",
            [schema] if schema else [],
        ).fetchall()
    ]
    if not schemas:
        raise PollError(
            f"no dbt-llm-batch ledger in schema {schema} of {database}: pass --schema (the model's schema, or its "
            f"llm_ledger_schema)"
            if schema
            else f"no dbt-llm-batch ledger in {database}: pass the DuckDB file your dbt profile writes (its `path`)"
        )
    targets, known, matched = [], [], False
    for s in schemas:
        ledger = Ledger(con, s, "")
        snapshots = _snapshots(con, ledger)
        models = _models(con, ledger, snapshots)
        known += [snapshots.get(m, {}).get("dbt_name") or m.rsplit(".", 1)[-1] for m in models]
        if model is not None:
            models = [m for m in models if model in (m, m.rsplit(".", 1)[-1], snapshots.get(m, {}).get("dbt_name"))]
            matched = matched or bool(models)
            models += _answering_models(con, ledger, models)
        owed = (
            {o["model"]: o for o in ledger.owed_then_commands()}
            if _has_table(con, s, "llm_batch_then_commands")
            else {}
        )
        open_work = {
            r[0]
            for r in con.execute(
                f"""select distinct model from {ledger.table("llm_batch_jobs")} where harvested_at is null
                    and (batch_id is not null and status <> {sql(JobStatus.VOIDED)}
                         or batch_id is null and status in {sql_in(PRE_SUBMISSION)})"""
            ).fetchall()
        }
        for name in sorted(m for m in models if m in open_work or m in owed):
            targets.append(_target(con, ledger, name, snapshots.get(name), owed.get(name)))
    if model is not None and not matched:
        raise PollError(
            f"no model {model} in the ledgers of {database}"
            + (f" (they know {', '.join(sorted(set(known))[:20])})" if known else "")
            + ": pass --model the model's dbt name or schema.name, as `dbt-llm-batch status` lists it"
        )
    return targets


def _target(con, ledger: Ledger, name: str, snapshot: dict | None, owed: dict | None) -> _Target:
    report = ModelPoll(model=name, schema=ledger.schema, then_owed=owed)
    target = _Target(report)
    ledger.model = name
    target.jobs = [j for j in ledger.open_jobs() if j["batch_id"]]
    target.stored = {
        r[0]
        for r in con.execute(
            f"select distinct job_id from {ledger.table('llm_batch_results')} where model = ?", [name]
        ).fetchall()
    }
    _describe(con, report)
    if snapshot is None:
        if target.jobs:  # only batches need the config: an owed --then or a submission to reconcile do not
            report.cannot_poll = NO_SNAPSHOT
        return target
    report.dbt_name = snapshot.get("dbt_name")
    try:
        target.config = parse_config(snapshot["config"])
    except ConfigError as exc:
        if target.jobs:
            report.cannot_poll = (
                f"cannot poll: its stored config does not parse ({_one_line(exc)}); run it once with dbt"
            )
    return target


def _answering_models(con, ledger: Ledger, models: list[str]) -> list[str]:
    """The other models whose requests in flight answer rows of `models` (llm_dedup = 'ledger'): polling
    a model polls the batches its rows wait for, whoever sent them."""
    if not models or not _has_table(con, ledger.schema, "llm_batch_row_answers"):
        return []
    return [
        r[0]
        for r in con.execute(
            f"""select distinct r.model from {ledger.table("llm_batch_row_answers")} a
                join {ledger.table("llm_batch_requests")} r using (custom_id)
                where a.model in (select unnest($models)) and r.model not in (select unnest($models))
                  and r.status in {IN_FLIGHT_SQL} order by 1""",
            {"models": models},
        ).fetchall()
    ]


def _one_line(exc: Exception) -> str:
    """An error's message on one line (a config error lists its problems on lines of their own)."""
    return " ".join(str(exc).split())


def _models(con, ledger: Ledger, snapshots: dict[str, dict]) -> list[str]:
    """Every model the ledger knows: those it recorded a run of, and those with jobs."""
    jobs = {r[0] for r in con.execute(f"select distinct model from {ledger.table('llm_batch_jobs')}").fetchall()}
    return sorted(jobs | set(snapshots) | set(_recorded_models(con, ledger)))


def _recorded_models(con, ledger: Ledger) -> list[str]:
    if not _has_table(con, ledger.schema, "llm_batch_models"):
        return []
    return [r[0] for r in con.execute(f"select model from {ledger.table('llm_batch_models')}").fetchall()]


def _has_table(con, schema: str, table: str) -> bool:
    return con.execute(
        "select count(*) from information_schema.tables where table_schema = ? and table_name = ?", [schema, table]
    ).fetchall()[0][0]


def _snapshots(con, ledger: Ledger) -> dict[str, dict]:
    """Each model's settle snapshot (config.settle_snapshot), if its ledger has the column."""
    has_column = con.execute(
        """select count(*) from information_schema.columns where table_schema = ? and table_name = 'llm_batch_models'
           and column_name = 'config_snapshot'""",
        [ledger.schema],
    ).fetchall()[0][0]
    if not has_column:
        return {}
    return {
        name: json.loads(text)
        for name, text in con.execute(
            f"select model, config_snapshot from {ledger.table('llm_batch_models')} where config_snapshot is not null"
        ).fetchall()
    }


def _fetch(target: _Target, directory: str, retry_budget: float) -> str | None:
    """Poll the target's jobs (each through the provider and model it was sent with) and download what
    ended; returns the provider's last error if it stayed unavailable."""
    if target.config is None:
        return None
    groups: dict[tuple[str, str, str | None], list[dict]] = {}
    for job in target.jobs:
        groups.setdefault(pool.sender(job, target.config.model), []).append(job)
    unavailable = None
    for (provider_name, _, _), jobs in groups.items():
        config = dataclasses.replace(
            pool.sent_with(target.config, jobs[0]),
            retry_budget_seconds=min(target.config.retry_budget_seconds, retry_budget),
        )
        try:
            client = get_provider(provider_name)(config)
            client.check_credentials()
        except ConfigError as exc:  # its key is not set here: nothing ends until someone sets it
            why = f"cannot poll its {len(jobs)} batch(es) at {provider_name}: {_one_line(exc)}"
            target.report.cannot_poll = "; ".join(filter(None, (target.report.cannot_poll, why)))
            continue
        if not isinstance(client, BatchProvider):  # never the case: only a batch API gives batch ids
            continue
        try:
            fetched = harvest.fetch(
                target.report.model, client, jobs, directory, lambda job_id: job_id in target.stored
            )
        except Exception as exc:  # the provider refused (a rejected key): this model says so, the others go on
            variable = calls.key_variable(client)
            refused = calls.refusal(
                exc,
                f"llm_provider '{provider_name}' (llm_model '{config.model}')",
                calls.key_hint(client),
                secret=os.environ.get(variable) if variable else None,
                again="poll",
            )
            if refused is None:  # a bug: its traceback is what a report needs
                raise
            target.report.cannot_poll = "; ".join(filter(None, (target.report.cannot_poll, refused)))
            continue
        target.fetched.append((client, fetched))
        target.report.answered_in_open += fetched.pending_done
        if fetched.unavailable:
            unavailable = client.calls.last_error
    return unavailable


def _store(con, target: _Target) -> None:
    """Under the file and the model's lock: store the downloaded lines of the batches still open and
    not yet stored (a dbt run may have harvested some meanwhile), then settle them, as a run does."""
    report = target.report
    ledger = Ledger(con, report.schema, report.model)
    ledger.migrate()
    lock = ModelLock(ledger)
    try:
        lock.acquire()
    except LockHeldError as exc:  # a run of this model in this process (dbt threads, a notebook)
        report.skipped = f"not stored: {exc}"
        return
    try:
        open_now = {j["job_id"] for j in ledger.open_jobs()}
        for client, fetched in target.fetched:
            for job_id, status in fetched.pending:
                if job_id in open_now:
                    ledger.record_provider_status(job_id, status)
            ended = [(job_id, state) for job_id, state in fetched.ended if job_id in open_now]
            downloads = [d for d in fetched.downloads if d[0] in open_now and not harvest.is_stored(ledger, d[0])]
            harvest.store_lines(ledger, downloads)
            crashpoints.reach("after_store")
            if not ended:
                continue
            costs.load_prices(con, client.config.price_table)
            price = costs.price_of(con, *type(client).price_key(client.config))
            outcomes.settle(ledger, client, client.config, ended, price)
            report.harvested_batches += len(ended)
            _count_outcomes(con, ledger, target, [job_id for job_id, _ in ended])
            if client.config.delete_provider_files:
                target.to_delete += [
                    (client, job_id, batch_id, [f for f in file_ids if f])
                    for job_id, batch_id, *file_ids in con.execute(
                        f"""select job_id, batch_id, input_file_id, output_file_id, error_file_id
                            from {ledger.table("llm_batch_jobs")} where job_id in (select unnest(?))
                              and harvested_at is not null and files_deleted_at is null""",
                        [[job_id for job_id, _ in ended]],
                    ).fetchall()
                ]
        ledger.hold_cancelled()  # as a run does after its harvest (reconcile.after_harvest)
    finally:
        lock.release()


def _count_outcomes(con, ledger: Ledger, target: _Target, job_ids: list[str]) -> None:
    """What settling `job_ids` decided: the model's final outcomes and retries, and the rows of other
    models that point at its now final requests (llm_dedup = 'ledger'): their next run merges them too."""
    report, requests = target.report, ledger.table("llm_batch_requests")
    succeeded, failed, retrying = con.execute(
        f"""select count(*) filter (where status = {sql(RequestStatus.SUCCEEDED)} and is_final),
                   count(*) filter (where status = {sql(RequestStatus.FAILED)} and is_final),
                   count(*) filter (where status = {sql(RequestStatus.FAILED)} and not is_final)
            from {requests} where model = ? and job_id in (select unnest(?))""",
        [report.model, job_ids],
    ).fetchall()[0]
    report.succeeded += succeeded
    report.failed += failed
    report.retrying += retrying
    sharers = con.execute(
        f"""select a.model, count(*) from {ledger.table("llm_batch_row_answers")} a join {requests} r using (custom_id)
            where r.job_id in (select unnest(?)) and r.is_final and a.model <> r.model
            group by a.model order by a.model""",
        [job_ids],
    ).fetchall()
    snapshots = _snapshots(con, ledger) if sharers else {}
    for name, rows in sharers:
        dbt_name = snapshots.get(name, {}).get("dbt_name")
        target.sharers.append(ModelPoll(model=name, schema=ledger.schema, dbt_name=dbt_name, shared_rows=rows))


def _owe_then(con, targets: list[_Target]) -> None:
    """Record the then-command as owed to each model whose rows this round completed (its own requests
    or shared ones), as soon as they are stored: a poll stopped before its command exits, however long
    its --wait, leaves the command owed, and the next poll with --then runs it (ledger/then_commands.py)."""
    owed: dict[str, dict[str, str]] = {}
    for report in (r for t in targets for r in (t.report, *t.sharers) if r.new_results):
        owed.setdefault(report.schema, {})[report.model] = report.selector_name
    for schema, models in owed.items():
        Ledger(con, schema, "").record_then_owed(models)


def _delete_files(database: str, targets: list[_Target], file_until: float) -> None:
    """As a run does after its harvest (reconcile.delete_provider_files, llm_delete_provider_files):
    delete the stored batches' files at the provider, with the file closed, then record it, so the
    next run has nothing left to ask the provider. A failure is recorded; the next run tries again."""
    done: list[tuple[_Target, str, str | None]] = []
    for target in targets:
        for client, job_id, batch_id, file_ids in target.to_delete:
            try:
                client.delete_files(batch_id, file_ids)
                done.append((target, job_id, None))
            except Exception as exc:
                log.warning(
                    f"{target.report.model}: could not delete the files of batch {batch_id} "
                    f"({type(exc).__name__}: {exc}); the results are stored, the next run tries again"
                )
                done.append((target, job_id, f"{type(exc).__name__}: {exc}"[:1000]))
    if not done:
        return
    con = open_shared(database, max(file_until, time.monotonic() + FILE_WAIT_SECONDS))
    try:
        now = con.execute("select now()").fetchall()[0][0]
        for target, job_id, error in done:
            ledger = Ledger(con, target.report.schema, target.report.model)
            if error is None:
                ledger.update_job(job_id, files_deleted_at=now, files_delete_error=None)
            else:
                ledger.update_job(job_id, files_delete_error=error)
    finally:
        con.close()


def _describe(con, report: ModelPoll) -> None:
    """The model's open batches, unreconciled submissions, requests in flight and the age of the oldest."""
    ledger = Ledger(con, report.schema, report.model)
    jobs = ledger.open_jobs()
    report.open_batches = len([j for j in jobs if j["batch_id"]])
    report.unreconciled = len([j for j in jobs if not j["batch_id"] and j["status"] in PRE_SUBMISSION])
    report.pending_requests, report.oldest_pending_seconds = con.execute(
        f"""select count(*), epoch(now() - min(queued_at)) from {ledger.table("llm_batch_requests")}
            where model = ? and status in {IN_FLIGHT_SQL}""",
        [report.model],
    ).fetchall()[0]
